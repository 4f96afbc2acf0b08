"""Host launchers of the gated activation (``gated_activation_fwd``, ``gated_activation_bwd``,
``gated_activation_merged_fwd``, ``gated_activation_merged_bwd``), their launch configuration,
and the PyTorch path CPU tensors take when the Triton interpreter is off.

Launchers take inputs as validated by ``gated_activation`` / ``gated_activation_merged`` (no
checks here): split inputs are contiguous tensors of one shape and dtype; a merged ``gate_up`` is
a contiguous (rows, 2 width) tensor, gate in its first ``width`` columns and up in the others,
with ``out`` and ``dout`` contiguous (rows, width). Outputs are new contiguous tensors unless
``out`` names others. Empty inputs launch nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..dispatch import cdiv, interpreter_enabled, next_power_of_2, use_triton
from ..launch import launch as launch_kernel
from .kernel import (
    gated_activation_bwd_kernel,
    gated_activation_fwd_kernel,
    gated_activation_merged_bwd_kernel,
    gated_activation_merged_fwd_kernel,
)

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_LAUNCH",
    "FALLBACK_ELEMS",
    "INTERPRETER_LAUNCH",
    "GatedActivationLaunch",
    "gated_activation_bwd",
    "gated_activation_fwd",
    "gated_activation_merged_bwd",
    "gated_activation_merged_fwd",
]

# Kernel code of each activation (a constexpr in the kernels).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# Elements the PyTorch fallback upcasts to fp32 at once.
FALLBACK_ELEMS = 1 << 22


@dataclass(frozen=True)
class GatedActivationLaunch:
    """Launch configuration: ``block`` elements per program, ``num_warps`` warps.
    Default: 16 elements per thread and tensor, two 128-bit accesses of bf16 each."""

    block: int = 2048
    num_warps: int = 4


DEFAULT_LAUNCH = GatedActivationLaunch()
# The interpreter pays per program, not per element: few large programs.
INTERPRETER_LAUNCH = GatedActivationLaunch(block=1 << 16)


# ---------------------------------------------------------------------------------------------
# PyTorch path: the same fp32 math, a chunk of about FALLBACK_ELEMS elements at a time along the
# first dimension of the views it is given (flat for the split layout, rows for the merged one).


def _act_torch(g: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _act_backward_torch(grad: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    # The ops autograd runs for F.silu / F.gelu, called directly: inside a torch.library op (what
    # torch.compile runs) the autograd keys are excluded, so torch.autograd.grad would find no
    # graph to differentiate.
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    return torch.ops.aten.gelu_backward(grad, g, approximate="tanh")


def _fwd_chunks(g, u, o, step, activation):
    for i in range(0, o.shape[0], step):
        sl = slice(i, i + step)
        o[sl] = (_act_torch(g[sl].float(), activation) * u[sl].float()).to(o.dtype)


def _bwd_chunks(d, g, u, dg, du, step, activation, o=None):
    for i in range(0, d.shape[0], step):
        sl = slice(i, i + step)
        gf, df = g[sl].float(), d[sl].float()
        dg[sl] = _act_backward_torch(df * u[sl].float(), gf, activation).to(dg.dtype)
        du[sl] = (df * _act_torch(gf, activation)).to(du.dtype)
        if o is not None:
            o[sl] = (_act_torch(gf, activation) * u[sl].float()).to(o.dtype)


def _fwd_torch(gate, up, out, activation):
    _fwd_chunks(gate.view(-1), up.view(-1), out.view(-1), FALLBACK_ELEMS, activation)


def _bwd_torch(dout, gate, up, dg, du, activation, out=None):
    flat = (dout.reshape(-1), gate.view(-1), up.view(-1), dg.view(-1), du.view(-1))
    o = None if out is None else out.view(-1)
    _bwd_chunks(*flat, FALLBACK_ELEMS, activation, o)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = gate_up.shape[-1] // 2
    return gate_up[..., :width], gate_up[..., width:]


def _row_step(width: int) -> int:
    return max(1, FALLBACK_ELEMS // max(1, width))


def _merged_fwd_torch(gate_up, out, activation):
    g, u = _halves(gate_up.view(-1, gate_up.shape[-1]))
    o = out.view(-1, out.shape[-1])
    _fwd_chunks(g, u, o, _row_step(o.shape[1]), activation)


def _merged_bwd_torch(dout, gate_up, dgate_up, activation):
    g, u = _halves(gate_up.view(-1, gate_up.shape[-1]))
    dg, du = _halves(dgate_up.view(-1, dgate_up.shape[-1]))
    d = dout.reshape(-1, dout.shape[-1])
    _bwd_chunks(d, g, u, dg, du, _row_step(d.shape[1]), activation)


# ---------------------------------------------------------------------------------------------
# Triton launches: one helper per layout, shared by its forward and backward kernel.


def _launch_config(launch, t):
    return launch or (DEFAULT_LAUNCH if t.is_cuda else INTERPRETER_LAUNCH)


def _launch_flat(kernel, args, numel, activation, launch, device_of, **constexprs):
    # ``kernel(*args, numel, BLOCK, ...)`` over ``numel`` flat elements, on ``device_of``'s GPU.
    launch = _launch_config(launch, device_of)
    block = min(launch.block, next_power_of_2(numel))
    launch_kernel(
        kernel,
        (cdiv(numel, block),),
        *args,
        numel,
        BLOCK=block,
        ACTIVATION=ACTIVATIONS[activation],
        INTERPRETED=interpreter_enabled(),
        num_warps=launch.num_warps,
        **constexprs,
    )


def _merged_tiles(launch: GatedActivationLaunch, rows: int, width: int) -> tuple[int, int]:
    # (BLOCK_M, BLOCK_N): about ``launch.block`` elements per program, a row split into column
    # tiles of at most block / 8 (256 on a GPU: an expert width of 768 is three whole tiles).
    block_n = min(next_power_of_2(width), max(16, launch.block // 8))
    block_m = min(max(1, launch.block // block_n), next_power_of_2(rows))
    return block_m, block_n


def _launch_merged(kernel, args, rows, width, activation, launch, device_of):
    # ``kernel(*args, rows, width, BLOCK_M, BLOCK_N, ...)`` over the (rows, width) output tiles.
    launch = _launch_config(launch, device_of)
    block_m, block_n = _merged_tiles(launch, rows, width)
    launch_kernel(
        kernel,
        (cdiv(rows, block_m), cdiv(width, block_n)),
        *args,
        rows,
        width,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ACTIVATION=ACTIVATIONS[activation],
        INTERPRETED=interpreter_enabled(),
        num_warps=launch.num_warps,
    )


# ---------------------------------------------------------------------------------------------
# Launchers.


def gated_activation_fwd(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    launch: GatedActivationLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(gate) * up`` for contiguous ``gate`` and ``up`` of one shape and dtype (as validated
    by ``gated_activation``; no checks here), into ``out`` (contiguous) when given."""
    if out is None:
        out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    numel = gate.numel()
    if numel == 0:
        return out
    if not use_triton(gate):
        _fwd_torch(gate, up, out, activation)
        return out
    _launch_flat(gated_activation_fwd_kernel, (gate, up, out), numel, activation, launch, gate)
    return out


