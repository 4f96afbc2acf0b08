"""Triton kernels of the rotary embedding (the maps are stated in ``surgery.kernels.rope``).

Both kernels rotate (B, H, T, D) q and k with any strides, one program per (token block, head
group, batch row), cos/sin computed (or read) once per (token, frequency) and reused across every
head of q and k in the program. Two constexpr flags say where channel pair j lives:

    IN_INTERLEAVED  False: read x_j, x_{j+r/2} (rotate-half)    True: read x_{2j}, x_{2j+1}
    OUT_INTERLEAVED False: write o_j, o_{j+r/2}                  True: write o_{2j}, o_{2j+1}

so the rotate-half kernel compiles to the same code whatever other layouts exist, and a layout's
backward is the same kernel with the flags swapped and the angle negated. Interleaved pairs move
as whole contiguous rows (vector loads and stores) and are split or joined in registers; reading
them interleaved and writing them half-split moves values between threads, through shared
memory. TODO: time the interleaved layouts on the GPU (a layout option in
benchmarks/bench_rope.py) to know what that shuffle costs against a copy.

Multimodal RoPE (MROPE, a constexpr) changes only where a frequency's position comes from: one
of three position rows (temporal, height, width), picked per frequency by the section sizes
(constexprs too) in registers; the rest of the kernel is the same.
"""

from __future__ import annotations

from ..dispatch import triton_available
from ..rounding import round_to

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = ["rope_cos_sin_kernel", "rope_fwd_kernel"]


