"""``gated_linear``: a gated MLP's product and its down projection, ``F.linear(act(gate) * up, W)``,
as one autograd step whose backward rebuilds the product inside the activation's backward kernel.

Unfused, the product h = act(gate) * up (tokens x intermediate) is either kept for the down
projection's weight gradient dW = dy^T h, or rebuilt before the backward (one more kernel: a read
of gate and up and a write of h). Here the forward keeps gate, up and W, and the backward runs

    dh = dy W                       (the GEMM the down projection's backward runs anyway)
    dgate, dup, h = act backward    (one kernel: reads dh, gate, up; writes dgate, dup and h)
    dW = dy^T h                     (the weight gradient's GEMM, on the same h)

so h is never kept and its rebuild costs one write instead of a kernel of its own. The values are
those of ``F.linear(gated_activation(gate, up), W)``: the same kernels and matrix products on the
same operands (h bit for bit the forward's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..saved_first import OutputNode, checked_output, stand_in
from .api import check_gate_and_up, gated_activation
from .launch import gated_activation_bwd
from .ops import _gated_fwd_op

__all__ = ["GatedLinearFunction", "gated_linear", "gated_linear_fuses"]


@torch.library.custom_op("surgery::gated_activation_bwd_with_output", mutates_args=())
def _bwd_with_output_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dup, act(gate) * up): ``gated_activation_bwd`` that also writes the forward's
    output."""
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    dg, du = gated_activation_bwd(dout, gate, up, activation, forward_out=out)
    return dg, du, out


@_bwd_with_output_op.register_fake
def _(dout, gate, up, activation):
    like = torch.contiguous_format
    return (
        torch.empty_like(gate, memory_format=like),
        torch.empty_like(up, memory_format=like),
        torch.empty_like(gate, memory_format=like),
    )


class GatedLinearFunction(torch.autograd.Function):
    """The node of ``F.linear(act(gate) * up, weight)`` (the module docstring gives the backward):
    gate and up contiguous of one shape and dtype, weight (out, I) of that dtype. Its forward saves
    them and returns a stand-in for the output, which ``_GatedLinearOutput`` computes, so that a
    checkpointed layer's recomputation stops before the product (``saved_first``)."""

    @staticmethod
    def forward(ctx, gate, up, weight, activation: str):
        ctx.save_for_backward(gate, up, weight)
        ctx.activation = activation
        return stand_in((*gate.shape[:-1], weight.shape[0]), weight.dtype, weight.device)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        needs_gate_or_up = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dy = grad.reshape(-1, grad.shape[-1])
        width = gate.shape[-1]
        dgate = dup = dweight = None
        if needs_gate_or_up or ctx.needs_input_grad[2]:
            dh = dy.mm(weight).view(gate.shape)
            dgate, dup, product = _bwd_with_output_op(dh, gate, up, ctx.activation)
            if ctx.needs_input_grad[2]:
                dweight = dy.t().mm(product.view(-1, width))
        return dgate, dup, dweight, None


class _GatedLinearOutput(OutputNode):
    """``F.linear(act(gate) * up, weight)`` for ``GatedLinearFunction``'s stand-in."""

    @staticmethod
    def forward(ctx, standing_in, gate, up, weight, activation: str):
        out = F.linear(_gated_fwd_op(gate, up, activation), weight)
        return checked_output(out, standing_in)


def gated_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    """``F.linear(gated_activation(gate, up, activation), weight)``: a gated MLP's down projection
    (without bias) of its product, whose backward rebuilds the product in the activation's
    backward kernel instead of keeping it (the module docstring).

    Args:
        gate, up: (..., I), as ``gated_activation`` takes them.
        weight: (out, I), the down projection's weight.
        activation: as in ``gated_activation``.

    Returns:
        (..., out), the values of the unfused expression bit for bit, forward and backward. The
        forward keeps gate, up and weight only. Where the fused step does not apply (gate and up
        or the weight in different dtypes, or autocast on, which would cast the product), the
        unfused expression itself runs, keeping the product.
    """
    check_gate_and_up("gated_linear", gate, up, activation)
    if not gated_linear_fuses(gate, up, weight):
        return F.linear(gated_activation(gate, up, activation), weight)
    gate, up = gate.contiguous(), up.contiguous()
    standing_in = GatedLinearFunction.apply(gate, up, weight, activation)
    return _GatedLinearOutput.apply(standing_in, gate, up, weight, activation)


def gated_linear_fuses(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gated_linear(gate, up, weight)`` runs fused (else it runs the unfused expression,
    which keeps the product): gate, up and a 2-D weight of one dtype and device, autocast off."""
    return (
        weight.dim() == 2
        and gate.dtype == up.dtype == weight.dtype
        and weight.shape[1] == gate.shape[-1]
        and weight.device == gate.device
        and not torch.is_autocast_enabled(gate.device.type)
    )
