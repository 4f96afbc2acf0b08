"""Padding-free training steps: a right-padded batch runs its real tokens only
(``PatchOptions.padding_free``).

A right-padded training batch whose padding carries no loss (``causal_right_padding``'s check)
spends the padding's share of every matrix product, norm, activation and attention on positions
whose output nothing reads. Here the causal-LM forward hands the base model the real tokens alone,
as one row (batch 1, ``T`` tokens, the rows one after another), and each attention layer runs sdpa
causal, unmasked, on each row's real tokens alone (``Unpadded.lengths``: slices of the one row, no
copies), and puts the rows' outputs one after another again:

    tokens (1, T) --embed, norms, q/k/v, RoPE at each token's own position--> (1, H, T, D)
      --split into rows--> (1, H, L_i, D) --sdpa, causal--> (1, L_i, H, D) --concatenated--> ...

A batch of more than ``ROW_CALLS_MAX`` rows (one sdpa call a row would cost more launches than
the padding's share of the attention), and a compiled step whose rotated queries and keys are
rebuilt in the backward (behind q/k norms, ``surgery.attention.forward``: sliced outside their
rebuilt region they were kept by the partitioner), put the rotated queries, keys and values back
into the (batch, seq) layout instead, with zeros at the padding (the queries and keys inside that
region), for one sdpa call, and take the real rows of the output again (``pad_heads``,
``Unpadded.take``). Neither runs flash attention's variable-length kernel, the one that takes a
row's end from a list of lengths: it ran slower than sdpa's cuDNN kernel over the same rows
(``benchmarks/results/padding_free_attention.txt``).

Exact for every trained token: each attends causally to its own row's real tokens, at the
positions the padded batch gives them, and the loss reads each row's targets with the row's end as
a sequence boundary (no token predicts the next row's first). The padded layout's zeros are
padding keys no real query sees (causal attention over right padding) and padding queries whose
outputs are dropped: their gradients are zero.

A left-padded batch cannot leave its padding out: transformers trains each row's first real
token from the last padding position (whose attention sees no key), so those positions' outputs
are part of the loss. It runs rolled instead (``Rolled``): each row turned so that its real tokens
come first and its padding after them, at the positions the padded batch gives them, causal and
unmasked (sdpa's flash kernel), the padding positions' attention outputs set to what an
attention that sees no key gives them (``zero_unattended_rows``), and each token trained on its
own target (the labels shifted first, then rolled).

Models whose layers read more of the layout than the attention does keep the padded batch (the
patch decides, ``surgery.patching.plan``): sliding-window or chunked layers (their masks follow
positions in the row), linear attention (a recurrent state along the row), shared key/value
layers, multimodal positions, latent attention, a multimodal wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from surgery.attention.layout import BatchLayout
from surgery.compiling import host_read
from surgery.kernels.rows import padded_rows, real_rows

__all__ = [
    "ROLLED_KWARG",
    "ROW_CALLS_MAX",
    "UNPADDED_KWARG",
    "PaddedLayout",
    "Rolled",
    "Unpadded",
    "pad_heads",
    "padded_layout",
    "read_padded_layout",
]

ROW_CALLS_MAX = 8
"""The most rows whose attention runs one sdpa call a row; a batch of more runs one padded call.
The per-row calls were measured faster at 2 rows (``docs/benchmarks.md``, padding-free steps);
the bound itself is not tuned."""

UNPADDED_KWARG = "surgery_unpadded"
"""The keyword argument that carries ``Unpadded`` from the causal-LM forward through the base model
and its decoder layers to the attention."""


@dataclass(frozen=True)
class Unpadded(BatchLayout):
    """Where the real tokens of a right-padded (batch, seq) batch sit."""

    index: torch.Tensor
    """int64 (T,): each real token's index in the flattened (batch * seq) batch, in order."""
    gather: torch.Tensor
    """int64 (batch * seq,): each position's real token (its index in the T), 0 at padding."""
    padding: torch.Tensor
    """int64 (batch * seq - T,): the padding positions in the flattened batch."""
    positions: torch.Tensor
    """int64 (1, T): each real token's position in its row (its RoPE position)."""
    batch: int
    seq: int
    lengths: tuple[int, ...]
    """The real-token count of each row that has any, in order (they sum to T)."""

    @property
    def per_row(self) -> bool:
        """Whether the attention runs one call per row (``ROW_CALLS_MAX``) rather than padded."""
        return len(self.lengths) <= ROW_CALLS_MAX

    @property
    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors the ops take: ``index``, ``gather``, ``padding``."""
        return self.index, self.gather, self.padding

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The real tokens of a (batch, seq, ...) tensor (a batch's inputs and labels, a padded
        attention's output) as (1, T, ...)."""
        flat = x.reshape(self.batch * self.seq, *x.shape[2:])
        return real_rows(flat, *self.layout)[None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(1, H, T, D) -> (batch, H, seq, D), zeros at the padding (``pad_heads``)."""
        return pad_heads(x, *self.layout, self.batch, self.seq)

    def restore(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Tensors of the real tokens, each (1, T, ...) or flattened (T, ...) as a MoE layer's
        router logits, in the caller's layout: (batch, seq, ...) or (batch * seq, ...), zeros at
        the padding (whose tokens did not run). Differentiable."""
        tokens = self.index.shape[0]
        restored = []
        for x in tensors:
            batched = x.dim() > 1 and x.shape[:2] == (1, tokens)
            full = padded_rows(x[0] if batched else x, *self.layout)
            restored.append(full.view(self.batch, self.seq, *full.shape[1:]) if batched else full)
        return tuple(restored)


def pad_heads(
    x: torch.Tensor,
    index: torch.Tensor,
    gather: torch.Tensor,
    padding: torch.Tensor,
    batch: int,
    seq: int,
) -> torch.Tensor:
    """(1, H, T, D) real tokens -> (batch, H, seq, D), zeros at the padding: a transposed view of
    a (batch, seq, H, D) tensor, the layout transformers hands sdpa. The tensors are an
    ``Unpadded``'s ``layout`` (taken apart, for a function rebuilt in the backward that needs its
    tensors as arguments)."""
    _, heads, _, dim = x.shape
    full = padded_rows(x[0].transpose(0, 1), index, gather, padding)  # (batch * seq, H, D)
    return full.view(batch, seq, heads, dim).transpose(1, 2)


ROLLED_KWARG = "surgery_rolled"
"""The keyword argument that carries ``Rolled`` from the causal-LM forward to the attention."""


@dataclass(frozen=True)
class Rolled(BatchLayout):
    """A left-padded (batch, seq) batch with each row rolled so that its real tokens come first
    and its padding after them: then causal attention without a mask is the padded batch's masked
    attention for every real token (no real token sees a padding key), and the padding queries,
    which see no key there, get the output of an attention that sees none (``unattended``)."""

    order: torch.Tensor
    """int64 (batch, seq): the rolled row's j-th token is the caller's row's ``order[b, j]``-th.
    Also each token's RoPE position: transformers gives a batch without position ids the
    positions 0..seq-1 of its columns, padding included."""
    unattended: torch.Tensor
    """bool (batch, seq, 1): the padding positions of the rolled rows."""

    @property
    def positions(self) -> torch.Tensor:
        return self.order

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """A (batch, seq, ...) tensor of the caller's layout, rolled."""
        return _gather_columns(x, self.order)

    def restore(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Tensors of the rolled tokens, each (batch, seq, ...) or flattened (batch * seq, ...) as
        a MoE layer's router logits, in the caller's order."""
        batch, seq = self.order.shape
        inverse = torch.argsort(self.order, dim=1)
        return tuple(
            _gather_columns(x if x.shape[:2] == (batch, seq) else x.view(batch, seq, *x.shape[1:]),
                            inverse).view(x.shape)
            for x in tensors
        )  # fmt: skip


def _gather_columns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    index = order.view(*order.shape, *([1] * (x.dim() - 2))).expand(*order.shape, *x.shape[2:])
    return torch.gather(x, 1, index.to(x.device))


class PaddedLayout(NamedTuple):
    """``padded_layout``'s answer: ``right_padded``, whether a causal attention may drop the mask
    (right padding only, none of it trained); ``layout``, the layout the batch runs in (None: its
    own); ``padding``, whether any position is padding (False: a mask of ones, the batch is the
    one without a mask; True also where the mask was not read, not being (batch, seq))."""

    right_padded: bool
    layout: Unpadded | Rolled | None
    padding: bool


def padded_layout(
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    unpad: bool,
    device: torch.device | None = None,
) -> PaddedLayout:
    """Whether a (batch, seq) ``attention_mask`` is right padding only (each row: ones, then
    zeros) and every padding position's target is ``ignore_index`` (then, under causal attention,
    nothing a loss reads depends on a padding position and the mask can be dropped); and, with
    ``unpad`` where some padding exists, the layout the batch runs in: right padding's real tokens
    alone (``Unpadded``), or, for a mask that is left padding only (each row: zeros, then ones),
    its rows rolled (``Rolled``; whatever the padding's targets); else None; and whether any
    position is padding (``PaddedLayout``). ``targets`` (the labels, or pre-shifted ones) must
    have the mask's shape, or the verdict is no. The layout's tensors live on ``device`` (default:
    the targets').
    One device-to-host read: both verdicts with each row's count of real tokens; the positions of
    the real and padding tokens are then found at those known sizes, without another."""
    if attention_mask.dim() != 2 or targets.shape != attention_mask.shape:
        return PaddedLayout(False, None, True)
    device = targets.device if device is None else device
    real, targets = attention_mask.to(device) != 0, targets.to(device)
    counts = real.sum(1)
    right = (real[:, 1:] <= real[:, :-1]).all() & (real | (targets == ignore_index)).all()
    left = (real[:, 1:] >= real[:, :-1]).all()
    is_right, is_left, *counts_read = torch.cat((torch.stack((right, left)), counts)).tolist()
    batch, seq = real.shape
    tokens = sum(counts_read)
    padding = tokens != batch * seq
    if not unpad or tokens in (batch * seq, 0):  # nothing to leave out or roll
        return PaddedLayout(bool(is_right), None, padding)
    if is_right:
        return PaddedLayout(True, _unpadded(real, counts_read), padding)
    if is_left:
        return PaddedLayout(False, _rolled(seq - counts, seq), padding)
    return PaddedLayout(False, None, padding)


def _unpadded(real: torch.Tensor, counts: list[int]) -> Unpadded:
    batch, seq = real.shape
    tokens = sum(counts)
    flat = real.reshape(-1)
    index = torch.nonzero_static(flat, size=tokens).squeeze(1)
    gather = torch.zeros(batch * seq, dtype=torch.long, device=index.device)
    gather[index] = torch.arange(tokens, device=index.device)
    padding = torch.nonzero_static(~flat, size=batch * seq - tokens).squeeze(1)
    lengths = tuple(n for n in counts if n)
    return Unpadded(index, gather, padding, (index % seq)[None], batch, seq, lengths)


def _rolled(pads: torch.Tensor, seq: int) -> Rolled:
    """The ``Rolled`` layout of rows whose first ``pads[b]`` positions are padding."""
    columns = torch.arange(seq, device=pads.device)
    order = (columns[None] + pads[:, None]) % seq
    unattended = (columns[None] >= (seq - pads)[:, None])[..., None]
    return Rolled(order, unattended)


read_padded_layout = host_read(padded_layout)
"""``padded_layout`` as the forward calls it: one host read, a deliberate graph break under
``torch.compile`` (``surgery.compiling.host_read``)."""
