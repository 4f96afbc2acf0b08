"""The gated activation in plain PyTorch: the reference ``gated_activation`` (and
``gated_activation_merged``, on the two halves) is tested against."""

from __future__ import annotations

import torch

__all__ = ["gated_activation_reference"]


def gated_activation_reference(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    """Reference for ``gated_activation``: ``act(gate) * up`` in fp32 (fp64 for fp64 inputs),
    differentiable, cast back to the inputs' promoted dtype."""
    ct = torch.promote_types(torch.promote_types(gate.dtype, up.dtype), torch.float32)
    g = gate.to(ct)
    if activation == "silu":
        a = g * torch.sigmoid(g)
    else:
        t = (2.0 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
        a = 0.5 * g * (1.0 + torch.tanh(t))
    return (a * up.to(ct)).to(torch.promote_types(gate.dtype, up.dtype))
