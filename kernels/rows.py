"""Row gathers whose backward is a gather too: an MoE block's token rows in expert order
(``token_rows``), and a right-padded batch's real tokens and back (``real_rows``, ``padded_rows``).

Autograd's own backward of ``x[index]`` scatter-adds into a zero tensor of ``x``'s size: atomics,
a fill, and several times the gather's time. Here each backward is a gather: ``token_rows``'
sums each token's ``top_k`` slots in slot order (``gather_sum``, fp32, rounded once), and
``padded_rows`` and ``real_rows`` are each the other's backward.

They are ``torch.library`` ops with registered autograd rather than ``autograd.Function``s: inside
an activation-checkpoint region that rebuilds them in the backward (the MoE rows, the padded
rotated queries and keys of q/k-norm models), torch 2.11's partitioner kept a Function's output
instead of rebuilding it. Plain PyTorch; the references beside them are the indexing they stand
for, differentiated by autograd.
"""

from __future__ import annotations

import torch

from .gather_sum import gather_sum

__all__ = [
    "padded_rows",
    "padded_rows_reference",
    "real_rows",
    "real_rows_reference",
    "token_rows",
    "token_rows_reference",
]


@torch.library.custom_op("surgery::token_rows", mutates_args=())
def token_rows(
    hidden_states: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, top_k: int
) -> torch.Tensor:
    """``hidden_states[rows]``: each token's row once per slot, in expert order (``rows`` = perm //
    top_k; slot j = token x top_k + k sits at row ``inverse[j]``). The backward sums each token's
    slots in slot order (``gather_sum``)."""
    return hidden_states[rows]


@token_rows.register_fake
def _(hidden_states, rows, inverse, top_k):
    return hidden_states.new_empty((rows.shape[0], *hidden_states.shape[1:]))


def _token_rows_context(ctx, inputs, output):
    _, _, inverse, top_k = inputs
    ctx.save_for_backward(inverse)
    ctx.top_k = top_k


def _token_rows_backward(ctx, grad):
    (inverse,) = ctx.saved_tensors
    return gather_sum(grad, inverse, ctx.top_k), None, None, None


token_rows.register_autograd(_token_rows_backward, setup_context=_token_rows_context)


def token_rows_reference(hidden_states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``token_rows`` as indexing (autograd's scatter-add backward)."""
    return hidden_states[rows]


@torch.library.custom_op("surgery::padded_rows", mutates_args=())
def padded_rows(
    x: torch.Tensor, index: torch.Tensor, gather: torch.Tensor, padding: torch.Tensor
) -> torch.Tensor:
    """(T, ...) real rows -> (batch * seq, ...): row ``gather[i]`` of ``x`` at row i, zeros at the
    rows ``padding`` lists (a padded layout's ``index``, ``gather`` and ``padding``:
    ``surgery.attention.unpadding.Unpadded``)."""
    return x.index_select(0, gather).index_fill_(0, padding, 0)


@padded_rows.register_fake
def _(x, index, gather, padding):
    return x.new_empty((gather.shape[0], *x.shape[1:]))


@torch.library.custom_op("surgery::real_rows", mutates_args=())
def real_rows(
    y: torch.Tensor, index: torch.Tensor, gather: torch.Tensor, padding: torch.Tensor
) -> torch.Tensor:
    """(batch * seq, ...) -> its (T, ...) real rows, ``index``'s."""
    return y.index_select(0, index)


@real_rows.register_fake
def _(y, index, gather, padding):
    return y.new_empty((index.shape[0], *y.shape[1:]))


def _padded_rows_backward(ctx, grad):
    return real_rows(grad, *ctx.layout), None, None, None


def _real_rows_backward(ctx, grad):
    return padded_rows(grad, *ctx.layout), None, None, None


def _keep_layout(ctx, inputs, output):
    ctx.layout = inputs[1:]


padded_rows.register_autograd(_padded_rows_backward, setup_context=_keep_layout)
real_rows.register_autograd(_real_rows_backward, setup_context=_keep_layout)


def padded_rows_reference(
    x: torch.Tensor, index: torch.Tensor, gather: torch.Tensor, padding: torch.Tensor
) -> torch.Tensor:
    """``padded_rows`` as a scatter into zeros of the padded size."""
    out = x.new_zeros((gather.shape[0], *x.shape[1:]))
    return out.index_put((index,), x)


def real_rows_reference(
    y: torch.Tensor, index: torch.Tensor, gather: torch.Tensor, padding: torch.Tensor
) -> torch.Tensor:
    """``real_rows`` as indexing."""
    return y[index]
