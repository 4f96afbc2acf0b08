"""Where a kernel runs: Triton on CUDA tensors, Triton's interpreter on CPU tensors when
``TRITON_INTERPRET=1`` is set, and otherwise a plain PyTorch fallback.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = [
    "cdiv",
    "interpreter_enabled",
    "next_power_of_2",
    "off_current_device",
    "on_device",
    "runs_as_op",
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


def runs_as_op(*tensors: torch.Tensor) -> bool:
    """Whether a public kernel function on ``tensors`` calls its torch.library op, whose registered
    autograd is the kernel's one backward, rather than the host launcher the op wraps: under
    torch.compile (the graph holds the op) and whenever autograd records the call (grad mode on
    and an input requiring grad). Otherwise nothing is differentiated and the launcher alone
    computes the same values, without the op's Python dispatch."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# Launch arithmetic in plain Python: ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr
# functions in recent Triton and cost several microseconds per host call, which adds up in
# launchers that run every layer of every step.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
