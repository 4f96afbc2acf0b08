"""RMSNorm over the last dimension, with transformers' cast points, in one read and one write.

Order: Triton kernels -> host launchers (``rms_norm_fwd``, ``rms_norm_bwd``) ->
torch.library ops and the one autograd formula (registered on the op for torch.compile, and the
eager ``RmsNormFunction`` over the launchers) -> ``rms_norm``, with the reference
``rms_norm_reference`` last.

Per row x of N elements, in fp32 whatever the storage dtype (o = ``offset``, w = weight):

    rstd = 1 / sqrt(mean(x^2) + eps)        n = x * rstd
    casting "llama":  y = round_in(n) * (o + w), rounded to promote(x.dtype, w.dtype)
    casting "gemma":  y = n * (o + w),           rounded to x.dtype

where round_in rounds to x's dtype and back: transformers' Llama, Mistral and Qwen2/3 norms return
``weight * normed.to(input_dtype)``; Gemma 1/2/3 return ``(normed * (1 + weight.float()))
.type_as(x)``. The backward treats the roundings as the identity (as autograd does for transformers'
casts), with dn = dy * (o + w):

    dx = rstd * (dn - n * mean(dn * n))
    dw = sum over rows of dy * round_in(n)  (llama), or of dy * n  (gemma)

The forward saves x and rstd (fp32, one per row) and nothing else. dw is summed in fp32: each
backward program accumulates its rows into one row of a (programs, N) buffer, and the rows of that
buffer are added at the end (no atomics, the same result on every run).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from .dispatch import (
    cdiv,
    eager_function,
    interpreter_enabled,
    kernel_path,
    next_power_of_2,
    triton_available,
    use_triton,
)
from .launch import launch as launch_kernel
from .rounding import round_to

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = [
    "CASTING_MODES",
    "RmsNormFunction",
    "RmsNormLaunch",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_reference",
]

CASTING_MODES = ("llama", "gemma")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One program holds whole rows in registers: the widest row it takes (elements).
MAX_HIDDEN = 65536
# Rows the PyTorch fallback upcasts to fp32 at once.
FALLBACK_ROWS = 4096


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
        partial_ptr, dw_ptr, n_partials, N, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
    ):
        """dw[c] = the sum of the (n_partials, N) fp32 buffer's column c, in a fixed order,
        rounded once to dw's dtype. Program p takes columns [p * BLOCK_C, (p + 1) * BLOCK_C)."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = cols < N
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for p0 in range(0, n_partials, BLOCK_P):
            rows = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
            mask = (rows < n_partials)[:, None] & mask_c[None, :]
            acc += tl.load(partial_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        tl.store(dw_ptr + cols, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=mask_c)


# ---------------------------------------------------------------------------------------------
# Host launchers


@dataclass(frozen=True)
class RmsNormLaunch:
    """Launch configuration; the defaults are the fixed setting, others exist for tests
    and sweeps.

    A program holds a tile of ``max(1, tile_elems // BLOCK_N)`` whole rows (BLOCK_N: N rounded up
    to a power of two), so narrow rows (q/k norms over a 64-256 head dim) still give every program
    a few thousand elements. ``programs``: backward programs (each owns one fp32 row of the dw
    buffer); None: ``bwd_programs_per_sm`` per SM on a GPU. ``num_warps``: None scales with the
    tile, 16 elements per thread up to 16 warps. ``sum_rows`` x ``sum_cols``: the tile of the
    dw buffer that each program of the final column sum adds up at a time.
    """

    tile_elems: int = 4096
    programs: int | None = None
    bwd_programs_per_sm: int = 2
    num_warps: int | None = None
    sum_rows: int = 128
    sum_cols: int = 32


DEFAULT_LAUNCH = RmsNormLaunch()
# The interpreter pays per program and per operation, not per element: few large programs.
INTERPRETER_LAUNCH = RmsNormLaunch(tile_elems=1 << 16, programs=2, sum_cols=1 << 12)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tiling(launch: RmsNormLaunch, n_rows: int, N: int) -> tuple[int, int, int]:
    block_n = next_power_of_2(N)
    block_m = max(1, launch.tile_elems // block_n)
    block_m = min(next_power_of_2(block_m), next_power_of_2(max(n_rows, 1)))
    num_warps = launch.num_warps
    if num_warps is None:
        num_warps = min(16, max(4, block_m * block_n // 512))
        if block_n >= 32768:  # wide rows: keep the per-thread share in registers
            num_warps = 32
    return block_m, block_n, num_warps


def _out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, casting: str) -> torch.dtype:
    # transformers: ``weight * normed.to(input_dtype)`` promotes; Gemma's ``.type_as(x)`` does not.
    return torch.promote_types(x_dtype, w_dtype) if casting == "llama" else x_dtype


def _fwd_torch(x2d, weight, y, rstd, eps, offset, casting):
    w = weight.float() + offset
    for r0 in range(0, x2d.shape[0], FALLBACK_ROWS):
        sl = slice(r0, r0 + FALLBACK_ROWS)
        xf = x2d[sl].float()
        r = torch.rsqrt(xf.square().mean(-1) + eps)
        n = xf * r[:, None]
        if casting == "llama":
            n = n.to(x2d.dtype).float()
        y[sl] = (n * w).to(y.dtype)
        rstd[sl] = r


def _bwd_torch(dy, x2d, weight, rstd, dx, dw, offset, casting):
    w = weight.float() + offset
    N = x2d.shape[1]
    for r0 in range(0, x2d.shape[0], FALLBACK_ROWS):
        sl = slice(r0, r0 + FALLBACK_ROWS)
        r = rstd[sl, None]
        n = x2d[sl].float() * r
        g = dy[sl].float()
        dn = g * w
        if dw is not None:
            n_w = n.to(x2d.dtype).float() if casting == "llama" else n
            dw += (g * n_w).sum(0)
        dx[sl] = ((dn - n * ((dn * n).sum(-1, keepdim=True) / N)) * r).to(dx.dtype)


def rms_norm_fwd(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
    launch: RmsNormLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise the rows of 2-D ``x2d`` (rows, N; unit stride along N) as validated by
    ``rms_norm`` (no checks here). Returns ``(y, rstd)``: y (rows, N) contiguous in the casting's
    output dtype, rstd (rows,) fp32; written into ``out`` when given (tests poison it)."""
    n_rows, N = x2d.shape
    if out is not None:
        y, rstd = out
    else:
        y_dtype = _out_dtype(x2d.dtype, weight.dtype, casting)
        y = torch.empty(n_rows, N, dtype=y_dtype, device=x2d.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows == 0:
        return y, rstd
    if not use_triton(x2d):
        _fwd_torch(x2d, weight, y, rstd, eps, offset, casting)
        return y, rstd
    launch = launch or (DEFAULT_LAUNCH if x2d.is_cuda else INTERPRETER_LAUNCH)
    block_m, block_n, num_warps = _tiling(launch, n_rows, N)
    launch_kernel(
        rms_norm_fwd_kernel,
        (cdiv(n_rows, block_m),),
        x2d,
        weight,
        y,
        rstd,
        n_rows,
        N,
        x2d.stride(0),
        y.stride(0),
        float(eps),
        float(offset),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        LLAMA_CASTING=casting == "llama",
        INTERPRETED=interpreter_enabled(),
        num_warps=num_warps,
    )
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float = 0.0,
    casting: str = "llama",
    compute_dw: bool = True,
    launch: RmsNormLaunch | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``rms_norm_fwd`` given ``dy`` (rows, N; unit stride along N): ``(dx, dw)``,
    dx (rows, N) in x's dtype (written into ``out`` when given), dw (N,) in the weight's dtype
    (None unless ``compute_dw``)."""
    n_rows, N = x2d.shape
    dev = x2d.device
    dx = torch.empty(n_rows, N, dtype=x2d.dtype, device=dev) if out is None else out
    if n_rows == 0 or not use_triton(x2d):
        dw32 = torch.zeros(N, dtype=torch.float32, device=dev) if compute_dw else None
        if n_rows:
            _bwd_torch(dy, x2d, weight, rstd, dx, dw32, offset, casting)
        return dx, None if dw32 is None else dw32.to(weight.dtype)
    launch = launch or (DEFAULT_LAUNCH if x2d.is_cuda else INTERPRETER_LAUNCH)
    block_m, block_n, num_warps = _tiling(launch, n_rows, N)
    n_tiles = cdiv(n_rows, block_m)
    programs = launch.programs
    if programs is None:
        programs = launch.bwd_programs_per_sm * (_sm_count(dev.index or 0) if x2d.is_cuda else 1)
    programs = max(1, min(programs, n_tiles))
    dw_partial = torch.empty(programs if compute_dw else 1, N, dtype=torch.float32, device=dev)
    launch_kernel(
        rms_norm_bwd_kernel,
        (programs,),
        dy,
        x2d,
        weight,
        rstd,
        dx,
        dw_partial,
        n_rows,
        N,
        dy.stride(0),
        x2d.stride(0),
        dx.stride(0),
        float(offset),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        LLAMA_CASTING=casting == "llama",
        COMPUTE_DW=compute_dw,
        INTERPRETED=interpreter_enabled(),
        num_warps=num_warps,
    )
    if not compute_dw:
        return dx, None
    # One small kernel sums the buffer's rows and rounds, faster than PyTorch's column sum and
    # cast (the launch sweep and the compiled Llama step's norm backwards:
    # benchmarks/results/rms_norm_bwd_launch.txt).
    dw = torch.empty(N, dtype=weight.dtype, device=dev)
    block_p = min(launch.sum_rows, next_power_of_2(programs))
    launch_kernel(
        dw_partial_sum_kernel,
        (cdiv(N, launch.sum_cols),),
        dw_partial,
        dw,
        programs,
        N,
        BLOCK_P=block_p,
        BLOCK_C=launch.sum_cols,
    )
    return dx, dw


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


# ---------------------------------------------------------------------------------------------
# Public functions.


def _check(x, weight, eps, casting) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm: x and weight must be tensors, got {type(x)}, {type(weight)}")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"rms_norm: x and weight must be float32, bfloat16 or float16; got {x.dtype} and "
            f"{weight.dtype}"
        )
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be 1-D with x's last dimension; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"rms_norm: rows of more than {MAX_HIDDEN} elements are not supported")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")
    if casting not in CASTING_MODES:
        raise ValueError(f"rms_norm: casting must be one of {CASTING_MODES}, got {casting!r}")
    if not eps >= 0.0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: Literal["llama", "gemma"] = "llama",
) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 inside the kernel.

    Args:
        x: (..., N), any leading shape; float32, bfloat16 or float16. The last dimension must have
            unit stride for a copy-free call (otherwise x is copied). N <= 65536.
        weight: (N,); float32, bfloat16 or float16, on x's device.
        eps: added to the mean square before the reciprocal square root.
        offset: the scale is ``offset + weight`` (in fp32): 0.0 for Llama-style weights, 1.0 for
            Gemma's zero-centred ones.
        casting: where the result is rounded, to reproduce transformers' modules:
            ``"llama"`` (Llama, Mistral, Qwen2, Qwen3): the normalised row is rounded to x's dtype,
            then multiplied by the scale, and the product rounded to ``promote(x.dtype,
            weight.dtype)`` — ``weight * normed.to(input_dtype)``;
            ``"gemma"`` (Gemma 1/2/3): normalised and scaled in fp32, rounded once to x's dtype —
            ``(normed * (1 + weight.float())).type_as(x)``.

    Returns:
        A new tensor of x's shape in the casting's output dtype. x is never written.

    Differentiable in x and weight (once: a double backward raises): the forward saves x and one
    fp32 rstd per row; the backward recomputes the normalised rows, and sums the weight gradient in
    fp32 over every row (skipped when the weight does not require grad, e.g. under LoRA). Under
    ``torch.compile(fullgraph=True)`` it is the op ``torch.ops.surgery.rms_norm_fwd`` with its
    registered autograd (fake tensors registered too); an eager call that autograd records runs the
    same setup and backward as ``RmsNormFunction`` over the launchers; one with nothing to
    differentiate (grad mode off, or neither x nor weight requiring grad) the launcher
    ``rms_norm_fwd`` alone. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``)
    run the Triton kernels; other CPU tensors a PyTorch path with the same fp32 math.

    Autocast (the rule of every kernel here: inputs are cast on entry where the unpatched module's
    ops would cast them, and nothing after that depends on autocast): transformers' norms are
    elementwise, which autocast leaves alone, so nothing is cast and the output dtype follows
    ``casting`` as without autocast — ``"llama"``: promote(x, weight), fp32 for an fp32 weight
    whatever x's dtype; ``"gemma"``: x's dtype — which is what transformers' module returns under
    autocast. No op inside depends on autocast: the result is that of the call without it, bit for
    bit.
    """
    _check(x, weight, eps, casting)
    N = x.shape[-1]
    x2d = x.reshape(-1, N)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    eps, offset = float(eps), float(offset)
    path = kernel_path(x2d, weight)
    if path == "op":
        y, _ = _rms_norm_fwd_op(x2d, weight, eps, offset, casting)
    elif path == "function":
        y, _ = RmsNormFunction.apply(x2d, weight, eps, offset, casting)
    else:
        y, _ = rms_norm_fwd(x2d, weight, eps, offset, casting)
    return y.view(x.shape)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: Literal["llama", "gemma"] = "llama",
) -> torch.Tensor:
    """Reference for ``rms_norm`` in plain PyTorch, differentiable, with the same cast points.

    Computed in fp32, or in fp64 when x is fp64 (tests use that as ground truth: with fp64 x and
    weight every cast is exact and the result is the norm itself)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    scale = weight.to(ct) + offset
    if casting == "llama":
        return (normed.to(x.dtype).to(ct) * scale).to(_out_dtype(x.dtype, weight.dtype, casting))
    return (normed * scale).to(x.dtype)
