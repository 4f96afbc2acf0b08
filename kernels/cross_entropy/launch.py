"""Host launchers of the cross entropy, ``cross_entropy_fwd`` and ``cross_entropy_bwd``, and the
PyTorch path they take on CPU without the interpreter."""

from __future__ import annotations

import os

import torch

from ..dispatch import cdiv, interpreter_enabled, next_power_of_2, on_device, use_triton
from .kernel import (
    BWD_BLOCK_V,
    BWD_NUM_WARPS,
    FWD_BLOCK_V,
    FWD_NUM_WARPS,
    cross_entropy_bwd_kernel,
    cross_entropy_fwd_kernel,
)

__all__ = [
    "STATISTICS",
    "cross_entropy_bwd",
    "cross_entropy_fwd",
    "named_statistics",
    "statistics_buffers",
    "statistics_mask",
    "statistics_outputs",
]

# Rows the PyTorch fallback upcasts to fp32 at once: bounds its memory on large vocabularies.
FALLBACK_ROWS = 256


# ---------------------------------------------------------------------------------------------
# PyTorch fallback (CPU without the interpreter): the same arithmetic, FALLBACK_ROWS rows at a time.


def _capped_torch(z: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(z / softcap) if softcap else z


def _transformed_torch(z, softcap, scale, inv_temp):
    x = _capped_torch(z * scale if scale != 1.0 else z, softcap)
    return x * inv_temp if inv_temp != 1.0 else x


def _grad_torch(z, cols, tgt, lse, a, c, softcap, eps, V, scale=1.0, inv_temp=1.0, e=None, h=None):
    y = z * scale if scale != 1.0 else z
    t = torch.tanh(y / softcap) if softcap else None
    x = softcap * t if softcap else y
    if inv_temp != 1.0:
        x = x * inv_temp
    p = torch.exp(x - lse[:, None])
    g = c[:, None] * p
    if e is not None:  # p (x - lse + h), 0 where p is (a logit of -inf: not 0 * -inf)
        g -= e[:, None] * torch.where(p > 0, p * (x - lse[:, None] + h[:, None]), 0.0)
    g -= a[:, None] * ((1.0 - eps) * (cols[None, :] == tgt[:, None]).to(g.dtype) + eps / V)
    if softcap:
        g *= 1.0 - t * t
    if scale * inv_temp != 1.0:
        g *= scale * inv_temp
    return g


def _stats_torch(x, t, row_lse, valid, stats, order):
    """The requested statistics of the rows' transformed logits ``x`` into ``stats``' slices;
    the first maximum of ``order`` (without a softcap the logits times the logit scale's sign:
    x is that times a positive factor, whose rounding could tie two fp32 logits; ``x`` with
    one), as the kernel takes it."""
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    if "entropy" in stats:
        log_p = x - row_lse[:, None]
        terms = torch.where(log_p > -torch.inf, log_p.exp() * log_p, zero)  # -inf: p log p = 0
        stats["entropy"][:] = torch.where(valid, -terms.sum(-1), zero)
    if "log_sum_sq_probs" in stats:
        sum_sq = torch.logsumexp(2.0 * (x - row_lse[:, None]), dim=-1)
        stats["log_sum_sq_probs"][:] = torch.where(valid, sum_sq, zero)
    if "mean_logits" in stats:
        stats["mean_logits"][:] = torch.where(valid, x.mean(-1), zero)
    if "is_top1" in stats or "predicted" in stats:
        first = order.argmax(-1)  # the first maximum, as the kernel takes it
        if "is_top1" in stats:
            stats["is_top1"][:] = valid & (first == t)
        if "predicted" in stats:
            stats["predicted"][:] = torch.where(valid, first, -1)


def _fwd_torch(logits, targets, lse, ce, zl, coef_ce, coef_z, grad, softcap, eps, z_scale,
               scale=1.0, inv_temp=1.0, stats=None):  # fmt: skip
    V = logits.shape[1]
    cols = torch.arange(V, device=logits.device)
    for r0 in range(0, logits.shape[0], FALLBACK_ROWS):
        sl = slice(r0, r0 + FALLBACK_ROWS)
        z = logits[sl].float()
        x = _transformed_torch(z, softcap, scale, inv_temp)
        t = targets[sl].long()
        valid = t >= 0
        # relative to the row's maximum, as the kernel: a peaked row's small loss is log s -
        # (x_t - m), not lse - x_t with lse rounded at the logits' size first
        top = x.amax(-1)
        shifted = x - top[:, None]
        log_s = torch.logsumexp(shifted, dim=-1)
        row_lse = top + log_s
        row_ce = log_s - (1.0 - eps) * shifted.gather(1, t.clamp_min(0)[:, None])[:, 0]
        if eps:  # not 0 * sum: a logit of -inf (a masked column) would make it nan
            row_ce = row_ce - (eps / V) * shifted.sum(-1)
        lse[sl] = row_lse
        ce[sl] = torch.where(valid, row_ce, 0.0)
        zl[sl] = torch.where(valid, z_scale * row_lse.square(), 0.0)
        if stats:
            _stats_torch(x, t, row_lse, valid, {k: v[sl] for k, v in stats.items()},
                         x if softcap else z * order_sign(softcap, scale))  # fmt: skip
        if grad is not None:
            a = torch.where(valid, coef_ce[sl], 0.0)
            c = a + 2.0 * z_scale * row_lse * torch.where(valid, coef_z[sl], 0.0)
            g = _grad_torch(z, cols, t, row_lse, a, c, softcap, eps, V, scale, inv_temp)
            grad[sl] = g.to(grad.dtype)


def _bwd_torch(logits, targets, lse, coef_ce, coef_z, grad, col_offset, V, softcap, eps, z_scale,
               scale=1.0, inv_temp=1.0, entropy=None, coef_entropy=None):  # fmt: skip
    cols = torch.arange(col_offset, col_offset + logits.shape[1], device=logits.device)
    for r0 in range(0, logits.shape[0], FALLBACK_ROWS):
        sl = slice(r0, r0 + FALLBACK_ROWS)
        t = targets[sl].long()
        valid = t >= 0
        a = torch.where(valid, coef_ce[sl], 0.0)
        c = a + 2.0 * z_scale * lse[sl] * torch.where(valid, coef_z[sl], 0.0)
        e = h = None
        if coef_entropy is not None:
            e, h = torch.where(valid, coef_entropy[sl], 0.0), entropy[sl]
        g = _grad_torch(logits[sl].float(), cols, t, lse[sl], a, c, softcap, eps, V, scale,
                        inv_temp, e, h)  # fmt: skip
        grad[sl] = g.to(grad.dtype)


# ---------------------------------------------------------------------------------------------
# Host launchers

HARDWARE_TANH = os.environ.get("SURGERY_HARDWARE_TANH", "1") != "0"
"""Whether the softcap of bf16 logits on a GPU takes the GPU's tanh instruction (``SOFTCAP`` 2);
``SURGERY_HARDWARE_TANH=0`` keeps the exact one (1) everywhere, as CPU tests run it."""


def order_sign(softcap: float, logit_scale: float) -> int:
    """The kernels' ``SIGN``: without a softcap, the sign of the logit scale (the logits the loss
    sees are z times a factor of that sign, and the kernels order a row by z times it: its own
    order exactly); 1 with one (they order by the softcapped logits)."""
    if softcap or logit_scale > 0:
        return 1
    return -1 if logit_scale < 0 else 0


def softcap_mode(softcap: float, logits: torch.Tensor) -> int:
    """The kernels' ``SOFTCAP``: 0 without a softcap; 2 (the tanh instruction) for bf16 logits on
    a GPU, whose own rounding (2^-9) is coarser than the instruction's error (2^-10.9); else 1
    (``_tanh``, to a few fp32 eps: fp32 and fp16 logits, and the interpreter)."""
    if not softcap:
        return 0
    hardware = HARDWARE_TANH and logits.is_cuda and not interpreter_enabled()
    return 2 if hardware and logits.dtype == torch.bfloat16 else 1


STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "predicted")
"""Per-token statistics of the (transformed) logits the forward can return besides the losses."""
STATISTIC_DTYPES = {"is_top1": torch.bool, "predicted": torch.int64}
"""The statistics that are not fp32 rows."""
STATISTIC_FILL = {"is_top1": False, "predicted": -1}
"""What a statistic holds for a token without a target, where not 0."""


