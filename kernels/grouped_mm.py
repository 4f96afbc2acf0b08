"""The weight gradient of a grouped GEMM as one op where torch's grouped GEMM cannot run:
``grouped_weight_grad_loop``, each group's rows of ``a`` transposed times its rows of ``b``.

One op, opaque to ``torch.compile``, as transformers' own per-expert fallback is: one host read of
the offsets, and a loop over data-dependent group sizes that inductor could not improve on.
Plain PyTorch; the reference beside it computes the same products in fp32.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_weight_grad_loop", "grouped_weight_grad_reference"]


@torch.library.custom_op("surgery::grouped_weight_grad_loop", mutates_args=())
def grouped_weight_grad_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(groups, a's columns, b's columns) in ``a``'s dtype: group g's rows of ``a`` (rows
    ``offs[g - 1]`` to ``offs[g]``, ``offs`` the int32 end row of each group) transposed times its
    rows of ``b``; zeros for an empty group."""
    out = torch.zeros(offs.size(0), a.size(1), b.size(1), device=a.device, dtype=a.dtype)
    start = 0
    for group, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end].t(), b[start:end], out=out[group])
        start = end
    return out


@grouped_weight_grad_loop.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offs.size(0), a.size(1), b.size(1))


def grouped_weight_grad_reference(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``grouped_weight_grad_loop`` in fp32, one group at a time from the offsets."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([a[s:e].float().t() @ b[s:e].float() for s, e in zip(starts, ends)])
