"""Autograd of the gated activation: torch.library ops over the launchers, and each layout's one
autograd formula (a setup and a backward, written once) used two ways (``kernels.dispatch``):
registered on the forward op, which torch.compile graphs hold, and as the eager
``autograd.Function`` over the launchers (``GatedActivationFunction``,
``GatedActivationMergedFunction``), whose backward calls the backward launcher instead of the op.

Each forward op saves only its inputs (gate and up, or gate_up: the tensors themselves, no copy)
and its backward is the matching ``*_bwd`` op, which recomputes act(gate). The op names
(``torch.ops.surgery.gated_activation_{fwd,bwd}``, ``..._merged_{fwd,bwd}``) are stable.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..dispatch import eager_function
from .launch import (
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_merged_bwd,
    gated_activation_merged_fwd,
)

__all__ = ["GatedActivationFunction", "GatedActivationMergedFunction"]


# ---------------------------------------------------------------------------------------------
# Split layout: opaque to torch.compile, so a model using them traces with fullgraph=True.


@torch.library.custom_op("surgery::gated_activation_fwd", mutates_args=())
def _gated_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_fwd(gate, up, activation)


@_gated_fwd_op.register_fake
def _(gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("surgery::gated_activation_bwd", mutates_args=())
def _gated_bwd_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_activation_bwd(dout, gate, up, activation)


@_gated_bwd_op.register_fake
def _(dout, gate, up, activation):
    like = torch.contiguous_format
    return torch.empty_like(gate, memory_format=like), torch.empty_like(up, memory_format=like)


def _save_fwd(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _backward(bwd):
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = bwd(dout.contiguous(), gate, up, ctx.activation)
        return dg, du, None

    return backward


_gated_fwd_op.register_autograd(_backward(_gated_bwd_op), setup_context=_save_fwd)
GatedActivationFunction = eager_function(
    "GatedActivationFunction",
    gated_activation_fwd,
    _save_fwd,
    once_differentiable(_backward(gated_activation_bwd)),
)


# ---------------------------------------------------------------------------------------------
# Merged layout.


@torch.library.custom_op("surgery::gated_activation_merged_fwd", mutates_args=())
def _merged_fwd_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_merged_fwd(gate_up, activation)


@_merged_fwd_op.register_fake
def _(gate_up, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("surgery::gated_activation_merged_bwd", mutates_args=())
def _merged_bwd_op(dout: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_merged_bwd(dout, gate_up, activation)


@_merged_bwd_op.register_fake
def _(dout, gate_up, activation):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _save_merged(ctx, inputs, output):
    gate_up, activation = inputs
    ctx.save_for_backward(gate_up)
    ctx.activation = activation


def _merged_backward(bwd):
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        return bwd(dout.contiguous(), gate_up, ctx.activation), None

    return backward


_merged_fwd_op.register_autograd(_merged_backward(_merged_bwd_op), setup_context=_save_merged)
GatedActivationMergedFunction = eager_function(
    "GatedActivationMergedFunction",
    gated_activation_merged_fwd,
    _save_merged,
    once_differentiable(_merged_backward(gated_activation_merged_bwd)),
)
