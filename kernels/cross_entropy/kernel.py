"""Triton kernels of the cross entropy (the formulas: the package docstring): per-row
log-sum-exp, losses and statistics forward, the logits' gradient backward."""

from __future__ import annotations

from ..dispatch import triton_available

if triton_available():
    import triton
    import triton.language as tl

    from ..rounding import round_to
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
    def _row_maps(cap, scale, inv_temp, SOFTCAP: tl.constexpr, SCALED: tl.constexpr,
                  SIGN: tl.constexpr):  # fmt: skip
        """``(zc, k2, slope)`` for the logits the loss sees, x = inv_temp cap tanh(scale z / cap)
        (each factor only where its option is on), taken in base 2: u = x log2(e) is k2 tanh(z
        zc) with a softcap and k2 key(z) without (``_order_key``, SIGN the sign of scale: k2 >=
        0), and dx/dz is slope (1 - t^2) or slope. In base 2 the sweeps' exponentials are
        exp2(u - reference) with no multiply of their own (the gradient's exponent one fused
        multiply-add without a softcap), where the logits the loss sees took two multiplies
        before: the sweeps run near the memory's bandwidth, where each instruction per element
        shows (``benchmarks/ce_sweep.py``)."""
        if SCALED:
            slope = scale * inv_temp
        else:
            slope = 1.0
        if SOFTCAP:
            inv_cap = tl.math.div_rn(1.0, cap)  # one correctly rounded division per row
            if SCALED:
                zc = inv_cap * scale
                k2 = cap * inv_temp * 1.4426950408889634
            else:
                zc = inv_cap
                k2 = cap * 1.4426950408889634
        else:
            zc = 1.0
            k2 = slope * (SIGN * 1.4426950408889634)
        return zc, k2, slope

    @triton.jit
    def _order_key(z, zc, k2, SOFTCAP: tl.constexpr, SIGN: tl.constexpr):
        """What a row's logits are ordered by (its maximum, the top-1): without a softcap z, -z
        or 0 by the sign of the logit scale (SIGN; x is that times a positive factor, so the
        order is the logits' own exactly, not as rounded by a product), u = x log2(e) with one."""
        if SOFTCAP:
            return k2 * _softcap_tanh(z * zc, SOFTCAP)
        if SIGN == 1:
            return z
        if SIGN == -1:
            return -z
        return z * 0.0

    @triton.jit
    def _base2(key, k2, SOFTCAP: tl.constexpr):
        """u = x log2(e) from ``_order_key``'s key."""
        if SOFTCAP:
            return key
        return key * k2

    @triton.jit
    def _exponent(key, k2, ref, SOFTCAP: tl.constexpr):
        """u - u_ref in base 2 for a key and a reference, both ``_order_key``'s: the difference
        first (exactly 0 at the reference, the row's maximum), then its factor without a
        softcap, so that a peaked row's terms and loss keep their digits."""
        if SOFTCAP:
            return key - ref
        return (key - ref) * k2

    @triton.jit
    def _ce_grad(z, cols, tgt, lse2, a, c, e, h, zc, k2, slope, eps, inv_v,
                 SOFTCAP: tl.constexpr, SCALED: tl.constexpr, SIGN: tl.constexpr,
                 ENTROPY_GRAD: tl.constexpr, SMOOTHING: tl.constexpr):  # fmt: skip
        """dL/dz for the upstream gradients a (on ce), c = a + 2 s lse b (ce and z-loss) and e (on
        the entropy h), through the transform of ``_row_maps``, for the row's log-sum-exp in base
        2, lse2 = lse log2(e). The chain rule's slope is folded into the row's coefficients and
        the target's term is a select, not a product with a one-hot."""
        if SCALED:
            a, c, e = a * slope, c * slope, e * slope
        if SOFTCAP:
            t = _softcap_tanh(z * zc, SOFTCAP)
            d = tl.fma(t, k2, -lse2)
        else:
            d = tl.fma(_order_key(z, zc, k2, SOFTCAP, SIGN), k2, -lse2)  # rounded once
        p = tl.exp2(d)  # d = (x - lse) log2(e)
        if ENTROPY_GRAD:  # d(-sum p log p) / dx_j = -p_j (log p_j + h) = -p_j (d ln 2 + h)
            # (a logit of -inf: p = 0 and d held finite, so the term is 0, not inf * 0)
            d = tl.maximum(d, -1.0e30)
            g = (c - e * h - (e * 0.6931471805599453) * d) * p
        else:
            g = c * p
        g = tl.where(cols == tgt, g - a * (1.0 - eps), g)
        if SMOOTHING:
            g = g - a * eps * inv_v
        if SOFTCAP:
            g = g * (1.0 - t * t)  # d(cap tanh(z / cap)) / dz, from the same t as the forward's
        return g

    @triton.jit
    def _sweep_block(base, v0, V, tgt, m, s, se, sq, sx, mb, idx, zc, k2,
                     BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, SIGN: tl.constexpr,
                     MASKED: tl.constexpr,
                     ENTROPY: tl.constexpr, SUM_SQ: tl.constexpr, SUM_X: tl.constexpr,
                     TOP1: tl.constexpr, PRED: tl.constexpr):  # fmt: skip
        """One block of the forward's first sweep: the running maximum m of the order keys, s =
        sum exp2(u - u_m) (u_m the base-2 logit at m: ``_exponent``) and the statistics' sums (se
        = sum exp2(u - u_m) (u - u_m), sq = sum exp2(2 (u - u_m)), sx = sum of keys), the maximum
        before the target's column mb and the first maximum's column idx, updated by the block at
        v0. MASKED: the last, partial block (the full ones carry no masks)."""
        cols = v0 + tl.arange(0, BLOCK_V)
        if MASKED:
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            raw = _order_key(z, zc, k2, SOFTCAP, SIGN)
            key = tl.where(mask, raw, float("-inf"))
        else:
            raw = _order_key(tl.load(base + cols).to(tl.float32), zc, k2, SOFTCAP, SIGN)
            key = raw
        block_max = tl.max(key, 0)
        m_new = tl.maximum(m, block_max)
        # the reference: the running maximum, or 0 while every logit so far is -inf (a masked
        # column: every term so far 0, where -inf - -inf would make them nan)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        moved = _exponent(m, k2, ref, SOFTCAP)  # u_m - u_new: -inf or nan while s = 0
        r = tl.where(s > 0.0, tl.exp2(moved), 0.0)
        d = _exponent(raw, k2, ref, SOFTCAP)  # -inf at logits of -inf
        if MASKED:  # past V a term of 0 (not from a key of -inf: -inf * k2 is nan at k2 0)
            d = tl.where(mask, d, float("-inf"))
        ex = tl.exp2(d)
        if ENTROPY:
            # Relative to the running maximum, so that the entropy never takes the difference
            # of two numbers of the logits' size (a peaked row's entropy is small beside them).
            # A term of probability 0 adds 0 (0 * -inf would add nan).
            d = tl.maximum(d, -1.0e30)
            shift = tl.where(s > 0.0, moved, 0.0) * s
            se = (se + shift) * r + tl.sum(ex * d, 0)
        s = s * r + tl.sum(ex, 0)
        if SUM_SQ:
            sq = sq * r * r + tl.sum(ex * ex, 0)
        if TOP1:  # per element only in the block holding the target: others whole or not
            if v0 + BLOCK_V <= tgt:
                mb = tl.maximum(mb, block_max)
            elif v0 < tgt:
                mb = tl.maximum(mb, tl.max(tl.where(cols < tgt, key, float("-inf")), 0))
        if PRED:  # a block's first maximum, kept only where it beats every earlier column
            idx = tl.where(block_max > m, v0 + tl.argmax(key, 0, tie_break_left=True), idx)
        if SUM_X:
            if MASKED:
                raw = tl.where(mask, raw, 0.0)
            sx += tl.sum(raw, 0)
        return m_new, s, se, sq, sx, mb, idx

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
        SIGN: tl.constexpr,
        ENTROPY: tl.constexpr,
        SUM_SQ: tl.constexpr,
        MEAN: tl.constexpr,
        TOP1: tl.constexpr,
        PRED: tl.constexpr,
        IN_PLACE: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """One program per row: online logsumexp over the vocabulary in base 2 (``_row_maps``),
        full blocks first and the partial one last, the row's losses and the requested
        statistics (each a constexpr: nothing computed when off), and (when WRITE_GRAD) the
        row's gradient written in a second sweep, over the logits where IN_PLACE (the caller
        passed the logits themselves as the gradient: one address per element), rounded to
        nearest (``rounding.round_to``: the interpreter too)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_logits
        tgt = tl.load(targets_ptr + row).to(tl.int64)
        valid = tgt >= 0
        zc, k2, slope = _row_maps(cap, scale, inv_temp, SOFTCAP, SCALED, SIGN)

        m = tl.full((), float("-inf"), tl.float32)  # the running maximum of the order keys
        s = tl.zeros((), tl.float32)
        sx = tl.zeros((), tl.float32)  # sum of keys (smoothing, mean)
        se = tl.zeros((), tl.float32)  # sum of exp2(u - u_m) (u - u_m) (entropy)
        sq = tl.zeros((), tl.float32)  # sum of exp2(2 (u - u_m)) (sum of squared probabilities)
        mb = tl.full((), float("-inf"), tl.float32)  # max key over the columns before the target
        idx = tl.zeros((), tl.int32)  # the column of the first maximum so far
        full = V // BLOCK_V
        for b in range(0, full):
            m, s, se, sq, sx, mb, idx = _sweep_block(
                base, b * BLOCK_V, V, tgt, m, s, se, sq, sx, mb, idx, zc, k2, BLOCK_V, SOFTCAP,
                SIGN, False, ENTROPY, SUM_SQ, SMOOTHING or MEAN, TOP1, PRED)  # fmt: skip
        if full * BLOCK_V < V:
            m, s, se, sq, sx, mb, idx = _sweep_block(
                base, full * BLOCK_V, V, tgt, m, s, se, sq, sx, mb, idx, zc, k2, BLOCK_V, SOFTCAP,
                SIGN, True, ENTROPY, SUM_SQ, SMOOTHING or MEAN, TOP1, PRED)  # fmt: skip
        log2_s = tl.log2(s)
        ref = tl.where(m == float("-inf"), 0.0, m)  # s's reference
        lse2 = _base2(ref, k2, SOFTCAP) + log2_s  # the log-sum-exp in base 2
        lse = lse2 * 0.6931471805599453

        z_t = tl.load(base + tgt, mask=valid, other=0.0).to(tl.float32)
        key_t = _order_key(z_t, zc, k2, SOFTCAP, SIGN)
        inv_v = 1.0 / V  # V may be the Python int 1: Triton specializes that value
        # lse - x_t as log2 s minus the target's exponent in s, not lse rounded at the logits'
        # size first: a peaked row's small loss keeps its digits
        ce = (log2_s - _exponent(key_t, k2, ref, SOFTCAP)) * 0.6931471805599453
        mean = _base2(sx, k2, SOFTCAP) * 0.6931471805599453 * inv_v
        if SMOOTHING:  # a masked target and mean are -inf: +inf, where the form above is nan
            x_t = _base2(key_t, k2, SOFTCAP) * 0.6931471805599453
            ce = lse - (1.0 - eps) * x_t - eps * mean
        tl.store(lse_ptr + row, lse)
        tl.store(ce_ptr + row, tl.where(valid, ce, 0.0))
        tl.store(z_ptr + row, tl.where(valid, z_scale * lse * lse, 0.0))
        h = (log2_s - se / s) * 0.6931471805599453
        if ENTROPY:
            tl.store(entropy_ptr + row, tl.where(valid, h, 0.0))
        if SUM_SQ:
            tl.store(sum_sq_ptr + row, tl.where(valid, tl.log(sq) - 2.0 * tl.log(s), 0.0))
        if MEAN:
            tl.store(mean_ptr + row, tl.where(valid, mean, 0.0))
        if TOP1:
            # The first maximum, as argmax takes it: an earlier column as large is the top-1.
            top1 = valid & (key_t >= m) & (key_t > mb)
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
                g = _ce_grad(z, cols, tgt, lse2, a, c, 0.0, h, zc, k2, slope, eps, inv_v,
                             SOFTCAP, SCALED, SIGN, False, SMOOTHING)  # fmt: skip
                g = round_to(g, grad_ptr.dtype.element_ty, INTERPRETED)
                tl.store(gbase + cols, g, mask=mask)

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
        SIGN: tl.constexpr,
        ENTROPY_GRAD: tl.constexpr,
        SMOOTHING: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """Elementwise gradient of a block of columns [col_offset, col_offset + n_cols) given the
        row's logsumexp (and entropy); the output may alias the logits (each element is read
        before written). Stored rounded to nearest (``rounding.round_to``: the interpreter
        too)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        tgt = tl.load(targets_ptr + row).to(tl.int64)
        valid = tgt >= 0
        lse = tl.load(lse_ptr + row)
        zc, k2, slope = _row_maps(cap, scale, inv_temp, SOFTCAP, SCALED, SIGN)
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
        g = _ce_grad(z, cols + col_offset, tgt, lse * 1.4426950408889634, a, c, e, h, zc, k2,
                     slope, eps, inv_v, SOFTCAP, SCALED, SIGN, ENTROPY_GRAD,
                     SMOOTHING)  # fmt: skip
        g = round_to(g, grad_ptr.dtype.element_ty, INTERPRETED)
        tl.store(grad_ptr + row * stride_grad + cols, g, mask=mask)
