"""Cross entropy over logits that exist, and the row kernels the fused linear cross entropy reuses.

Order: Triton kernels -> host launchers (``cross_entropy_fwd``, ``cross_entropy_bwd``)
-> torch.library ops -> autograd.Function -> ``cross_entropy``. The fp32 reference is
``reference.cross_entropy_reference``.

Per token i with target y, over the logits the loss sees, x = cap * tanh(k z / cap) / T (the
softcap ``cap`` where set; a logit scale k and a temperature T, both 1 unless given):

    lse_i  = log sum_j exp(x_ij)
    ce_i   = lse_i - (1 - eps) x_iy - (eps / V) sum_j x_ij          (label smoothing eps)
    zl_i   = s * lse_i^2                                            (z-loss scale s)
    h_i    = -sum_j p_ij log p_ij = lse_i - sum_j p_ij x_ij         (entropy, on request)
    dL/dz_ij = [ (a_i + 2 s lse_i b_i - e_i (x_ij - lse_i + h_i)) p_ij
                 - a_i ((1 - eps) [j = y] + eps / V) ] * dx/dz

where p = softmax(x) and a_i, b_i, e_i are the upstream gradients reaching ce_i, zl_i and h_i.
Tokens without a target (ignore_index, or a label outside [0, V)) have loss 0 and gradient 0 for
any upstream gradient. The other statistics (``STATISTICS``) are log sum_j p_ij^2, the mean of
x_i and whether y is the first maximum of x_i; none has a gradient.
"""

from __future__ import annotations

import torch

from .dispatch import cdiv, next_power_of_2, on_device, triton_available, use_triton
from .reduction import REDUCTIONS, prepare_targets, sequence_starts, token_weights
from .reference import LossOutput

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = ["cross_entropy", "cross_entropy_bwd", "cross_entropy_fwd"]

# Fixed, known-good launch configuration.
FWD_BLOCK_V = 4096
FWD_NUM_WARPS = 8
BWD_BLOCK_V = 2048
BWD_NUM_WARPS = 8
# Rows the PyTorch fallback upcasts to fp32 at once: bounds its memory on large vocabularies.
FALLBACK_ROWS = 256


