"""Where a kernel runs: Triton on CUDA tensors, Triton's interpreter on CPU tensors when
``TRITON_INTERPRET=1`` is set, and otherwise a plain PyTorch fallback.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Literal

import torch

__all__ = [
    "call_kernel",
    "cdiv",
    "eager_function",
    "interpreter_enabled",
    "kernel_path",
    "next_power_of_2",
    "off_current_device",
    "on_device",
    "triton_available",
    "use_triton",
]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors (must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel launched on ``t`` goes through Triton (GPU or interpreter)."""
    if not triton_available():
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreter_enabled()


_SAME_DEVICE = contextlib.nullcontext()


def off_current_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor on another device than the current one. Triton launches on
    the current device, and a tensor may live on another: a device map puts layers on several
    GPUs, a model may sit on ``cuda:1`` while ``cuda:0`` is current."""
    return t.is_cuda and t.get_device() != torch.cuda.current_device()


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device the current one for a Triton launch (a no-op context when it is
    already, see ``off_current_device``)."""
    return torch.cuda.device(t.device) if off_current_device(t) else _SAME_DEVICE


def kernel_path(*tensors: torch.Tensor) -> Literal["op", "function", "launcher"]:
    """How a public kernel function on ``tensors`` runs. ``"op"`` under torch.compile: the graph
    holds the torch.library op and its registered autograd. ``"function"`` when autograd records an
    eager call (grad mode on and an input requiring grad): the kernel's eager
    ``autograd.Function`` (``eager_function``), the same setup and backward over the launchers,
    without the op's Python dispatch, which costs more host time than the launches themselves
    (benchmarks/eager_overhead.py). ``"launcher"`` otherwise: nothing is differentiated and the
    host launcher alone computes the same values."""
    if torch.compiler.is_compiling():
        return "op"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "function"
    return "launcher"


def call_kernel(op, function, launcher, inputs: tuple, *differentiable: torch.Tensor):
    """``op(*inputs)``, ``function.apply(*inputs)`` or ``launcher(*inputs)``: the path
    ``kernel_path(*differentiable)`` names, for a kernel whose op, eager Function and launcher take
    the same inputs."""
    path = kernel_path(*differentiable)
    if path == "op":
        return op(*inputs)
    if path == "function":
        return function.apply(*inputs)
    return launcher(*inputs)


def eager_function(
    name: str, launcher: Callable, setup_context: Callable, backward: Callable
) -> type[torch.autograd.Function]:
    """The eager form of an op's registered autograd: an ``autograd.Function`` whose forward runs
    ``launcher(*inputs)`` and then ``setup_context(ctx, inputs, output)``, and whose backward is
    ``backward`` itself. The op registers the same ``setup_context`` and a ``backward`` built by
    the same code (its calls on the op rather than on the launcher), so each kernel's autograd
    formula is written once and serves compiled and eager calls alike.

    The forward takes its inputs positionally and in full, as the op's schema lists them (the
    ctx-style ``forward`` binds nothing by signature: a ``setup_context``-style Function's
    ``apply`` does, on every call, at a cost close to the op's)."""

    def forward(ctx, *inputs):
        output = launcher(*inputs)
        setup_context(ctx, inputs, output)
        return output

    attrs = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), attrs)


# Launch arithmetic in plain Python: ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr
# functions in recent Triton and cost several microseconds per host call, which adds up in
# launchers that run every layer of every step.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
