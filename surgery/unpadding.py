"""Padding-free training steps: a right-padded batch runs its real tokens only, except in the
attention (``PatchOptions.padding_free``).

A right-padded training batch whose padding carries no loss (``causal_right_padding``'s check)
spends the padding's share of every matrix product, norm and activation on positions whose output
nothing reads. Here the causal-LM forward hands the base model the real tokens alone, as one row
(batch 1, ``T`` tokens, the rows one after another), and each attention layer puts its rotated
queries, keys and values back into the (batch, seq) layout, with zeros at the padding, for sdpa's
causal kernel, and takes the real rows of the output again:

    tokens (1, T) --embed, norms, q/k/v, RoPE at each token's own position--> (1, H, T, D)
      --pad--> (B, H, S, D) --sdpa, causal, unmasked--> (B, S, H, D) --unpad--> (1, T, H, D) ...

The attention stays in the padded layout because the attention kernel that takes a row's end from
a list of lengths (flash attention's variable-length one) ran 1.5x slower than sdpa's cuDNN kernel
over the same rows on the H100 (``benchmarks/results/padding_free_attention.txt``). Exact for
every trained token: each attends causally to its own row's real tokens, at the positions the
padded batch gives them, and the loss reads each row's targets with the row's end as a sequence
boundary (no token predicts the next row's first). The padded layout's zeros are padding keys no
real query sees (causal attention over right padding) and padding queries whose outputs are
dropped: their gradients are zero.

Models whose layers read more of the layout than the attention does keep the padded batch (the
patch decides, ``surgery.api``): sliding-window or chunked layers (their masks follow positions in
the row), linear attention (a recurrent state along the row), shared key/value layers, multimodal
positions, latent attention, a multimodal wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compiling import host_read

__all__ = ["UNPADDED_KWARG", "Unpadded", "unpadded_layout"]

UNPADDED_KWARG = "surgery_unpadded"
"""The keyword argument that carries ``Unpadded`` from the causal-LM forward through the base model
and its decoder layers to the attention."""


def _rows_or_zeros(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Row ``source[i]`` of ``x`` at row i, or zeros where ``source[i]`` is -1: one gather (one
    kernel compiled), no fill and no scatter."""
    rows = x.index_select(0, source.clamp(min=0))
    keep = (source >= 0).view(-1, *(1,) * (x.dim() - 1))
    return torch.where(keep, rows, torch.zeros((), dtype=x.dtype, device=x.device))


class _Pad(torch.autograd.Function):
    """(T, ...) real rows -> (batch * seq, ...) with zeros at the padding; the backward takes the
    real rows of the gradient (a gather: autograd's own backward of a gather is a scatter-add,
    which on the H100 ran six times as long)."""

    @staticmethod
    def forward(ctx, x, index, source):
        ctx.save_for_backward(index)
        return _rows_or_zeros(x, source)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _Unpad(torch.autograd.Function):
    """(batch * seq, ...) -> its (T, ...) real rows; the backward pads the gradient again."""

    @staticmethod
    def forward(ctx, y, index, source):
        ctx.save_for_backward(source)
        return y.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (source,) = ctx.saved_tensors
        return _rows_or_zeros(grad, source), None, None


@dataclass(frozen=True)
class Unpadded:
    """Where the real tokens of a right-padded (batch, seq) batch sit."""

    index: torch.Tensor
    """int64 (T,): each real token's index in the flattened (batch * seq) batch, in order."""
    source: torch.Tensor
    """int64 (batch * seq,): each position's real token (its index in the T), -1 at padding."""
    positions: torch.Tensor
    """int64 (1, T): each real token's position in its row (its RoPE position)."""
    batch: int
    seq: int

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The real tokens of a (batch, seq, ...) tensor as (1, T, ...)."""
        flat = x.reshape(self.batch * self.seq, *x.shape[2:])
        return _Unpad.apply(flat, self.index, self.source)[None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(1, H, T, D) -> (batch, H, seq, D), zeros at the padding (a transposed view of a
        (batch, seq, H, D) tensor, the layout transformers hands sdpa)."""
        _, heads, _, dim = x.shape
        full = _Pad.apply(x[0].transpose(0, 1), self.index, self.source)  # (batch * seq, H, D)
        return full.view(self.batch, self.seq, heads, dim).transpose(1, 2)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """(batch, seq, H, D), an attention's output -> (1, T, H, D)."""
        return self.take(y)


def right_padding(
    attention_mask: torch.Tensor, targets: torch.Tensor, ignore_index: int, unpad: bool
) -> tuple[bool, Unpadded | None]:
    """Whether a (batch, seq) ``attention_mask`` is right padding only (each row: ones, then
    zeros) and every padding position's target is ``ignore_index`` (then, under causal attention,
    nothing a loss reads depends on a padding position and the mask can be dropped); and, with
    ``unpad`` where it is and some padding exists, the ``Unpadded`` layout of the real tokens.
    Device-to-host reads: the verdict, then (``unpad``) the real tokens' count."""
    if attention_mask.dim() != 2 or targets.shape != attention_mask.shape:
        return False, None
    real = attention_mask.to(targets.device) != 0
    right = (real[:, 1:] <= real[:, :-1]).all()
    if not bool(right & (real | (targets == ignore_index)).all()):
        return False, None
    if not unpad:
        return True, None
    batch, seq = real.shape
    index = real.reshape(-1).nonzero().squeeze(1)
    if index.numel() == batch * seq or index.numel() == 0:  # nothing to leave out
        return True, None
    source = torch.full((batch * seq,), -1, dtype=torch.long, device=index.device)
    source[index] = torch.arange(index.numel(), device=index.device)
    return True, Unpadded(index, source, (index % seq)[None], batch, seq)


unpadded_layout = host_read(right_padding)
