"""Autograd of the gated activation: torch.library ops (what torch.compile sees: triton_ops, traced
into graphs that launch the kernels themselves) and, for the split layout, the eager
``torch.autograd.Function`` over the same launchers.

Each forward op saves only its inputs (gate and up, or gate_up: the tensors themselves, no copy)
and its backward is the matching ``*_bwd`` op, which recomputes act(gate). The op names
(``torch.ops.surgery.gated_activation_{fwd,bwd}``, ``..._merged_{fwd,bwd}``) are stable.
"""

from __future__ import annotations

import torch

from ..dispatch import op_traced
from .launch import (
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_merged_bwd,
    gated_activation_merged_fwd,
)

__all__ = ["GatedActivationFunction"]


# ---------------------------------------------------------------------------------------------
# Split layout: a model using them traces with fullgraph=True.


@torch.library.triton_op("surgery::gated_activation_fwd", mutates_args=())
def _gated_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_fwd(gate, up, activation, traced=op_traced())


@torch.library.triton_op("surgery::gated_activation_bwd", mutates_args=())
def _gated_bwd_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_activation_bwd(dout, gate, up, activation, traced=op_traced())


def _save_fwd(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _fwd_op_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    dg, du = _gated_bwd_op(dout.contiguous(), gate, up, ctx.activation)
    return dg, du, None


_gated_fwd_op.register_autograd(_fwd_op_backward, setup_context=_save_fwd)


class GatedActivationFunction(torch.autograd.Function):
    """Eager autograd over the launchers, the same map as the op above (lower host overhead in
    eager mode; the op carries the autograd torch.compile sees)."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return gated_activation_fwd(gate, up, activation)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = gated_activation_bwd(dout.contiguous(), gate, up, ctx.activation)
        return dg, du, None


# ---------------------------------------------------------------------------------------------
# Merged layout: this op alone carries its autograd (one path, eager and compiled alike).


@torch.library.triton_op("surgery::gated_activation_merged_fwd", mutates_args=())
def _merged_fwd_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_merged_fwd(gate_up, activation, traced=op_traced())


@torch.library.triton_op("surgery::gated_activation_merged_bwd", mutates_args=())
def _merged_bwd_op(dout: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_merged_bwd(dout, gate_up, activation, traced=op_traced())


def _save_merged(ctx, inputs, output):
    gate_up, activation = inputs
    ctx.save_for_backward(gate_up)
    ctx.activation = activation


def _merged_op_backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return _merged_bwd_op(dout.contiguous(), gate_up, ctx.activation), None


_merged_fwd_op.register_autograd(_merged_op_backward, setup_context=_save_merged)
