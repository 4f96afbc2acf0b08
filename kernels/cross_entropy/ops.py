"""torch.library ops over the cross entropy's launchers and the one autograd.Function over them,
the same path eager and under torch.compile."""

from __future__ import annotations

import torch

from .launch import (
    cross_entropy_bwd,
    cross_entropy_fwd,
    statistics_buffers,
    statistics_outputs,
)

__all__ = ["CrossEntropyFunction", "reduce_losses", "upstream_coefficients"]


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile, so the whole loss traces with fullgraph=True.


@torch.library.custom_op("surgery::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
    stats: int = 0,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """(lse, ce, z) per row and one tensor per ``STATISTICS`` name: the rows' statistic where
    its bit is set in ``stats``, an empty tensor where not."""
    statistics = statistics_buffers(stats, logits.shape[0], logits.device)
    lse, ce, zl = cross_entropy_fwd(
        logits,
        targets,
        softcap=softcap,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        stats=statistics,
    )
    return lse, ce, zl, *statistics_outputs(statistics, lse)


@_ce_fwd_op.register_fake
def _(logits, targets, softcap, label_smoothing, z_loss_scale, stats=0):
    rows = logits.shape[0]
    per_row = [logits.new_empty(rows, dtype=torch.float32) for _ in range(3)]
    return *per_row, *statistics_outputs(statistics_buffers(stats, rows, logits.device), per_row[0])


@torch.library.custom_op("surgery::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef_ce: torch.Tensor,
    coef_z: torch.Tensor,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
) -> torch.Tensor:
    grad = torch.empty_like(logits)
    return cross_entropy_bwd(
        logits, targets, lse, coef_ce, coef_z, grad,
        softcap=softcap, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale,
    )  # fmt: skip


@_ce_bwd_op.register_fake
def _(logits, targets, lse, coef_ce, coef_z, softcap, label_smoothing, z_loss_scale):
    return torch.empty_like(logits)


@torch.library.custom_op("surgery::cross_entropy_bwd_", mutates_args=("logits",))
def _ce_bwd_inplace_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef_ce: torch.Tensor,
    coef_z: torch.Tensor,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
) -> None:
    cross_entropy_bwd(
        logits, targets, lse, coef_ce, coef_z, logits,
        softcap=softcap, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale,
    )  # fmt: skip


@_ce_bwd_inplace_op.register_fake
def _(logits, targets, lse, coef_ce, coef_z, softcap, label_smoothing, z_loss_scale):
    return None


def upstream_coefficients(
    weights: torch.Tensor | None,
    g_loss: torch.Tensor | None,
    g_z: torch.Tensor | None,
    n: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 upstream gradients (a on ce, b on z) from the gradients reaching the two
    outputs. ``weights`` is None for reduction "none" (the outputs are per token)."""
    zero = torch.zeros(n, dtype=torch.float32, device=device)
    gl = zero if g_loss is None else g_loss.reshape(-1).to(torch.float32)
    gz = zero if g_z is None else g_z.reshape(-1).to(torch.float32)
    if weights is None:
        a = gl.expand(n)
        return a.contiguous(), (gl + gz).expand(n).contiguous()
    return (weights * gl).contiguous(), (weights * (gl + gz)).contiguous()


def reduce_losses(
    ce: torch.Tensor, zl: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if weights is None:
        return ce + zl, zl
    return (weights * (ce + zl)).sum(), (weights * zl).sum()


class CrossEntropyFunction(torch.autograd.Function):
    """(loss, z_loss, *statistics): the reduced losses, then one tensor per ``STATISTICS`` name
    (the rows' values where its bit is set in ``stats``, empty where not; no gradient)."""

    @staticmethod
    def forward(ctx, logits2d, targets, weights, softcap, eps, z_scale, inplace_backward, stats=0):
        lse, ce, zl, *statistics = _ce_fwd_op(logits2d, targets, softcap, eps, z_scale, stats)
        ctx.save_for_backward(logits2d, targets, weights, lse)
        ctx.opts = (softcap, eps, z_scale, inplace_backward)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, *statistics)
        loss, z_out = reduce_losses(ce, zl, weights)
        return loss, z_out, *statistics

    @staticmethod
    def backward(ctx, g_loss, g_z, *_g_statistics):
        logits2d, targets, weights, lse = ctx.saved_tensors
        softcap, eps, z_scale, inplace_backward = ctx.opts
        if g_loss is None and g_z is None:
            return (None,) * 8
        a, b = upstream_coefficients(weights, g_loss, g_z, logits2d.shape[0], logits2d.device)
        if inplace_backward:
            # The caller opted in: the gradient overwrites the logits buffer it handed us.
            _ce_bwd_inplace_op(logits2d, targets, lse, a, b, softcap, eps, z_scale)
            grad = logits2d
        else:
            grad = _ce_bwd_op(logits2d, targets, lse, a, b, softcap, eps, z_scale)
        return grad, None, None, None, None, None, None, None
