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

Models whose layers read more of the layout than the attention does keep the padded batch (the
patch decides, ``surgery.api``): sliding-window or chunked layers (their masks follow positions in
the row), linear attention (a recurrent state along the row), shared key/value layers, multimodal
positions, latent attention, a multimodal wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from surgery.compiling import host_read
from surgery.kernels.rows import padded_rows, real_rows

__all__ = [
    "ROW_CALLS_MAX",
    "UNPADDED_KWARG",
    "Unpadded",
    "pad_heads",
    "right_padding",
    "unpadded_layout",
]

ROW_CALLS_MAX = 8
"""The most rows whose attention runs one sdpa call a row; a batch of more runs one padded call.
The per-row calls were measured faster at 2 rows (``docs/benchmarks.md``, padding-free steps);
the bound itself is not tuned."""

UNPADDED_KWARG = "surgery_unpadded"
"""The keyword argument that carries ``Unpadded`` from the causal-LM forward through the base model
and its decoder layers to the attention."""


@dataclass(frozen=True)
class Unpadded:
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


def right_padding(
    attention_mask: torch.Tensor, targets: torch.Tensor, ignore_index: int, unpad: bool
) -> tuple[bool, Unpadded | None]:
    """Whether a (batch, seq) ``attention_mask`` is right padding only (each row: ones, then
    zeros) and every padding position's target is ``ignore_index`` (then, under causal attention,
    nothing a loss reads depends on a padding position and the mask can be dropped); and, with
    ``unpad`` where it is and some padding exists, the ``Unpadded`` layout of the real tokens.
    Device-to-host reads: the verdict, then (``unpad``) each row's count of real tokens; the
    positions of the real and padding tokens are found at those known sizes, without a read."""
    if attention_mask.dim() != 2 or targets.shape != attention_mask.shape:
        return False, None
    real = attention_mask.to(targets.device) != 0
    right = (real[:, 1:] <= real[:, :-1]).all()
    if not bool(right & (real | (targets == ignore_index)).all()):
        return False, None
    if not unpad:
        return True, None
    batch, seq = real.shape
    counts = real.sum(1).tolist()
    tokens = sum(counts)
    if tokens in (batch * seq, 0):  # nothing to leave out
        return True, None
    flat = real.reshape(-1)
    index = torch.nonzero_static(flat, size=tokens).squeeze(1)
    gather = torch.zeros(batch * seq, dtype=torch.long, device=index.device)
    gather[index] = torch.arange(tokens, device=index.device)
    padding = torch.nonzero_static(~flat, size=batch * seq - tokens).squeeze(1)
    lengths = tuple(n for n in counts if n)
    return True, Unpadded(index, gather, padding, (index % seq)[None], batch, seq, lengths)


unpadded_layout = host_read(right_padding)
