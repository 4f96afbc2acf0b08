"""The two gradient products of a logit gradient kept up to its rows' scales: a softcapped head's
fused forward's Q (``products.softcap_products``), or the unit gradient the kept schedule keeps
of other heads (``ops.lce_fwd``: each row's gradient for a coefficient of 1, E = 0); and the
passes over (rows, D) around them.

A row's logit gradient for its coefficient is ``scale_i Q_i + E_i``, E one entry per row,
``corr_i`` at the target's column (``TargetTerms``): kept apart from Q, the row's one large entry
is never rounded to bf16. So

    dX = diag(scale) (Q W) + diag(corr) W[targets]    dW = Q^T (diag(scale) X) + E^T X,

Q W accumulated in fp32 and each row's sum rounded once, diag(scale) X rounded once before its
product, E^T X added by a sorted (deterministic) accumulation. The row passes run in one Triton
kernel each (``scaled_rows``: out = a s + t b[idx] per row, fp32, rounded once), where PyTorch's
mixed-dtype multiplications took three to four times a copy's time (about 0.1 ms each at Gemma 2's
head, 8192 x 2304: ``benchmarks/results/trl_head-h200-*``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..dispatch import cdiv, on_device, triton_available, use_triton
from .products import logit_map

if triton_available():
    import triton
    import triton.language as tl

    from ..rounding import round_to
else:  # pragma: no cover
    triton = None

__all__ = ["TargetTerms", "accumulate_mm", "scaled_dw", "scaled_dx", "scaled_rows",
           "target_terms"]  # fmt: skip

ROWS_BLOCK = 1024

scaled_rows_kernel = None

if triton is not None:

    @triton.jit
    def scaled_rows_kernel(a_ptr, stride_a, s_ptr, t_ptr, b_ptr, stride_b, idx_ptr, out_ptr,
                           stride_out, D, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                           TO_BF16: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """out[i] = a[i] s[i] (+ t[i] b[idx[i]] where GATHER), in fp32, rounded once (to bf16
        where TO_BF16, else out is fp32): one block of one row a program."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        y = a * tl.load(s_ptr + row)
        if GATHER:
            j = tl.load(idx_ptr + row).to(tl.int64)
            b = tl.load(b_ptr + j * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
            y += tl.load(t_ptr + row) * b
        if TO_BF16:
            y = round_to(y, tl.bfloat16, INTERP)
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def scaled_rows(a, s, out, t=None, b=None, idx=None) -> torch.Tensor:
    """``out`` (n, D) = diag(s) a, plus diag(t) b[idx] where ``b`` is given; s, t fp32 (n,); the
    sum in fp32, rounded once to out's dtype (bf16 or fp32 in the kernel; PyTorch's ops take any
    other, and rows not of unit stride along D)."""
    n, d = a.shape
    if n == 0:
        return out
    gather = b is not None
    fits = out.dtype in (torch.bfloat16, torch.float32) and all(
        u.stride(-1) == 1 for u in (a, out, *((b,) if gather else ()))
    )
    if scaled_rows_kernel is None or not use_triton(a) or not fits:
        total = a.float() * s[:, None]
        if b is not None:
            total += t[:, None] * b[idx].float()
        return out.copy_(total)
    s = s.contiguous()
    t, idx = (t.contiguous(), idx.contiguous()) if gather else (s, s)
    block = min(ROWS_BLOCK, triton.next_power_of_2(d))
    with on_device(a):
        scaled_rows_kernel[(n, cdiv(d, block))](
            a, a.stride(0), s, t, b if gather else a, b.stride(0) if gather else 0, idx, out,
            out.stride(0), d,
            BLOCK=block, GATHER=gather, TO_BF16=out.dtype == torch.bfloat16,
            INTERP=not a.is_cuda, num_warps=4,
        )  # fmt: skip
    return out


class TargetTerms(NamedTuple):
    """The logit gradient of a Q's rows for their coefficients, ``diag(scale) Q + E``: ``E`` holds
    one entry per row, ``corr`` at column ``cols`` (0 on rows without a target)."""

    scale: torch.Tensor  # (n,) fp32
    cols: torch.Tensor | None  # (n,) the target columns (clamped into [0, V))
    corr: torch.Tensor | None  # (n,) fp32: E's entries; None: no E (a kept unit gradient)


def target_terms(coef, lse, rows, targets, v: int, z_scale: float, cap: float, transform):
    """The ``TargetTerms`` of a Q whose rows' S and 1 - t^2 at the target are ``rows`` (2, n)
    (``products.softcap_products``; the module docstring of ``products`` has the formulas, with
    cap / T for cap) for ``coef``, the rows' weights on ce and zl alike (or on ce where there is
    no z-loss); dx/dz's factor s / T in ``scale`` and ``corr``."""
    s, d_y = rows
    slope = logit_map(cap, transform).slope
    valid = (targets >= 0) & (targets < v)
    r = 1.0 + 2.0 * z_scale * lse  # >= 1/2 wherever the fused product applies
    scale = torch.where(valid, coef * r / s * slope, 0.0)
    corr = torch.where(valid, -coef * d_y * slope, 0.0)
    return TargetTerms(scale, targets.clamp(0, v - 1), corr)


@functools.cache
def _addmm_out_dtype_works(device_type: str) -> bool:
    # torch.addmm(..., out_dtype=float32) accumulates a bf16/fp16 product into fp32 in cuBLAS; not
    # every build/backend has it, so it is probed once.
    if device_type != "cuda":
        return False
    try:
        acc = torch.zeros(2, 2, device="cuda")
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0].item() == 2.0)
    except (RuntimeError, TypeError):
        return False


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slice_rows: int) -> None:
    """acc (fp32) += a @ b for low-precision a, b without an fp32 copy of either."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_out_dtype_works(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # bounded temporary: slices of the output rows
        for r0 in range(0, acc.shape[0], slice_rows):
            acc[r0 : r0 + slice_rows] += a[r0 : r0 + slice_rows] @ b


def scaled_dx(q, w, terms: TargetTerms, out: torch.Tensor, slice_rows: int) -> None:
    """out = diag(scale) (Q W) + diag(corr) W[cols] (no E where ``corr`` is None): Q W in fp32,
    each row's sum rounded once."""
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    accumulate_mm(acc, q, w, slice_rows)
    if terms.corr is None:
        scaled_rows(acc, terms.scale, out)
    else:
        scaled_rows(acc, terms.scale, out, terms.corr, w, terms.cols)


def scaled_dw(q, x, terms: TargetTerms, dw: torch.Tensor, accumulate: bool, slice_rows):
    """dw (=, or += where ``accumulate``) Q^T diag(scale) x + E^T x; E's rows (rounded to dw's
    dtype) added by a sorted (deterministic) accumulation (none where ``corr`` is None)."""
    xs = scaled_rows(x, terms.scale, torch.empty_like(x))  # rounded once
    if accumulate:
        accumulate_mm(dw, q.t(), xs, slice_rows)
    else:
        torch.mm(q.t(), xs, out=dw)
    if terms.corr is None:
        return
    sparse = scaled_rows(x, terms.corr, torch.empty(x.shape, dtype=dw.dtype, device=dw.device))
    dw.index_put_((terms.cols,), sparse, accumulate=True)