if triton is not None:

    @triton.jit
    def _tanh(u):
        """tanh in fp32 to a relative error of a few fp32 eps for every u, on the GPU and in the
        interpreter alike (``tests/kernels/test_cross_entropy.py`` holds it). Written with
        tl.exp and arithmetic alone: libdevice's tanh does not run in the interpreter, and one
        formula everywhere keeps CPU CI testing what a GPU computes."""
        # |u| >= 0.4: 1 - 2 / (exp(2u) + 1), within a few eps there (an exp overflowing to inf
        # gives 1). Below, that form loses a small tanh's relative precision to cancellation, so
        # the odd Taylor series u (1 - u^2/3 + 2u^4/15 - ...) through u^11 takes over; the first
        # term left out is under one eps there. Both are computed (no branch in SIMT code); this
        # signed form costs fewer instructions than one folding the sign in after exp(-2|u|).
        s = u * u
        p = -1382.0 / 155925.0
        p = p * s + 62.0 / 2835.0
        p = p * s - 17.0 / 315.0
        p = p * s + 2.0 / 15.0
        p = p * s - 1.0 / 3.0
        p = p * s + 1.0
        return tl.where(s < 0.16, u * p, 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))

    @triton.jit
    def _capped(z, cap, inv_cap, SOFTCAP: tl.constexpr):
        if SOFTCAP:
            return cap * _tanh(z * inv_cap)
        return z

    @triton.jit
    def _transformed(z, cap, inv_cap, scale, inv_temp, SOFTCAP: tl.constexpr,
                     SCALED: tl.constexpr):  # fmt: skip
        """x = inv_temp * cap * tanh(scale * z / cap): the logits the loss sees (each factor only
        where its option is on)."""
        if SCALED:
            z = z * scale
        x = _capped(z, cap, inv_cap, SOFTCAP)
        if SCALED:
            x = x * inv_temp
        return x

    @triton.jit
    def _ce_grad(z, cols, tgt, lse, a, c, e, h, cap, inv_cap, scale, inv_temp, eps, inv_v,
                 SOFTCAP: tl.constexpr, SCALED: tl.constexpr,
                 ENTROPY_GRAD: tl.constexpr):  # fmt: skip
        """dL/dz for the upstream gradients a (on ce), c = a + 2 s lse b (ce and z-loss) and e (on
        the entropy h), through the transform of ``_transformed``."""
        y = z
        if SCALED:
            y = z * scale
        if SOFTCAP:
            t = _tanh(y * inv_cap)
            x = cap * t
        else:
            x = y
        if SCALED:
            x = x * inv_temp
        p = tl.exp(x - lse)
        if ENTROPY_GRAD:
            g = (c - e * (x - lse + h)) * p  # d(-sum p log p) / dx_j = -p_j (log p_j + h)
        else:
            g = c * p
        g = g - a * (1.0 - eps) * (cols == tgt).to(tl.float32) - a * eps * inv_v
        if SOFTCAP:
            g = g * (1.0 - t * t)  # d(cap tanh(z / cap)) / dz, from the same t as the forward's
        if SCALED:
            g = g * (scale * inv_temp)
        return g

    @triton.jit
    def cross_entropy_fwd_kernel(
        logits_ptr,
        stride_logits,
        targets_ptr,
        lse_ptr,
        ce_ptr,
        z_ptr,
        coef_ce_ptr,
        coef_z_ptr,
        grad_ptr,
        stride_grad,
        entropy_ptr,
        sum_sq_ptr,
        mean_ptr,
        top1_ptr,
        V,
        cap,
        eps,
        z_scale,
        scale,
        inv_temp,
        BLOCK_V: tl.constexpr,
        SOFTCAP: tl.constexpr,
        SMOOTHING: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        SCALED: tl.constexpr,
        ENTROPY: tl.constexpr,
        SUM_SQ: tl.constexpr,
        MEAN: tl.constexpr,
        TOP1: tl.constexpr,
    ):
        """One program per row: online logsumexp over the vocabulary, the row's losses and the
        requested statistics (each a constexpr: nothing computed when off), and (when
        WRITE_GRAD) the row's gradient written in a second sweep, possibly over the logits."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_logits
        tgt = tl.load(targets_ptr + row).to(tl.int64)
        valid = tgt >= 0
        inv_cap = tl.math.div_rn(1.0, cap)  # one correctly rounded division per row

        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        sx = tl.zeros((), tl.float32)  # sum of x (smoothing, mean)
        se = tl.zeros((), tl.float32)  # sum of exp(x - m) (x - m) (entropy)
        sq = tl.zeros((), tl.float32)  # sum of exp(2 (x - m)) (sum of squared probabilities)
        mb = tl.full((), float("-inf"), tl.float32)  # max of x over the columns before the target
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            x = _transformed(z, cap, inv_cap, scale, inv_temp, SOFTCAP, SCALED)
            x0 = tl.where(mask, x, 0.0)
            x = tl.where(mask, x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            r = tl.exp(m - m_new)
            ex = tl.exp(x - m_new)
            if ENTROPY:
                # Relative to the running max, so that the entropy log(s) - se / s never takes
                # the difference of two numbers of the logits' size (a peaked row's entropy is
                # small beside them). Before the first block s = 0 and m = -inf.
                shift = tl.where(s > 0.0, m - m_new, 0.0) * s
                se = (se + shift) * r + tl.sum(ex * tl.where(mask, x - m_new, 0.0), 0)
            s = s * r + tl.sum(ex, 0)
            if SUM_SQ:
                sq = sq * r * r + tl.sum(ex * ex, 0)
            if TOP1:
                mb = tl.maximum(mb, tl.max(tl.where(cols < tgt, x, float("-inf")), 0))
            m = m_new
            if SMOOTHING or MEAN:
                sx += tl.sum(x0, 0)
        lse = m + tl.log(s)

        x_t = tl.load(base + tgt, mask=valid, other=0.0).to(tl.float32)
        x_t = _transformed(x_t, cap, inv_cap, scale, inv_temp, SOFTCAP, SCALED)
        inv_v = 1.0 / V  # V may be the Python int 1: Triton specializes that value
        ce = lse - (1.0 - eps) * x_t
        if SMOOTHING:
            ce -= eps * sx * inv_v
        tl.store(lse_ptr + row, lse)
        tl.store(ce_ptr + row, tl.where(valid, ce, 0.0))
        tl.store(z_ptr + row, tl.where(valid, z_scale * lse * lse, 0.0))
        h = tl.log(s) - se / s
        if ENTROPY:
            tl.store(entropy_ptr + row, tl.where(valid, h, 0.0))
        if SUM_SQ:
            tl.store(sum_sq_ptr + row, tl.where(valid, tl.log(sq) - 2.0 * tl.log(s), 0.0))
        if MEAN:
            tl.store(mean_ptr + row, tl.where(valid, sx * inv_v, 0.0))
        if TOP1:
            # The first maximum, as argmax takes it: an earlier column as large is the top-1.
            top1 = valid & (x_t >= m) & (x_t > mb)
            tl.store(top1_ptr + row, top1.to(tl.uint8))

        if WRITE_GRAD:
            a = tl.where(valid, tl.load(coef_ce_ptr + row), 0.0)
            b = tl.where(valid, tl.load(coef_z_ptr + row), 0.0)
            c = a + 2.0 * z_scale * lse * b
            gbase = grad_ptr + row * stride_grad
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                mask = cols < V
                z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                g = _ce_grad(z, cols, tgt, lse, a, c, 0.0, h, cap, inv_cap, scale, inv_temp, eps,
                             inv_v, SOFTCAP, SCALED, False)  # fmt: skip
                tl.store(gbase + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def cross_entropy_bwd_kernel(
        logits_ptr,
        stride_logits,
        targets_ptr,
        lse_ptr,
        coef_ce_ptr,
        coef_z_ptr,
        entropy_ptr,
        coef_entropy_ptr,
        grad_ptr,
        stride_grad,
        n_cols,
        col_offset,
        V,
        cap,
        eps,
        z_scale,
        scale,
        inv_temp,
        BLOCK_V: tl.constexpr,
        SOFTCAP: tl.constexpr,
        SCALED: tl.constexpr,
        ENTROPY_GRAD: tl.constexpr,
    ):
        """Elementwise gradient of a block of columns [col_offset, col_offset + n_cols) given the
        row's logsumexp (and entropy); the output may alias the logits (each element is read
        before written)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        tgt = tl.load(targets_ptr + row).to(tl.int64)
        valid = tgt >= 0
        lse = tl.load(lse_ptr + row)
        inv_cap = tl.math.div_rn(1.0, cap)
        a = tl.where(valid, tl.load(coef_ce_ptr + row), 0.0)
        b = tl.where(valid, tl.load(coef_z_ptr + row), 0.0)
        c = a + 2.0 * z_scale * lse * b
        e = 0.0
        h = 0.0
        if ENTROPY_GRAD:
            e = tl.where(valid, tl.load(coef_entropy_ptr + row), 0.0)
            h = tl.load(entropy_ptr + row)
        z = tl.load(logits_ptr + row * stride_logits + cols, mask=mask, other=0.0).to(tl.float32)
        inv_v = 1.0 / V  # V may be the Python int 1: Triton specializes that value
        g = _ce_grad(z, cols + col_offset, tgt, lse, a, c, e, h, cap, inv_cap, scale, inv_temp,
                     eps, inv_v, SOFTCAP, SCALED, ENTROPY_GRAD)  # fmt: skip
        tl.store(grad_ptr + row * stride_grad + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


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
    if e is not None:
        g -= e[:, None] * p * (x - lse[:, None] + h[:, None])
    g -= a[:, None] * ((1.0 - eps) * (cols[None, :] == tgt[:, None]).to(g.dtype) + eps / V)
    if softcap:
        g *= 1.0 - t * t
    if scale * inv_temp != 1.0:
        g *= scale * inv_temp
    return g


def _stats_torch(x, t, row_lse, valid, stats):
    """The requested statistics of the rows' transformed logits ``x`` into ``stats``' slices."""
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    if "entropy" in stats:
        log_p = x - row_lse[:, None]
        stats["entropy"][:] = torch.where(valid, -(log_p.exp() * log_p).sum(-1), zero)
    if "log_sum_sq_probs" in stats:
        sum_sq = torch.logsumexp(2.0 * (x - row_lse[:, None]), dim=-1)
        stats["log_sum_sq_probs"][:] = torch.where(valid, sum_sq, zero)
    if "mean_logits" in stats:
        stats["mean_logits"][:] = torch.where(valid, x.mean(-1), zero)
    if "is_top1" in stats:  # argmax takes the first maximum
        stats["is_top1"][:] = valid & (x.argmax(-1) == t)


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
        row_lse = torch.logsumexp(x, dim=-1)
        x_t = x.gather(1, t.clamp_min(0)[:, None])[:, 0]
        row_ce = row_lse - (1.0 - eps) * x_t - (eps / V) * x.sum(-1)
        lse[sl] = row_lse
        ce[sl] = torch.where(valid, row_ce, 0.0)
        zl[sl] = torch.where(valid, z_scale * row_lse.square(), 0.0)
        if stats:
            _stats_torch(x, t, row_lse, valid, {k: v[sl] for k, v in stats.items()})
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

STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""Per-token statistics of the (transformed) logits the forward can return besides the losses."""


def statistics_mask(names, allowed=STATISTICS, what: str = "statistics") -> int:
    """The bit mask of the ``STATISTICS`` among ``names`` (bit i for the i-th name), every name
    checked to be one of ``allowed`` (a ``ValueError`` naming ``what`` otherwise)."""
    unknown = set(names) - set(allowed)
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}; expected names among {allowed}")
    return sum(1 << i for i, name in enumerate(STATISTICS) if name in names)


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
    requested name of ``STATISTICS`` (fp32 rows; ``is_top1`` bool), filled with the rows'
    entropy, log of the sum of squared probabilities, mean logit and whether the target is the
    first maximum; 0 (False) for rows without a target.
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
    top1 = stats.get("is_top1")
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
            V,
            float(softcap) if softcap else 1.0,
            float(label_smoothing),
            float(z_loss_scale),
            float(logit_scale),
            float(inv_temperature),
            BLOCK_V=min(FWD_BLOCK_V, next_power_of_2(V)),
            SOFTCAP=bool(softcap),
            SMOOTHING=label_smoothing > 0.0,
            WRITE_GRAD=write_grad,
            SCALED=logit_scale != 1.0 or inv_temperature != 1.0,
            ENTROPY="entropy" in stats,
            SUM_SQ="log_sum_sq_probs" in stats,
            MEAN="mean_logits" in stats,
            TOP1=top1 is not None,
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
            SOFTCAP=bool(softcap),
            SCALED=logit_scale != 1.0 or inv_temperature != 1.0,
            ENTROPY_GRAD=entropy_grad,
            num_warps=BWD_NUM_WARPS,
        )
    return grad_out


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile, so the whole loss traces with fullgraph=True.


@torch.library.custom_op("surgery::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    softcap: float,
    label_smoothing: float,
    z_loss_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(
        logits,
        targets,
        softcap=softcap,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
    )


@_ce_fwd_op.register_fake
def _(logits, targets, softcap, label_smoothing, z_loss_scale):
    rows = logits.shape[0]
    return tuple(logits.new_empty(rows, dtype=torch.float32) for _ in range(3))


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
    @staticmethod
    def forward(ctx, logits2d, targets, weights, softcap, eps, z_scale, inplace_backward):
        lse, ce, zl = _ce_fwd_op(logits2d, targets, softcap, eps, z_scale)
        ctx.save_for_backward(logits2d, targets, weights, lse)
        ctx.opts = (softcap, eps, z_scale, inplace_backward)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        loss, z_out = reduce_losses(ce, zl, weights)
        return loss, z_out

    @staticmethod
    def backward(ctx, g_loss, g_z):
        logits2d, targets, weights, lse = ctx.saved_tensors
        softcap, eps, z_scale, inplace_backward = ctx.opts
        if g_loss is None and g_z is None:
            return (None,) * 7
        a, b = upstream_coefficients(weights, g_loss, g_z, logits2d.shape[0], logits2d.device)
        if inplace_backward:
            # The caller opted in: the gradient overwrites the logits buffer it handed us.
            _ce_bwd_inplace_op(logits2d, targets, lse, a, b, softcap, eps, z_scale)
            grad = logits2d
        else:
            grad = _ce_bwd_op(logits2d, targets, lse, a, b, softcap, eps, z_scale)
        return grad, None, None, None, None, None, None


def check_options(reduction: str, label_smoothing: float, z_loss_scale: float, softcap) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss_scale < 0.0:
        raise ValueError(f"z_loss_scale must be >= 0, got {z_loss_scale}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")


def prepare_loss_inputs(
    labels: torch.Tensor,
    n_tokens: int,
    vocab_size: int,
    device: torch.device,
    *,
    ignore_index: int,
    reduction: str,
    num_items_in_batch,
    position_ids,
    cu_seqlens,
    shift: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Targets (column or -1) and per-token weights, shared by both loss entry points."""
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.dim() not in (1, 2) or labels.numel() != n_tokens:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match {n_tokens} tokens "
            "(expected (N,) for (N, ...) inputs or (B, T) for (B, T, ...) inputs)"
        )
    if num_items_in_batch is not None and reduction not in ("mean", "sum"):
        raise ValueError(
            f'num_items_in_batch applies to reduction "mean" or "sum", not {reduction!r}'
        )
    # int64 whatever the labels' width: "no target" (-1) and any ignore_index must be
    # representable (in uint8, -1 is class 255).
    labels = labels.to(device=device, dtype=torch.int64)
    starts = sequence_starts(tuple(labels.shape), device, position_ids, cu_seqlens)
    if reduction == "sequence" and starts is None:
        raise ValueError(
            'reduction="sequence" needs sequence boundaries: pass position_ids or cu_seqlens, '
            "or labels of shape (B, T) where each row is one sequence"
        )
    targets, valid = prepare_targets(labels, vocab_size, ignore_index, shift, starts)
    targets = torch.where(valid, targets, torch.full_like(targets, -1)).contiguous()
    weights = token_weights(valid, reduction, starts, num_items_in_batch)
    return targets, weights


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    inplace_backward: bool = False,
) -> LossOutput:
    """Cross entropy over existing logits, in one read of the logits forward and one read plus
    one write backward, computed in fp32 inside the kernel whatever the logits' dtype.

    Args:
        logits: (N, V) or (B, T, V); fp32, bf16 or fp16; unit stride along V.
        labels: (N,) or (B, T) integer class indices; ``ignore_index`` marks tokens without a
            target. A label outside [0, V) that is not ``ignore_index`` raises (CPU, or GPU with
            SURGERY_DEBUG=1) or is treated as ignored and flagged for ``check_labels()`` (GPU).
        ignore_index: any int, as in ``F.cross_entropy``; a class in [0, V) too, whose tokens
            are then not trained.
        reduction: "mean" over tokens with a target; "sum"; "none" (per token, shape of labels,
            0 where ignored); "sequence": each sequence's mean over its tokens with a target, then
            the mean over sequences that have any.
        num_items_in_batch: HF gradient-accumulation normaliser: the sum divided by it.
        position_ids / cu_seqlens: sequence boundaries (a new sequence starts where the position
            does not continue, or at each cu_seqlens offset). Without them a row of (B, T) labels
            is one sequence. Runs of ignore_index are never boundaries.
        z_loss_scale: adds s * logsumexp^2 per token to ``loss``; ``z_loss`` returns that term.
        label_smoothing: as ``F.cross_entropy`` defines it.
        softcap: Gemma 2/3 final-logit softcap, cap * tanh(logits / cap), applied in the kernel.
        shift: next-token targets (labels[t + 1] of the same row and sequence) without copying
            the logits.
        inplace_backward: write the gradient into ``logits``' own buffer during backward (saves
            one logits-sized allocation). Only when nothing else reads those logits afterwards.

    Returns:
        ``LossOutput(loss, z_loss)`` in fp32.
    """
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    V = logits.shape[-1]
    check_options(reduction, label_smoothing, z_loss_scale, softcap)
    logits2d = logits.reshape(-1, V)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    targets, weights = prepare_loss_inputs(
        labels,
        logits2d.shape[0],
        V,
        logits.device,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
    )
    loss, z = CrossEntropyFunction.apply(
        logits2d,
        targets,
        weights,
        float(softcap or 0.0),
        float(label_smoothing),
        float(z_loss_scale),
        bool(inplace_backward),
    )
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return LossOutput(loss, z)