def statistics_mask(names, allowed=STATISTICS, what: str = "statistics") -> int:
    """The bit mask of the ``STATISTICS`` among ``names`` (bit i for the i-th name), every name
    checked to be one of ``allowed`` (a ``ValueError`` naming ``what`` otherwise)."""
    unknown = set(names) - set(allowed)
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}; expected names among {allowed}")
    return sum(1 << i for i, name in enumerate(STATISTICS) if name in names)


def statistics_buffers(stats: int, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A buffer of ``n`` rows for each statistic whose bit is set in ``stats``."""
    return {
        name: torch.empty(n, dtype=STATISTIC_DTYPES.get(name, torch.float32), device=device)
        for i, name in enumerate(STATISTICS)
        if stats >> i & 1
    }


def statistics_outputs(statistics: dict[str, torch.Tensor], like: torch.Tensor) -> tuple:
    """One tensor per name of ``STATISTICS``: the buffer, or an empty tensor (distinct ones: the
    outputs of a custom op may not alias each other)."""
    return tuple(statistics.get(name, like.new_empty(0)) for name in STATISTICS)


def named_statistics(values, names, shape) -> dict[str, torch.Tensor]:
    """The statistics among ``names`` from an op's outputs ``values`` (one per ``STATISTICS``
    name, as ``statistics_outputs`` gives them), detached and viewed as ``shape``."""
    return {
        name: t.detach().view(shape)
        for name, t in zip(STATISTICS, values, strict=True)
        if name in names
    }


def cross_entropy_fwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float = 0.0,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    coef_ce: torch.Tensor | None = None,
    coef_z: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    inv_temperature: float = 1.0,
    stats: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row losses of 2-D ``logits`` (rows, V), unit stride along V.

    ``targets`` holds the target column per row, or -1 for rows without one. Returns fp32
    ``(lse, ce, z)`` per row. When ``grad_out`` is given (it may be ``logits`` itself), the
    gradient with upstream ``coef_ce`` on ce and ``coef_z`` on z (fp32, per row) is written there.

    The loss sees ``inv_temperature * softcap(logit_scale * logits)``. ``stats``: a buffer per
    requested name of ``STATISTICS`` (fp32 rows; ``is_top1`` bool, ``predicted`` int64), filled
    with the rows' entropy, log of the sum of squared probabilities, mean logit, whether the
    target is the first maximum and the first maximum's column (argmax's); 0 (False, -1 for
    ``predicted``) for rows without a target.
    """
    rows, V = logits.shape
    dev = logits.device
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    ce = torch.empty(rows, dtype=torch.float32, device=dev)
    zl = torch.empty(rows, dtype=torch.float32, device=dev)
    write_grad = grad_out is not None
    stats = stats or {}
    if rows == 0:
        return lse, ce, zl
    if not use_triton(logits):
        _fwd_torch(logits, targets, lse, ce, zl, coef_ce, coef_z, grad_out, softcap,
                   label_smoothing, z_loss_scale, logit_scale, inv_temperature, stats)  # fmt: skip
        return lse, ce, zl
    dummy = lse  # never read (or written) where its option is off
    top1, predicted = stats.get("is_top1"), stats.get("predicted")
    with on_device(logits):
        cross_entropy_fwd_kernel[(rows,)](
            logits,
            logits.stride(0),
            targets,
            lse,
            ce,
            zl,
            coef_ce if write_grad else dummy,
            coef_z if write_grad else dummy,
            grad_out if write_grad else logits,
            grad_out.stride(0) if write_grad else 0,
            stats.get("entropy", dummy),
            stats.get("log_sum_sq_probs", dummy),
            stats.get("mean_logits", dummy),
            dummy if top1 is None else top1.view(torch.uint8),
            dummy if predicted is None else predicted,
            V,
            float(softcap) if softcap else 1.0,
            float(label_smoothing),
            float(z_loss_scale),
            float(logit_scale),
            float(inv_temperature),
            BLOCK_V=min(FWD_BLOCK_V, next_power_of_2(V)),
            SOFTCAP=softcap_mode(softcap, logits),
            SMOOTHING=label_smoothing > 0.0,
            WRITE_GRAD=write_grad,
            SCALED=logit_scale != 1.0 or inv_temperature != 1.0,
            SIGN=order_sign(softcap, logit_scale),
            ENTROPY="entropy" in stats,
            SUM_SQ="log_sum_sq_probs" in stats,
            MEAN="mean_logits" in stats,
            TOP1=top1 is not None,
            PRED=predicted is not None,
            IN_PLACE=grad_out is logits,
            INTERPRETED=interpreter_enabled(),
            num_warps=FWD_NUM_WARPS,
        )
    return lse, ce, zl


