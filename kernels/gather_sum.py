"""Rows gathered in groups and summed: ``out[i] = sum_k w[r] values[r]`` with r the row
``index[i * group + k]`` (w = 1 without ``weights``).

A mixture of experts runs it twice per layer (``surgery.forwards.experts``): to sum each token's
top-k expert outputs weighted by their routing weights (rows sorted by expert, ``index`` the sorted
row of each (token, slot)), and in the backward to sum the gradients of a token's top-k gathered
input rows. Written as
``values[index].view(-1, group, width).sum(1)`` the compiler materialises nothing but runs a
reduction of length ``group`` per output element, several times slower than a copy of the
rows (``benchmarks/results/train_step-qwen3_moe-compile-gather-sum*``); the kernel gives each
program a block of one output row and adds the ``group`` source rows in order: one read of every
gathered row and one write of the output, at copy speed.

Contract: ``values`` (rows, width), unit stride along the width, fp32 / bf16 / fp16; ``index``
(n x group,) int32 or int64 rows of ``values``, every one in range (not checked); ``weights``
(rows,) or None, any float dtype; returns a new contiguous (n, width) tensor in ``values``' dtype:
each row times its weight and the group's rows summed, in fp32, in order k = 0, 1, ..., rounded
once. The PyTorch path (CPU without the Triton interpreter) sums in fp32
too, in PyTorch's reduction order. Not differentiable itself: ``surgery.forwards.experts`` gives it
a backward.

Reference: ``gather_sum_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dispatch import (
    cdiv,
    interpreter_enabled,
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
    "DEFAULT_LAUNCH",
    "INTERPRETER_LAUNCH",
    "GatherSumLaunch",
    "gather_sum",
    "gather_sum_reference",
]


if triton is not None:

    @triton.jit
    def gather_sum_kernel(
        values_ptr,
        index_ptr,
        weights_ptr,
        out_ptr,
        width,
        values_stride,
        GROUP: tl.constexpr,
        WEIGHTED: tl.constexpr,
        BLOCK: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """out[i, cols] = sum over k < GROUP of w[r] values[r, cols], r = index[i GROUP + k] (w = 1
        unless WEIGHTED): program (i, j) writes the j-th BLOCK columns of output row i."""
        i = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(GROUP):
            row = tl.load(index_ptr + i * GROUP + k).to(tl.int64)
            x = tl.load(values_ptr + row * values_stride + cols, mask=mask).to(tl.float32)
            if WEIGHTED:
                x = x * tl.load(weights_ptr + row).to(tl.float32)
            acc += x
        out = out_ptr + i * width + cols
        tl.store(out, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@dataclass(frozen=True)
class GatherSumLaunch:
    """Launch configuration: up to ``block`` columns of one output row per program."""

    block: int = 1024
    num_warps: int = 4


DEFAULT_LAUNCH = GatherSumLaunch()
# The interpreter pays per program: whole rows.
INTERPRETER_LAUNCH = GatherSumLaunch(block=1 << 14)


def _group_sum(values, index, group: int, weights, dtype: torch.dtype) -> torch.Tensor:
    # The gathered rows (times their weights) summed per group in ``dtype``.
    rows = values[index].to(dtype)
    if weights is not None:
        rows = rows * weights[index].to(dtype)[:, None]
    return rows.view(-1, group, values.shape[-1]).sum(dim=1)


def _gather_sum_torch(values, index, group: int, weights=None) -> torch.Tensor:
    return _group_sum(values, index, group, weights, torch.float32).to(values.dtype)


def _gather_sum(values, index, group: int, weights=None) -> torch.Tensor:
    n, width = index.numel() // group, values.shape[-1]
    if not use_triton(values):
        return _gather_sum_torch(values, index, group, weights)
    out = values.new_empty(n, width)
    if out.numel() == 0:
        return out
    if values.stride(-1) != 1:
        values = values.contiguous()
    launch = DEFAULT_LAUNCH if values.is_cuda else INTERPRETER_LAUNCH
    block = min(launch.block, next_power_of_2(width))
    launch_kernel(
        gather_sum_kernel,
        (n, cdiv(width, block)),
        values,
        index,
        values if weights is None else weights,
        out,
        width,
        values.stride(0),
        GROUP=group,
        WEIGHTED=weights is not None,
        BLOCK=block,
        INTERPRETED=interpreter_enabled(),
        num_warps=launch.num_warps,
    )
    return out


# An op: opaque to torch.compile, which would run the gather and sum as a slow reduction.
@torch.library.custom_op("surgery::gather_sum", mutates_args=())
def gather_sum(
    values: torch.Tensor, index: torch.Tensor, group: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(len(index) // group, width): the rows of ``values`` (rows, width) that ``index`` picks,
    each times its entry of ``weights`` (rows,) when given, summed in consecutive groups of
    ``group`` (the module docstring states the contract)."""
    weights = None if weights is None else weights.contiguous()
    return _gather_sum(values, index.contiguous(), group, weights)


@gather_sum.register_fake
def _(values, index, group, weights=None):
    return values.new_empty(index.numel() // group, values.shape[-1])


def gather_sum_reference(
    values: torch.Tensor, index: torch.Tensor, group: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """What ``gather_sum`` computes, in fp64 (each row and weight as stored, multiplied and summed
    exactly enough to measure a kernel's error against)."""
    return _group_sum(values, index, group, weights, torch.float64)
