"""The public gated activations: ``gated_activation`` (gate and up as two tensors) and
``gated_activation_merged`` (one merged (..., 2 I) tensor holding gate then up). Everything is
checked here, before anything launches."""

from __future__ import annotations

import torch

from ..dispatch import call_kernel
from .launch import ACTIVATIONS, gated_activation_fwd, gated_activation_merged_fwd
from .ops import (
    GatedActivationFunction,
    GatedActivationMergedFunction,
    _gated_fwd_op,
    _merged_fwd_op,
)

__all__ = ["gated_activation", "gated_activation_merged"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_activation(what: str, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{what}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}"
        )


def _check_float(what: str, names: str, *tensors: torch.Tensor) -> None:
    if any(t.dtype not in _FLOAT_DTYPES for t in tensors):
        got = " and ".join(str(t.dtype) for t in tensors)
        raise TypeError(f"{what}: {names} must be float32, bfloat16 or float16; got {got}")


def check_gate_and_up(what: str, gate, up, activation: str) -> None:
    """Raise unless gate and up are float tensors of one shape and device and ``activation`` has
    a kernel."""
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError(f"{what}: gate and up must be tensors, got {type(gate)}")
    _check_activation(what, activation)
    _check_float(what, "gate and up", gate, up)
    if gate.shape != up.shape:
        raise ValueError(
            f"{what}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape"
        )
    if gate.device != up.device:
        raise ValueError(f"{what}: gate is on {gate.device} but up is on {up.device}")


def gated_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    """``act(gate) * up``, the activation of a gated MLP (``down_proj(act(gate_proj(x)) *
    up_proj(x))``), fused: one read of each input and one write forward, the activation recomputed
    in the backward.

    Args:
        gate: (..., I) output of the gate projection; float32, bfloat16 or float16.
        up: the up projection's output, gate's shape and device. If the dtypes differ, both are
            cast to the promoted dtype (as ``act(gate) * up`` would promote).
        activation: ``"silu"`` (SwiGLU: Llama, Mistral, Qwen) or ``"gelu_tanh"`` (GeGLU with
            torch's ``gelu(approximate="tanh")``, transformers' ``gelu_pytorch_tanh``: Gemma).

    Returns:
        A new contiguous tensor of gate's shape and dtype, computed in fp32 and rounded once.
        Inputs are never written.

    Differentiable in gate and up (once: a double backward raises); the forward saves only gate
    and up. Under ``torch.compile(fullgraph=True)`` it is the op
    ``torch.ops.surgery.gated_activation_fwd`` with its registered autograd; an eager call that
    autograd records runs the same setup and backward as ``GatedActivationFunction`` over the
    launchers; one with nothing to differentiate (grad mode off, or neither gate nor up requiring
    grad) the launcher ``gated_activation_fwd`` alone. CUDA tensors (and CPU tensors under
    ``TRITON_INTERPRET=1``) run the Triton kernels, other CPU tensors a PyTorch path with the same
    fp32 math.

    Autocast (the rule of every kernel here: inputs are cast on entry where the unpatched module's
    ops would cast them, and nothing after that depends on autocast): ``act(gate) * up`` is
    elementwise, which autocast leaves alone, so nothing is cast and the output has the promoted
    dtype of gate and up, as transformers' ``act_fn(gate) * up`` under autocast (in an fp32 model
    the autocast projections hand over gate and up in the autocast dtype, and the product keeps
    it). No op inside depends on autocast: the result is that of the call without it, bit for bit.
    """
    check_gate_and_up("gated_activation", gate, up, activation)
    if gate.dtype != up.dtype:
        dtype = torch.promote_types(gate.dtype, up.dtype)
        gate, up = gate.to(dtype), up.to(dtype)
    gate, up = gate.contiguous(), up.contiguous()
    functions = (_gated_fwd_op, GatedActivationFunction, gated_activation_fwd)
    return call_kernel(*functions, (gate, up, activation), gate, up)


def gated_activation_merged(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` with gate and up the two halves of one merged tensor, as a merged gate/up
    projection (transformers' experts' ``gate_up_proj``, ``gate, up = gate_up.chunk(2, -1)``)
    produces them: fused, neither half copied.

    Args:
        gate_up: (..., 2 I), gate in ``[..., :I]`` and up in ``[..., I:]``; float32, bfloat16 or
            float16. Made contiguous if it is not (a matrix product's output already is).
        activation: ``"silu"`` or ``"gelu_tanh"``, as in ``gated_activation``.

    Returns:
        A new contiguous (..., I) tensor of gate_up's dtype, computed in fp32 and rounded once:
        ``gated_activation(*gate_up.chunk(2, -1), activation)``, bit for bit on the Triton path
        (the PyTorch path's vectorised fp32 ops may differ by an ulp on the strided halves).

    Differentiable in gate_up; the forward saves gate_up alone (the tensor itself, no copy), the
    backward recomputes act(gate) and writes dgate and dup into one (..., 2 I) tensor. Runs as
    ``torch.ops.surgery.gated_activation_merged_fwd`` under ``torch.compile``, and eagerly as
    ``GatedActivationMergedFunction`` (the same autograd) or the launcher, as ``gated_activation``;
    dispatch (Triton on CUDA and under ``TRITON_INTERPRET=1``, else a PyTorch path) and autocast as
    ``gated_activation``: elementwise, nothing is cast.
    """
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"gated_activation_merged: gate_up must be a tensor, got {type(gate_up)}")
    _check_activation("gated_activation_merged", activation)
    _check_float("gated_activation_merged", "gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"gated_activation_merged: gate_up {tuple(gate_up.shape)} must have an even last "
            "dimension (gate then up)"
        )
    gate_up = gate_up.contiguous()
    functions = (_merged_fwd_op, GatedActivationMergedFunction, gated_activation_merged_fwd)
    return call_kernel(*functions, (gate_up, activation), gate_up)
