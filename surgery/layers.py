"""The generic RMSNorm and gated-MLP forwards: one each for every architecture, its differences read
from the spec (the norm's style, the MLP's activation).

The MLP forward calls its projections as modules and never reads their weights, so adapters on
them (PEFT LoRA), hooks and FSDP2's unsharding all run as in the original forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from surgery.kernels import gated_activation, rms_norm
from surgery.models import RMSNormStyle

__all__ = [
    "MLP_ATTR",
    "NORM_ATTR",
    "gated_mlp_forward",
    "rms_norm_forward",
    "rms_norm_forward_for",
    "rms_norm_forward_x",
]

NORM_ATTR = "_surgery_rms_norm"
"""Instance attribute of a patched norm: its ``RMSNormStyle``."""
MLP_ATTR = "_surgery_gated_mlp"
"""Instance attribute of a patched MLP: the ``gated_activation`` name of its activation."""


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    style: RMSNormStyle = module.__dict__[NORM_ATTR]
    eps = getattr(module, style.eps_attr)
    return rms_norm(x, module.weight, eps, style.offset, style.casting)  # type: ignore[arg-type]


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``forward(hidden_states)`` of Llama, Mistral and Qwen2/3's RMSNorm, through ``rms_norm``."""
    return _rms_norm(self, hidden_states)


def rms_norm_forward_x(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``forward(x)`` of Gemma 1/2/3's RMSNorm: the same, under the argument name Gemma uses."""
    return _rms_norm(self, x)


def rms_norm_forward_for(module: nn.Module) -> Callable:
    """The norm forward whose argument is named like the one of ``module``'s current forward (the
    patch checks that the names match, so a caller passing it by keyword still works)."""
    current = module.__dict__.get("forward") or type(module).forward
    params = list(inspect.signature(current).parameters)
    if not inspect.ismethod(current):
        params = params[1:]
    return rms_norm_forward_x if params[:1] == ["x"] else rms_norm_forward


def gated_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the product through ``gated_activation``:
    act(gate) is neither materialised for backward nor rounded on its own."""
    activation = self.__dict__[MLP_ATTR]
    return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), activation))