def gated_activation_bwd(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    launch: GatedActivationLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    forward_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` given the output gradient (contiguous, gate's shape): new contiguous
    tensors, or the pair ``out`` when given. ``forward_out`` (contiguous, gate's shape): written
    with the forward's output ``act(gate) * up`` too, bit for bit ``gated_activation_fwd``'s."""
    if out is not None:
        dg, du = out
    else:
        dg = torch.empty_like(gate, memory_format=torch.contiguous_format)
        du = torch.empty_like(up, memory_format=torch.contiguous_format)
    numel = gate.numel()
    if numel == 0:
        return dg, du
    if not use_triton(gate):
        _bwd_torch(dout, gate, up, dg, du, activation, forward_out)
        return dg, du
    store = forward_out is not None
    args = (dout, gate, up, dg, du, forward_out if store else dg)
    kernel = gated_activation_bwd_kernel
    _launch_flat(kernel, args, numel, activation, launch, gate, STORE_OUT=store)
    return dg, du


def gated_activation_merged_fwd(
    gate_up: torch.Tensor,
    activation: str,
    launch: GatedActivationLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(gate) * up`` of a contiguous merged (..., 2 I) ``gate_up`` (as validated by
    ``gated_activation_merged``; no checks here): a new contiguous (..., I) tensor, or ``out``
    (contiguous) when given."""
    width = gate_up.shape[-1] // 2
    if out is None:
        out = gate_up.new_empty((*gate_up.shape[:-1], width))
    if out.numel() == 0:
        return out
    if not use_triton(gate_up):
        _merged_fwd_torch(gate_up, out, activation)
        return out
    rows = out.numel() // width
    kernel = gated_activation_merged_fwd_kernel
    _launch_merged(kernel, (gate_up, out), rows, width, activation, launch, gate_up)
    return out


def gated_activation_merged_bwd(
    dout: torch.Tensor,
    gate_up: torch.Tensor,
    activation: str,
    launch: GatedActivationLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of ``gate_up`` (dgate then dup, one new contiguous tensor of its shape, or
    ``out``) given the contiguous output gradient ``dout`` (..., I)."""
    dgate_up = out
    if dgate_up is None:
        dgate_up = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    if dout.numel() == 0:
        return dgate_up
    if not use_triton(gate_up):
        _merged_bwd_torch(dout, gate_up, dgate_up, activation)
        return dgate_up
    width = gate_up.shape[-1] // 2
    rows = dout.numel() // width
    args = (dout, gate_up, dgate_up)
    kernel = gated_activation_merged_bwd_kernel
    _launch_merged(kernel, args, rows, width, activation, launch, gate_up)
    return dgate_up