if triton is not None:

    @triton.jit
    def _cos_sin_sfu(angle):
        # cos/sin of fp32 angles in ~10 instructions instead of libdevice's ~40 plus a slow path:
        # reduce to [-pi, pi] with 2*pi split in two (the FMAs keep k * 2pi_hi exact, so the
        # residue is right to ~1e-7 for any angle a position reaches), then the SFU's sin/cos,
        # absolute error < 2**-20.9 on [-pi, pi]: far below bf16/fp16 rounding, and below the
        # fp32 rounding of the angle itself beyond the first positions.
        k = tl.floor(angle * 0.15915494309189535 + 0.5)
        r = tl.fma(-k, 6.2831854820251465, angle)
        r = tl.fma(-k, -1.7484556025237907e-07, r)
        cos = tl.inline_asm_elementwise(
            "cos.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        sin = tl.inline_asm_elementwise(
            "sin.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        return cos, sin

    @triton.jit
    def _mrope_positions(pos_ptr, spos_s, mask_t, f, MROPE: tl.constexpr, SECTION_T: tl.constexpr,
                         SECTION_H: tl.constexpr, SECTION_W: tl.constexpr):  # fmt: skip
        # [BLOCK_T, HALF_PAD] fp32 position of every (token, frequency): the three rows are
        # loaded once (BLOCK_T values each) and each frequency selects its row in registers, so
        # no per-frequency table is read and the section layout costs a few integer compares.
        p_t = tl.load(pos_ptr, mask=mask_t, other=0).to(tl.float32)[:, None]
        p_h = tl.load(pos_ptr + spos_s, mask=mask_t, other=0).to(tl.float32)[:, None]
        p_w = tl.load(pos_ptr + 2 * spos_s, mask=mask_t, other=0).to(tl.float32)[:, None]
        if MROPE == 1:  # contiguous: SECTION_T temporal, then SECTION_H height, the rest width
            is_h = (f >= SECTION_T) & (f < SECTION_T + SECTION_H)
            is_w = f >= SECTION_T + SECTION_H
        else:  # interleaved: j % 3 == 1 height and j % 3 == 2 width while the section lasts
            is_h = (f % 3 == 1) & (f < 3 * SECTION_H)
            is_w = (f % 3 == 2) & (f < 3 * SECTION_W)
        return tl.where(is_h[None, :], p_h, tl.where(is_w[None, :], p_w, p_t))

    @triton.jit
    def _rotate_block(
        x_ptr,
        o_ptr,
        h0,
        n_heads,
        sx_h,
        sx_t,
        sx_d,
        so_h,
        so_t,
        so_d,
        t3,
        mask_t3,
        cos_lo,
        sin_lo,
        cos_hi,
        sin_hi,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        IN_INTERLEAVED: tl.constexpr,
        OUT_INTERLEAVED: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        # One [BLOCK_T, BLOCK_H, HALF] tile per member of the rotated channel pairs; x and o
        # already point at this program's batch row. 64-bit offsets: a (B, H, T, D) view of a
        # large (B, T, H, D) buffer has offsets past 2**31.
        h3 = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        mask = mask_t3 & (h3 < n_heads)
        f3 = tl.arange(0, HALF_PAD)[None, None, :]
        if HALF != HALF_PAD:
            mask_f = mask & (f3 < HALF)
        else:
            mask_f = mask
        if IN_INTERLEAVED or OUT_INTERLEAVED:
            # Interleaved pairs move as whole rows of 2 * HALF channels (contiguous, so vector
            # loads and stores), seen as [.., HALF_PAD, 2] in registers to split into the pairs.
            # The reshapes keep the element order, and the split/join stay within a thread.
            c3 = tl.arange(0, 2 * HALF_PAD)[None, None, :]
            if HALF != HALF_PAD:
                mask_c = mask & (c3 < 2 * HALF)
            else:
                mask_c = mask
            row_shape: tl.constexpr = (mask.shape[0], mask.shape[1], 2 * HALF_PAD)
            pair_shape: tl.constexpr = (mask.shape[0], mask.shape[1], HALF_PAD, 2)
        if IN_INTERLEAVED:
            x_row = tl.load(x_ptr + t3 * sx_t + h3 * sx_h + c3 * sx_d, mask=mask_c, other=0.0)
            x1, x2 = tl.split(tl.reshape(x_row.to(tl.float32), pair_shape))
        else:
            x_lo = x_ptr + t3 * sx_t + h3 * sx_h + f3 * sx_d
            x1 = tl.load(x_lo, mask=mask_f, other=0.0).to(tl.float32)
            x2 = tl.load(x_lo + HALF * sx_d, mask=mask_f, other=0.0).to(tl.float32)
        out_ty = o_ptr.dtype.element_ty
        out_lo = round_to(x1 * cos_lo - x2 * sin_lo, out_ty, INTERPRETED)
        out_hi = round_to(x2 * cos_hi + x1 * sin_hi, out_ty, INTERPRETED)
        if OUT_INTERLEAVED:
            o_row = tl.reshape(tl.join(out_lo, out_hi), row_shape)
            tl.store(o_ptr + t3 * so_t + h3 * so_h + c3 * so_d, o_row, mask=mask_c)
        else:
            o_lo = o_ptr + t3 * so_t + h3 * so_h + f3 * so_d
            tl.store(o_lo, out_lo, mask=mask_f)
            tl.store(o_lo + HALF * so_d, out_hi, mask=mask_f)
        if PASS > 0:
            # Channels past rotary_dim are copied: the output is a new tensor.
            p3 = 2 * HALF + tl.arange(0, PASS_PAD)[None, None, :]
            mask_p = mask & (p3 < 2 * HALF + PASS)
            xp = tl.load(x_ptr + t3 * sx_t + h3 * sx_h + p3 * sx_d, mask=mask_p, other=0.0)
            tl.store(o_ptr + t3 * so_t + h3 * so_h + p3 * so_d, xp.to(out_ty), mask=mask_p)

    @triton.jit
    def _rotate_q_and_k(
        q_ptr,
        k_ptr,
        oq_ptr,
        ok_ptr,
        pid_b,
        n_q_heads,
        n_k_heads,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        soq_b,
        soq_h,
        soq_t,
        soq_d,
        sok_b,
        sok_h,
        sok_t,
        sok_d,
        t3,
        mask_t3,
        cos_lo,
        sin_lo,
        cos_hi,
        sin_hi,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        IN_INTERLEAVED: tl.constexpr,
        OUT_INTERLEAVED: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        # Head blocks of q and k form one list; program g of the head-group axis takes blocks
        # g, g + G, ... so a split stays balanced between q and k (GQA: k has fewer heads, down
        # to MLA's one key head shared by every query head).
        n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
        n_blocks = n_q_blocks + tl.cdiv(n_k_heads, BLOCK_H)
        q_ptr += pid_b * sq_b
        k_ptr += pid_b * sk_b
        oq_ptr += pid_b * soq_b
        ok_ptr += pid_b * sok_b
        for j in range(tl.program_id(1), n_blocks, tl.num_programs(1)):
            if j < n_q_blocks:
                _rotate_block(q_ptr, oq_ptr, j * BLOCK_H, n_q_heads, sq_h, sq_t, sq_d,
                              soq_h, soq_t, soq_d, t3, mask_t3, cos_lo, sin_lo, cos_hi, sin_hi,
                              HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, IN_INTERLEAVED,
                              OUT_INTERLEAVED, INTERPRETED)  # fmt: skip
            else:
                _rotate_block(k_ptr, ok_ptr, (j - n_q_blocks) * BLOCK_H, n_k_heads, sk_h, sk_t,
                              sk_d, sok_h, sok_t, sok_d, t3, mask_t3, cos_lo, sin_lo, cos_hi,
                              sin_hi, HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, IN_INTERLEAVED,
                              OUT_INTERLEAVED, INTERPRETED)  # fmt: skip

    @triton.jit
    def rope_fwd_kernel(
        q_ptr,
        k_ptr,
        oq_ptr,
        ok_ptr,
        pos_ptr,
        inv_freq_ptr,
        T,
        n_q_heads,
        n_k_heads,
        scale,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        soq_b,
        soq_h,
        soq_t,
        soq_d,
        sok_b,
        sok_h,
        sok_t,
        sok_d,
        spos_s,
        spos_b,
        spos_t,
        s_inv,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        IN_INTERLEAVED: tl.constexpr,
        OUT_INTERLEAVED: tl.constexpr,
        INVERSE: tl.constexpr,
        MROPE: tl.constexpr,
        SECTION_T: tl.constexpr,
        SECTION_H: tl.constexpr,
        SECTION_W: tl.constexpr,
        SFU_TRIG: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """Grid (token blocks, head groups, batch). INVERSE rotates by -angle (the backward).

        MROPE 0: one position per token. 1 (sections contiguous) or 2 (interleaved): three
        position rows (temporal, height, width; ``spos_s`` apart), frequency j taking its
        position from the row ``_mrope_positions`` gives it."""
        pid_b = tl.program_id(2).to(tl.int64)
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        f = tl.arange(0, HALF_PAD)
        inv_freq = tl.load(inv_freq_ptr + f * s_inv, mask=f < HALF, other=0.0).to(tl.float32)
        pos_ptr += pid_b * spos_b + offs_t * spos_t
        if MROPE == 0:
            pos = tl.load(pos_ptr, mask=mask_t, other=0).to(tl.float32)[:, None, None]
        else:
            pos = _mrope_positions(pos_ptr, spos_s, mask_t, f, MROPE, SECTION_T, SECTION_H,
                                   SECTION_W)[:, None, :]  # fmt: skip
        # Same fp32 product as transformers' rotary modules, so angles agree bit for bit.
        angle = pos * inv_freq[None, None, :]
        if SFU_TRIG:
            cos, sin = _cos_sin_sfu(angle)
        else:
            cos, sin = tl.cos(angle), tl.sin(angle)
        cos = cos * scale
        sin = sin * scale
        if INVERSE:
            sin = -sin
        t3 = offs_t.to(tl.int64)[:, None, None]
        _rotate_q_and_k(q_ptr, k_ptr, oq_ptr, ok_ptr, pid_b, n_q_heads, n_k_heads,
                        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
                        soq_b, soq_h, soq_t, soq_d, sok_b, sok_h, sok_t, sok_d,
                        t3, mask_t[:, None, None], cos, sin, cos, sin,
                        HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, IN_INTERLEAVED, OUT_INTERLEAVED,
                        INTERPRETED)  # fmt: skip

    @triton.jit
    def rope_cos_sin_kernel(
        q_ptr,
        k_ptr,
        oq_ptr,
        ok_ptr,
        cos_ptr,
        sin_ptr,
        T,
        n_q_heads,
        n_k_heads,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        soq_b,
        soq_h,
        soq_t,
        soq_d,
        sok_b,
        sok_h,
        sok_t,
        sok_d,
        sc_b,
        sc_t,
        sc_d,
        ss_b,
        ss_t,
        ss_d,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """q * cos + rotate_half(q) * sin with cos/sin rows (B|1, T, r) read once per program.

        Both halves of cos and sin are read, so any cos/sin (not only [c, c] / [s, s]) gives
        transformers' formula; TRANSPOSE applies the transposed map (the backward). Rotate-half
        layout only.
        """
        pid_b = tl.program_id(2).to(tl.int64)
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        t3 = offs_t.to(tl.int64)[:, None, None]
        f3 = tl.arange(0, HALF_PAD)[None, None, :]
        mask = mask_t[:, None, None] & (f3 < HALF)
        c_lo_ptr = cos_ptr + pid_b * sc_b + t3 * sc_t + f3 * sc_d
        s_lo_ptr = sin_ptr + pid_b * ss_b + t3 * ss_t + f3 * ss_d
        cos_lo = tl.load(c_lo_ptr, mask=mask, other=0.0).to(tl.float32)
        cos_hi = tl.load(c_lo_ptr + HALF * sc_d, mask=mask, other=0.0).to(tl.float32)
        sin_lo = tl.load(s_lo_ptr, mask=mask, other=0.0).to(tl.float32)
        sin_hi = tl.load(s_lo_ptr + HALF * ss_d, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            # dx_lo = g_lo cos_lo + g_hi sin_hi ; dx_hi = g_hi cos_hi - g_lo sin_lo
            sin_tmp = -sin_hi
            sin_hi = -sin_lo
            sin_lo = sin_tmp
        _rotate_q_and_k(q_ptr, k_ptr, oq_ptr, ok_ptr, pid_b, n_q_heads, n_k_heads,
                        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
                        soq_b, soq_h, soq_t, soq_d, sok_b, sok_h, sok_t, sok_d,
                        t3, mask_t[:, None, None], cos_lo, sin_lo, cos_hi, sin_hi,
                        HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, False, False,
                        INTERPRETED)  # fmt: skip
else:  # pragma: no cover
    rope_fwd_kernel = rope_cos_sin_kernel = None
