"""An embedding lookup whose backward is one opaque op: PyTorch's own ``embedding_dense_backward``.

Eagerly, ``F.embedding``'s backward on CUDA sorts the token ids and sums each row's gradients in
fp32 within its segment, writing the gradient in the weight's dtype. Under ``torch.compile``,
Inductor decomposes the same backward into a zero-filled table in fp32, an accumulating
``index_put`` and a cast: for a bf16 model an fp32 copy of the whole table is alive at the end of
the backward beside the bf16 gradient (the largest block at the compiled Qwen3-MoE step's peak:
``benchmarks/results/memory_qwen3_moe_surgery_compiled_padded-before-embedding-op.txt``).

``embedding`` is ``F.embedding`` with its backward in the torch library op
``surgery::embedding_backward``, which calls ``torch.ops.aten.embedding_dense_backward``: the
eager gradient bit for bit, and one node that a compiled graph calls as it is. The forward (a
gather) stays visible to the compiler. Not differentiable twice.

Reference: ``F.embedding`` itself (``embedding_reference``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["embedding", "embedding_backward", "embedding_reference"]


@torch.library.custom_op("surgery::embedding_backward", mutates_args=())
def embedding_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """The gradient of a (num_weights, dim) table from ``grad`` (``indices.shape`` + (dim,)):
    ``aten.embedding_dense_backward``; no gradient reaches row ``padding_idx`` (-1: none)."""
    return torch.ops.aten.embedding_dense_backward(
        grad, indices, num_weights, padding_idx, scale_grad_by_freq
    )


@embedding_backward.register_fake
def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty(num_weights, grad.shape[-1])


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, padding_idx, scale_grad_by_freq):
        ctx.save_for_backward(indices)
        ctx.meta = (weight.shape[0], padding_idx, scale_grad_by_freq)
        return F.embedding(indices, weight)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        num_weights, padding_idx, scale_grad_by_freq = ctx.meta
        dw = embedding_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
        return None, dw, None, None


def embedding(
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    scale_grad_by_freq: bool = False,
) -> torch.Tensor:
    """``F.embedding(indices, weight, padding_idx, scale_grad_by_freq=...)`` (no ``max_norm``,
    dense gradient), its weight's gradient from ``surgery::embedding_backward``. Without a
    gradient to compute, ``F.embedding`` itself."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return embedding_reference(indices, weight, padding_idx, scale_grad_by_freq)
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:  # as F.embedding reads it
        padding_idx += weight.shape[0]
    return _Embedding.apply(indices, weight, int(padding_idx), bool(scale_grad_by_freq))


def embedding_reference(
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    scale_grad_by_freq: bool = False,
) -> torch.Tensor:
    """``F.embedding``: what ``embedding`` computes, forward and backward."""
    return F.embedding(indices, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
