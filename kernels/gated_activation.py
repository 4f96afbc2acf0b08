"""The gated MLP's activation, act(gate) * up (SwiGLU, GeGLU), fused forward and backward.

Order (STYLE.md 2): Triton kernels -> host launchers (``gated_activation_fwd``,
``gated_activation_bwd``) -> torch.library ops with their autograd -> ``gated_activation``, with the
reference ``gated_activation_reference`` last.

Elementwise, in fp32 whatever the storage dtype, rounded once:

    out   = act(g) * u
    dg    = dout * u * act'(g)          du = dout * act(g)

    silu:      act(g) = g s,   s = sigmoid(g)           act'(g) = s (1 + g (1 - s))
    gelu_tanh: act(g) = g s,   s = sigmoid(2 t),  t = sqrt(2/pi) (g + 0.044715 g^3)
               act'(g) = s + 2 g s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 g^2)

gelu_tanh is torch's ``gelu(approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``), written
with 0.5 (1 + tanh(t)) = sigmoid(2 t): the same function, without tanh's cancellation for large
negative g. The forward saves g and u only; the backward recomputes act(g). Against transformers'
eager ``act_fn(gate) * up`` in bf16 (two roundings, and act(g) saved for backward) the result is
rounded once and one (…, I) tensor fewer is kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dispatch import (
    cdiv,
    interpreter_enabled,
    next_power_of_2,
    on_device,
    triton_available,
    use_triton,
)
from .rounding import round_to

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = [
    "ACTIVATIONS",
    "GatedActivationLaunch",
    "gated_activation",
    "gated_activation_bwd",
    "gated_activation_fwd",
    "gated_activation_reference",
]

# Kernel code of each activation (a constexpr in the kernels).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements the PyTorch fallback upcasts to fp32 at once.
FALLBACK_ELEMS = 1 << 22


if triton is not None:

    @triton.jit
    def _act_and_gate(g, ACTIVATION: tl.constexpr):
        # (act(g), sigmoid factor s with act(g) = g * s)
        if ACTIVATION == 0:
            s = tl.sigmoid(g)
        else:
            t = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            s = tl.sigmoid(2.0 * t)
        return g * s, s

    @triton.jit
    def gated_activation_fwd_kernel(
        g_ptr,
        u_ptr,
        out_ptr,
        numel,
        BLOCK: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """One program per BLOCK contiguous elements."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, _ = _act_and_gate(g, ACTIVATION)
        out = round_to(a * u, out_ptr.dtype.element_ty, INTERPRETED)
        tl.store(out_ptr + offs, out, mask=mask)

    @triton.jit
    def gated_activation_bwd_kernel(
        dout_ptr,
        g_ptr,
        u_ptr,
        dg_ptr,
        du_ptr,
        numel,
        BLOCK: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """dg and du from dout, recomputing act(g); one program per BLOCK elements."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, s = _act_and_gate(g, ACTIVATION)
        if ACTIVATION == 0:
            da = s * (1.0 + g * (1.0 - s))
        else:
            dt = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
            da = s + 2.0 * a * (1.0 - s) * dt
        tl.store(dg_ptr + offs, round_to(dout * u * da, dg_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask)  # fmt: skip
        tl.store(du_ptr + offs, round_to(dout * a, du_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host launchers. Inputs are contiguous tensors of one shape and dtype (``gated_activation``
# makes them so); outputs are new contiguous tensors.


@dataclass(frozen=True)
class GatedActivationLaunch:
    """Launch configuration (STYLE.md 8): ``block`` elements per program, ``num_warps`` warps.
    Default: 16 elements per thread and tensor, two 128-bit accesses of bf16 each."""

    block: int = 2048
    num_warps: int = 4


DEFAULT_LAUNCH = GatedActivationLaunch()
# The interpreter pays per program, not per element: few large programs.
INTERPRETER_LAUNCH = GatedActivationLaunch(block=1 << 16)


def _act_torch(g: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _fwd_torch(gate, up, out, activation):
    g, u, o = gate.view(-1), up.view(-1), out.view(-1)
    for i in range(0, g.numel(), FALLBACK_ELEMS):
        sl = slice(i, i + FALLBACK_ELEMS)
        o[sl] = (_act_torch(g[sl].float(), activation) * u[sl].float()).to(o.dtype)


def _act_backward_torch(grad: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    # The ops autograd runs for F.silu / F.gelu, called directly: inside a torch.library op (what
    # torch.compile runs) the autograd keys are excluded, so torch.autograd.grad would find no
    # graph to differentiate.
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    return torch.ops.aten.gelu_backward(grad, g, approximate="tanh")


def _bwd_torch(dout, gate, up, dg, du, activation):
    d, g, u = dout.reshape(-1), gate.view(-1), up.view(-1)
    dg, du = dg.view(-1), du.view(-1)
    for i in range(0, g.numel(), FALLBACK_ELEMS):
        sl = slice(i, i + FALLBACK_ELEMS)
        gf, df = g[sl].float(), d[sl].float()
        dg[sl] = _act_backward_torch(df * u[sl].float(), gf, activation).to(dg.dtype)
        du[sl] = (df * _act_torch(gf, activation)).to(du.dtype)


def _launch(launch, t):
    return launch or (DEFAULT_LAUNCH if t.is_cuda else INTERPRETER_LAUNCH)


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
    launch = _launch(launch, gate)
    block = min(launch.block, next_power_of_2(numel))
    with on_device(gate):
        gated_activation_fwd_kernel[(cdiv(numel, block),)](
            gate,
            up,
            out,
            numel,
            BLOCK=block,
            ACTIVATION=ACTIVATIONS[activation],
            INTERPRETED=interpreter_enabled(),
            num_warps=launch.num_warps,
        )
    return out


def gated_activation_bwd(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    launch: GatedActivationLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` given the output gradient (contiguous, gate's shape): new contiguous
    tensors, or the pair ``out`` when given."""
    if out is not None:
        dg, du = out
    else:
        dg = torch.empty_like(gate, memory_format=torch.contiguous_format)
        du = torch.empty_like(up, memory_format=torch.contiguous_format)
    numel = gate.numel()
    if numel == 0:
        return dg, du
    if not use_triton(gate):
        _bwd_torch(dout, gate, up, dg, du, activation)
        return dg, du
    launch = _launch(launch, gate)
    block = min(launch.block, next_power_of_2(numel))
    with on_device(gate):
        gated_activation_bwd_kernel[(cdiv(numel, block),)](
            dout,
            gate,
            up,
            dg,
            du,
            numel,
            BLOCK=block,
            ACTIVATION=ACTIVATIONS[activation],
            INTERPRETED=interpreter_enabled(),
            num_warps=launch.num_warps,
        )
    return dg, du


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile, so a model using them traces with fullgraph=True.


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


def _fwd_op_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    dg, du = _gated_bwd_op(dout.contiguous(), gate, up, ctx.activation)
    return dg, du, None


_gated_fwd_op.register_autograd(_fwd_op_backward, setup_context=_save_fwd)


class _GatedActivationFunction(torch.autograd.Function):
    """Eager autograd over the launchers, the same map as the op above (lower host overhead in
    eager mode; the op carries the autograd torch.compile sees)."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return gated_activation_fwd(gate, up, activation)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = gated_activation_bwd(dout.contiguous(), gate, up, ctx.activation)
        return dg, du, None


# ---------------------------------------------------------------------------------------------
# Public functions.


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

    Differentiable in gate and up; the forward saves only gate and up. Under
    ``torch.compile(fullgraph=True)`` it runs as ``torch.ops.surgery.gated_activation_fwd``. CUDA
    tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton kernels, other CPU
    tensors a PyTorch path with the same fp32 math.

    Autocast (the rule of every kernel here: inputs are cast on entry where the unpatched module's
    ops would cast them, and nothing after that depends on autocast): ``act(gate) * up`` is
    elementwise, which autocast leaves alone, so nothing is cast and the output has the promoted
    dtype of gate and up, as transformers' ``act_fn(gate) * up`` under autocast (in an fp32 model
    the autocast projections hand over gate and up in the autocast dtype, and the product keeps
    it). No op inside depends on autocast: the result is that of the call without it, bit for bit.
    """
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError(f"gated_activation: gate and up must be tensors, got {type(gate)}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"gated_activation: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}"
        )
    if gate.dtype not in _FLOAT_DTYPES or up.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"gated_activation: gate and up must be float32, bfloat16 or float16; got "
            f"{gate.dtype} and {up.dtype}"
        )
    if gate.shape != up.shape:
        raise ValueError(
            f"gated_activation: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the "
            "same shape"
        )
    if gate.device != up.device:
        raise ValueError(f"gated_activation: gate is on {gate.device} but up is on {up.device}")
    if gate.dtype != up.dtype:
        dtype = torch.promote_types(gate.dtype, up.dtype)
        gate, up = gate.to(dtype), up.to(dtype)
    gate, up = gate.contiguous(), up.contiguous()
    if torch.compiler.is_compiling():
        return _gated_fwd_op(gate, up, activation)
    return _GatedActivationFunction.apply(gate, up, activation)


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