def cross_entropy_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef_ce: torch.Tensor,
    coef_z: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    col_offset: int = 0,
    vocab_size: int | None = None,
    softcap: float = 0.0,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    logit_scale: float = 1.0,
    inv_temperature: float = 1.0,
    entropy: torch.Tensor | None = None,
    coef_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of the row losses for the columns ``[col_offset, col_offset + logits.shape[1])``
    of a vocabulary of ``vocab_size``, given each row's ``lse``; with ``coef_entropy``, also of
    the rows' ``entropy`` (from ``cross_entropy_fwd``) for that upstream gradient. ``grad_out``
    may be ``logits``."""
    rows, n_cols = logits.shape
    V = n_cols if vocab_size is None else vocab_size
    if rows == 0 or n_cols == 0:
        return grad_out
    if not use_triton(logits):
        _bwd_torch(logits, targets, lse, coef_ce, coef_z, grad_out, col_offset, V, softcap,
                   label_smoothing, z_loss_scale, logit_scale, inv_temperature, entropy,
                   coef_entropy)  # fmt: skip
        return grad_out
    block = min(BWD_BLOCK_V, next_power_of_2(n_cols))
    entropy_grad = coef_entropy is not None
    with on_device(logits):
        cross_entropy_bwd_kernel[(rows, cdiv(n_cols, block))](
            logits,
            logits.stride(0),
            targets,
            lse,
            coef_ce,
            coef_z,
            entropy if entropy_grad else lse,
            coef_entropy if entropy_grad else lse,
            grad_out,
            grad_out.stride(0),
            n_cols,
            col_offset,
            V,
            float(softcap) if softcap else 1.0,
            float(label_smoothing),
            float(z_loss_scale),
            float(logit_scale),
            float(inv_temperature),
            BLOCK_V=block,
            SOFTCAP=softcap_mode(softcap, logits),
            SCALED=logit_scale != 1.0 or inv_temperature != 1.0,
            SIGN=order_sign(softcap, logit_scale),
            ENTROPY_GRAD=entropy_grad,
            SMOOTHING=label_smoothing > 0.0,
            INTERPRETED=interpreter_enabled(),
            num_warps=BWD_NUM_WARPS,
        )
    return grad_out
