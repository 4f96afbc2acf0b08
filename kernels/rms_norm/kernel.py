"""Triton kernels of RMSNorm (the formulas: the package docstring): the forward rows, the
backward rows with each program's partial weight gradient, and the sum of those partials."""

from __future__ import annotations

from ..dispatch import triton_available
from ..rounding import round_to

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = ["dw_partial_sum_kernel", "rms_norm_bwd_kernel", "rms_norm_fwd_kernel"]

rms_norm_fwd_kernel = rms_norm_bwd_kernel = dw_partial_sum_kernel = None

if triton is not None:

    @triton.jit
    def rms_norm_fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        rstd_ptr,
        n_rows,
        N,
        stride_x,
        stride_y,
        eps,
        offset,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        LLAMA_CASTING: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """One program per tile of BLOCK_M whole rows (BLOCK_N >= N)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask_r = rows < n_rows
        mask_c = cols < N
        mask = mask_r[:, None] & mask_c[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        n = x * rstd[:, None]
        w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32) + offset
        if LLAMA_CASTING:
            n = round_to(n, x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
        y = round_to(n * w[None, :], y_ptr.dtype.element_ty, INTERPRETED)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=mask_r)

    @triton.jit
    def rms_norm_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_partial_ptr,
        n_rows,
        N,
        stride_dy,
        stride_x,
        stride_dx,
        offset,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        LLAMA_CASTING: tl.constexpr,
        COMPUTE_DW: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """Program p takes row tiles p, p + P, ... (P programs); it writes their dx and, when
        COMPUTE_DW, the fp32 sum of their dw contributions into row p of ``dw_partial``."""
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(n_rows, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask_c = cols < N
        w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for tile in range(pid, n_tiles, tl.num_programs(0)):
            rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask_r = rows < n_rows
            mask = mask_r[:, None] & mask_c[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=mask_r, other=0.0)
            n = x * rstd[:, None]
            dn = dy * w[None, :]
            if COMPUTE_DW:
                if LLAMA_CASTING:
                    # The weight multiplied the rounded row; its gradient reads the same values.
                    n_w = round_to(n, x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
                    dw_acc += tl.sum(dy * n_w, axis=0)
                else:
                    dw_acc += tl.sum(dy * n, axis=0)
            c = tl.sum(dn * n, axis=1) / N
            dx = (dn - n * c[:, None]) * rstd[:, None]
            dx = round_to(dx, dx_ptr.dtype.element_ty, INTERPRETED)
            tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx, mask=mask)
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + pid.to(tl.int64) * N + cols, dw_acc, mask=mask_c)

    @triton.jit
    def dw_partial_sum_kernel(
        partial_ptr, dw_ptr, n_partials, N, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        """dw[c] = the sum of the (n_partials, N) fp32 buffer's column c, in a fixed order,
        rounded once (to nearest, the interpreter too) to dw's dtype. Program p takes columns
        [p * BLOCK_C, (p + 1) * BLOCK_C)."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = cols < N
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for p0 in range(0, n_partials, BLOCK_P):
            rows = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
            mask = (rows < n_partials)[:, None] & mask_c[None, :]
            acc += tl.load(partial_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        dw = round_to(tl.sum(acc, axis=0), dw_ptr.dtype.element_ty, INTERPRETED)
        tl.store(dw_ptr + cols, dw, mask=mask_c)
