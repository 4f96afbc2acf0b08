"""flash-linear-attention (fla) for the linear-attention layers of hybrid models.

fla is an optional dependency (``pip install "transformers-surgery[hybrid]"``). Where it imports
and a layer's input is on CUDA, ``linear_attention_kernels`` gives ``surgery.attention.linear``
the three fla entry points it runs a Gated DeltaNet layer with, each taking the documents of the
batch as ``cu_seqlens`` (offsets over one row of tokens, the varlen convention of flash
attention), so that nothing flows from one document into the next:

- ``causal_conv1d`` (``fla.modules.causal_conv1d``): the short causal convolution and its
  activation, its window restarting at each document;
- ``chunk_gated_delta_rule`` (``fla.ops.gated_delta_rule``): the gated delta-rule recurrence,
  its state restarting at each document, queries and keys L2-normalised in the kernel;
- ``rms_norm_gated`` (``fla.modules.norm.fused_norm_gate``): the gated RMSNorm after it
  (``norm(x) * weight * silu(gate)``) in one kernel, computed in fp32 and rounded once where
  transformers rounds twice in 16-bit dtypes (``tests/surgery/test_linear_attention_fla.py``
  measures both against fp32).

surgery writes no delta-rule kernel of its own. Checked on fla 0.6 (``CHECKED``): the arguments
used here are named by ``REQUIRED``, and a release whose entry points lack one of them is not
used (a warning, once; the layers then run as without fla). A release outside ``CHECKED`` is used
with a warning, once.

Installing fla also changes transformers: its Gated DeltaNet layers pick fla's
``chunk_gated_delta_rule`` by themselves (on every device, CPU included, where fla's kernels do
not run), so an unpatched model's packed rows leak less but not nothing (``README.md``, Hybrid
models). On Hopper with triton older than 3.7.1 fla's backward needs TileLang installed beside it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "CHECKED",
    "EXTRA",
    "REQUIRED",
    "LinearAttentionKernels",
    "fla_status",
    "linear_attention_kernels",
]

CHECKED = ("0.6",)
"""fla releases (major.minor) whose kernels were checked against transformers' PyTorch path on
the GPU (``tests/surgery/test_linear_attention_fla.py``, the GPU tests)."""

EXTRA = 'pip install "transformers-surgery[hybrid]"'
"""How a user installs fla beside surgery."""

REQUIRED = {
    "causal_conv1d": ("x", "weight", "bias", "activation", "cu_seqlens", "cu_seqlens_cpu"),
    "chunk_gated_delta_rule": (
        "q",
        "k",
        "v",
        "g",
        "beta",
        "use_qk_l2norm_in_kernel",
        "cu_seqlens",
        "cu_seqlens_cpu",
    ),
    "rms_norm_gated": ("x", "g", "weight", "bias", "activation", "eps"),
}
"""The arguments surgery passes to each fla entry point, by name."""


@dataclass(frozen=True)
class LinearAttentionKernels:
    """The kernels a Gated DeltaNet layer runs with, each with fla's signature (``REQUIRED``):
    every tensor (batch, tokens, ...) with batch 1 when ``cu_seqlens`` is given."""

    conv: Callable
    """``causal_conv1d(x (b, t, d), weight (d, w), bias, activation=, cu_seqlens=,
    cu_seqlens_cpu=) -> (y, final_state)``"""
    delta_rule: Callable
    """``chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=, cu_seqlens=,
    cu_seqlens_cpu=) -> (o, final_state)``: q, k (b, t, h, dk), v (b, t, hv, dv), g and beta
    (b, t, hv)"""
    gated_norm: Callable
    """``rms_norm_gated(x (n, dv), g (n, dv), weight, bias, activation=, eps=) -> (n, dv)``"""
    name: str
    """What ``surgery.describe`` names them by (``flash-linear-attention 0.6.0``)."""


def _version() -> str | None:
    for distribution in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


@functools.cache
def _fla() -> LinearAttentionKernels | str:
    """fla's kernels, or why they are not used. Imported once, on the first CUDA layer."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # not installed, or broken on this machine
        if importlib.util.find_spec("fla") is None:
            return f"flash-linear-attention is not installed ({EXTRA})"
        return f"flash-linear-attention does not import: {type(e).__name__}: {e}"
    version = _version() or "unknown version"
    entry = {
        "causal_conv1d": causal_conv1d,
        "chunk_gated_delta_rule": chunk_gated_delta_rule,
        "rms_norm_gated": rms_norm_gated,
    }
    for name, arguments in REQUIRED.items():
        missing = set(arguments) - set(inspect.signature(entry[name]).parameters)
        if missing:
            reason = (
                f"flash-linear-attention {version}: {name} takes no {sorted(missing)}; surgery "
                f"was checked on {', '.join(CHECKED)}"
            )
            warnings.warn(
                f"surgery: {reason}; the linear-attention layers run without it", stacklevel=2
            )
            return reason
    if not version.startswith(tuple(f"{c}." for c in CHECKED)):
        warnings.warn(
            f"surgery: flash-linear-attention {version} was not checked (checked: "
            f"{', '.join(CHECKED)}); its kernels are used",
            stacklevel=2,
        )
    return LinearAttentionKernels(
        conv=causal_conv1d,
        delta_rule=chunk_gated_delta_rule,
        gated_norm=rms_norm_gated,
        name=f"flash-linear-attention {version}",
    )


def linear_attention_kernels(device: torch.device) -> LinearAttentionKernels | None:
    """fla's kernels for a layer whose input is on ``device``: None off CUDA, or where fla is
    not installed or not usable (``fla_status`` says why)."""
    if device.type != "cuda":
        return None
    kernels = _fla()
    return kernels if isinstance(kernels, LinearAttentionKernels) else None


def fla_status(device: torch.device) -> str:
    """What runs a hybrid model's linear-attention layers on ``device``, in words, for
    ``surgery.describe``: fla's kernels, or why not and what would make them fast."""
    if device.type != "cuda":
        installed = importlib.util.find_spec("fla") is not None
        return (
            f"flash-linear-attention's kernels on CUDA (installed; this model is on {device.type})"
            if installed
            else f"on CUDA, {EXTRA} would run them with flash-linear-attention's kernels"
        )
    kernels = _fla()
    if isinstance(kernels, LinearAttentionKernels):
        return kernels.name
    return f"{kernels}; installing it makes these layers fast"
