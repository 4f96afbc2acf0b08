"""Triton kernels of the cross entropy (the formulas: the package docstring): per-row
log-sum-exp, losses and statistics forward, the logits' gradient backward."""

from __future__ import annotations

from ..dispatch import triton_available

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = ["cross_entropy_bwd_kernel", "cross_entropy_fwd_kernel"]

# Fixed, known-good launch configuration.
FWD_BLOCK_V = 4096
FWD_NUM_WARPS = 8
BWD_BLOCK_V = 2048
BWD_NUM_WARPS = 8

cross_entropy_fwd_kernel = cross_entropy_bwd_kernel = None

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
    def _tanh_instruction(u):
        """tanh by the GPU's own instruction (``tanh.approx.f32``, sm_75 and later): one
        instruction where ``_tanh`` takes an exponential, a division and a polynomial, to a
        relative error under 2^-10.9, finer than the rounding of the bf16 logits it is used for
        (2^-9). Not in the interpreter."""
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def _softcap_tanh(u, SOFTCAP: tl.constexpr):
        """tanh for the softcap: ``_tanh`` (SOFTCAP 1) or the instruction (SOFTCAP 2)."""
        if SOFTCAP == 2:
            return _tanh_instruction(u)
        return _tanh(u)

    @triton.jit
    def _capped(z, cap, inv_cap, SOFTCAP: tl.constexpr):
        if SOFTCAP:
            return cap * _softcap_tanh(z * inv_cap, SOFTCAP)
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
                 SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
                 SMOOTHING: tl.constexpr):  # fmt: skip
        """dL/dz for the upstream gradients a (on ce), c = a + 2 s lse b (ce and z-loss) and e (on
        the entropy h), through the transform of ``_transformed``. The chain rule's scale *
        inv_temp is folded into the row's coefficients and the target's term is a select, not a
        product with a one-hot: the sweeps run near the memory's bandwidth, where each
        instruction per element shows (``benchmarks/ce_sweep.py``)."""
        y = z
        if SCALED:
            y = z * scale
            k = scale * inv_temp
            a, c, e = a * k, c * k, e * k
        if SOFTCAP:
            t = _softcap_tanh(y * inv_cap, SOFTCAP)
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
        g = tl.where(cols == tgt, g - a * (1.0 - eps), g)
        if SMOOTHING:
            g = g - a * eps * inv_v
        if SOFTCAP:
            g = g * (1.0 - t * t)  # d(cap tanh(z / cap)) / dz, from the same t as the forward's
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
        pred_ptr,
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
        PRED: tl.constexpr,
        IN_PLACE: tl.constexpr,
    ):
        """One program per row: online logsumexp over the vocabulary, the row's losses and the
        requested statistics (each a constexpr: nothing computed when off), and (when
        WRITE_GRAD) the row's gradient written in a second sweep, over the logits where IN_PLACE
        (the caller passed the logits themselves as the gradient: one address per element)."""
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
        idx = tl.zeros((), tl.int32)  # the column of the first maximum so far
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            x = _transformed(z, cap, inv_cap, scale, inv_temp, SOFTCAP, SCALED)
            x0 = tl.where(mask, x, 0.0)
            x = tl.where(mask, x, float("-inf"))
            block_max = tl.max(x, 0)
            m_new = tl.maximum(m, block_max)
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
            if TOP1:  # per element only in the block holding the target: others whole or not
                if v0 + BLOCK_V <= tgt:
                    mb = tl.maximum(mb, block_max)
                elif v0 < tgt:
                    mb = tl.maximum(mb, tl.max(tl.where(cols < tgt, x, float("-inf")), 0))
            if PRED:  # a block's first maximum, kept only where it beats every earlier column
                idx = tl.where(block_max > m, v0 + tl.argmax(x, 0, tie_break_left=True), idx)
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
        if PRED:
            tl.store(pred_ptr + row, tl.where(valid, idx, -1).to(tl.int64))

        if WRITE_GRAD:
            a = tl.where(valid, tl.load(coef_ce_ptr + row), 0.0)
            b = tl.where(valid, tl.load(coef_z_ptr + row), 0.0)
            c = a + 2.0 * z_scale * lse * b
            gbase = base if IN_PLACE else grad_ptr + row * stride_grad
            # Last block first: the first sweep read those last, and some are still in L2
            # (``benchmarks/ce_sweep.py``: a minimal sweep's A/B of the order on the H200).
            blocks = tl.cdiv(V, BLOCK_V)
            for i in range(0, blocks):
                v0 = (blocks - 1 - i) * BLOCK_V
                cols = v0 + tl.arange(0, BLOCK_V)
                mask = cols < V
                z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                g = _ce_grad(z, cols, tgt, lse, a, c, 0.0, h, cap, inv_cap, scale, inv_temp, eps,
                             inv_v, SOFTCAP, SCALED, False, SMOOTHING)  # fmt: skip
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
        SMOOTHING: tl.constexpr,
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
                     eps, inv_v, SOFTCAP, SCALED, ENTROPY_GRAD, SMOOTHING)  # fmt: skip
        tl.store(grad_ptr + row * stride_grad + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)
