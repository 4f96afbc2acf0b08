"""torch.library ops over RMSNorm's launchers and its one autograd formula, used two ways: the
forward op's registered autograd (torch.compile) and the eager ``RmsNormFunction``."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..dispatch import eager_function
from .launch import _out_dtype, rms_norm_bwd, rms_norm_fwd

__all__ = ["RmsNormFunction"]

# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile, so a model using rms_norm traces with fullgraph=True.
# One autograd formula (``_save_fwd``, ``_backward``) is the forward op's registered autograd and,
# over the launchers, the eager ``RmsNormFunction``.


@torch.library.custom_op("surgery::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_fwd(x2d, weight, eps, offset, casting)


@_rms_norm_fwd_op.register_fake
def _(x2d, weight, eps, offset, casting):
    n_rows, N = x2d.shape
    y = x2d.new_empty(n_rows, N, dtype=_out_dtype(x2d.dtype, weight.dtype, casting))
    return y, x2d.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op("surgery::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    casting: str,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = rms_norm_bwd(dy, x2d, weight, rstd, offset, casting, compute_dw)
    # An op returns tensors only: an empty dw stands for "not asked for".
    return dx, dw if dw is not None else weight.new_empty(0)


@_rms_norm_bwd_op.register_fake
def _(dy, x2d, weight, rstd, offset, casting, compute_dw):
    return torch.empty_like(x2d), weight.new_empty(weight.shape[0] if compute_dw else 0)


def _save_fwd(ctx, inputs, output):
    x2d, weight, _, offset, casting = inputs
    ctx.save_for_backward(x2d, weight, output[1])
    ctx.norm_args = (offset, casting)
    # rstd is for the backward alone: no gradient reaches it, and none is made of zeros for it.
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(bwd):
    # ``bwd``: the backward op (its dw empty when not asked for) or launcher (None then).
    def backward(ctx, dy, _drstd):
        x2d, weight, rstd = ctx.saved_tensors
        offset, casting = ctx.norm_args
        compute_dw = ctx.needs_input_grad[1]
        if dy.stride(-1) != 1:  # the launchers take any row stride
            dy = dy.contiguous()
        dx, dw = bwd(dy, x2d, weight, rstd, offset, casting, compute_dw)
        return dx, dw if compute_dw else None, None, None, None

    return backward


_rms_norm_fwd_op.register_autograd(_backward(_rms_norm_bwd_op), setup_context=_save_fwd)
RmsNormFunction = eager_function(
    "RmsNormFunction", rms_norm_fwd, _save_fwd, once_differentiable(_backward(rms_norm_bwd))
)
