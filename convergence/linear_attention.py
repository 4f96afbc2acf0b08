"""transformers' linear-attention kernel bindings, as the suite sees them: which of a hybrid
model's Gated DeltaNet functions transformers bound to an installed package's kernel
(flash-linear-attention, causal-conv1d), and a forward that runs transformers' PyTorch functions
instead for the length of each call.

Two sides need the PyTorch path: the fp64 yardstick (those kernels have no fp64 code) and, in a
bf16 run whose fp32 partner runs the package's TF32 kernels, ``PYTORCH_PARTNER``, which measures
how far the partner itself is from fp32. Nothing here changes a module for longer than one call.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

__all__ = [
    "LINEAR_ATTENTION_KERNELS",
    "PYTORCH_PARTNER",
    "binds_linear_attention_kernels",
    "pytorch_linear_attention",
]

LINEAR_ATTENTION_KERNELS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
"""The functions of transformers' hybrid modeling modules that it binds, once, to an installed
package's kernel (flash-linear-attention, causal-conv1d) in place of its PyTorch code."""


PYTORCH_PARTNER = "fp32-reference-pytorch"
"""The probes' partner (a bf16 run's fp32 yardstick) on transformers' PyTorch Gated DeltaNet, where
the partner runs a package's kernels (``binds_linear_attention_kernels``): not trained, given the
partner's weights at every step; the pair ``<partner>~fp32-reference-pytorch`` is the partner's
own kernel error, which widens the probes' limits (``compare.evaluate``)."""


def _pytorch_functions(module) -> dict[str, Callable]:
    """The PyTorch function behind each of ``module``'s ``LINEAR_ATTENTION_KERNELS`` (the
    function itself where transformers bound no package's kernel to it)."""
    return {
        name: inspect.unwrap(fn)
        for name in LINEAR_ATTENTION_KERNELS
        if (fn := getattr(module, name, None)) is not None
    }


def binds_linear_attention_kernels(model) -> bool:
    """Whether ``model``'s modeling module runs a package's kernel (flash-linear-attention,
    causal-conv1d) for any of its ``LINEAR_ATTENTION_KERNELS`` instead of transformers' PyTorch
    function (which transformers' binding wraps)."""
    module = sys.modules[type(model).__module__]
    return any(getattr(module, name) is not fn for name, fn in _pytorch_functions(module).items())


def pytorch_linear_attention(forward: Callable) -> Callable:
    """``forward`` with transformers' PyTorch Gated DeltaNet for the length of each call: in the
    modeling module of ``forward``'s model, the ``LINEAR_ATTENTION_KERNELS`` bound to a package
    are swapped for the PyTorch functions they wrap, and put back after (the backward runs the
    ops recorded). For the fp64 yardstick: those kernels have no fp64 code."""
    module = sys.modules[type(forward.__self__).__module__]
    swaps = _pytorch_functions(module)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        bound = {name: getattr(module, name) for name in swaps}
        try:
            for name, fn in swaps.items():
                setattr(module, name, fn)
            return forward(*args, **kwargs)
        finally:
            for name, fn in bound.items():
                setattr(module, name, fn)

    return run
