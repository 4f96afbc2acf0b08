"""Host launchers of RMSNorm, ``rms_norm_fwd`` and ``rms_norm_bwd``, their launch configuration,
and the PyTorch path they take on CPU without the interpreter."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..dispatch import cdiv, interpreter_enabled, next_power_of_2, use_triton
from ..launch import launch as launch_kernel
from .kernel import dw_partial_sum_kernel, rms_norm_bwd_kernel, rms_norm_fwd_kernel

__all__ = [
    "CASTING_MODES",
    "DEFAULT_LAUNCH",
    "INTERPRETER_LAUNCH",
    "MAX_HIDDEN",
    "RmsNormLaunch",
    "rms_norm_bwd",
    "rms_norm_fwd",
]

CASTING_MODES = ("llama", "gemma")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One program holds whole rows in registers: the widest row it takes (elements).
MAX_HIDDEN = 65536
# Rows the PyTorch fallback upcasts to fp32 at once.
FALLBACK_ROWS = 4096


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
        INTERPRETED=interpreter_enabled(),
    )
    return dx, dw
