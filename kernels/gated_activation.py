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

``gated_activation_merged`` is the same map on one merged (…, 2 I) tensor holding gate then up
(a merged gate/up projection: transformers' experts keep ``gate_up_proj`` so). It reads both
halves in place and writes both gradients into one (…, 2 I) tensor: no copy of the halves is made
or kept, where ``gated_activation`` on two views of it would copy each.
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
    "gated_activation_merged",
    "gated_activation_merged_bwd",
    "gated_activation_merged_fwd",
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


if triton is not None:

    @triton.jit
    def gated_activation_merged_fwd_kernel(
        gate_up_ptr,
        out_ptr,
        rows,
        width,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """out[r, c] = act(gate_up[r, c]) * gate_up[r, width + c]; one program per
        BLOCK_M x BLOCK_N tile of out (rows x width), gate_up rows 2 * width apart."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm < rows)[:, None] & (rn < width)[None, :]
        row = rm.to(tl.int64)[:, None]
        g_offs = row * (2 * width) + rn[None, :]
        g = tl.load(gate_up_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + g_offs + width, mask=mask, other=0.0).to(tl.float32)
        a, _ = _act_and_gate(g, ACTIVATION)
        out = round_to(a * u, out_ptr.dtype.element_ty, INTERPRETED)
        tl.store(out_ptr + row * width + rn[None, :], out, mask=mask)

    @triton.jit
    def gated_activation_merged_bwd_kernel(
        dout_ptr,
        gate_up_ptr,
        dgate_up_ptr,
        rows,
        width,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """dgate_up (rows x 2 width: dgate then dup) from dout (rows x width), recomputing
        act(gate); one program per BLOCK_M x BLOCK_N tile of dout."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm < rows)[:, None] & (rn < width)[None, :]
        row = rm.to(tl.int64)[:, None]
        g_offs = row * (2 * width) + rn[None, :]
        dout = tl.load(dout_ptr + row * width + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_up_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + g_offs + width, mask=mask, other=0.0).to(tl.float32)
        a, s = _act_and_gate(g, ACTIVATION)
        if ACTIVATION == 0:
            da = s * (1.0 + g * (1.0 - s))
        else:
            dt = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
            da = s + 2.0 * a * (1.0 - s) * dt
        out_ty = dgate_up_ptr.dtype.element_ty
        tl.store(dgate_up_ptr + g_offs, round_to(dout * u * da, out_ty, INTERPRETED), mask=mask)
        tl.store(dgate_up_ptr + g_offs + width, round_to(dout * a, out_ty, INTERPRETED),
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


# Merged layout: ``gate_up`` is a contiguous (rows, 2 * width) tensor, gate in its first ``width``
# columns and up in the others; ``out`` and ``dout`` are contiguous (rows, width).


def _merged_tiles(launch: GatedActivationLaunch, rows: int, width: int) -> tuple[int, int]:
    # (BLOCK_M, BLOCK_N): about ``launch.block`` elements per program, a row split into column
    # tiles of at most block / 8 (256 on a GPU: an expert width of 768 is three whole tiles).
    block_n = min(next_power_of_2(width), max(16, launch.block // 8))
    block_m = min(max(1, launch.block // block_n), next_power_of_2(rows))
    return block_m, block_n


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = gate_up.shape[-1] // 2
    return gate_up[..., :width], gate_up[..., width:]


def _merged_fwd_torch(gate_up, out, activation):
    g, u = _halves(gate_up.view(-1, gate_up.shape[-1]))
    o = out.view(-1, out.shape[-1])
    step = max(1, FALLBACK_ELEMS // max(1, o.shape[1]))
    for i in range(0, o.shape[0], step):
        sl = slice(i, i + step)
        o[sl] = (_act_torch(g[sl].float(), activation) * u[sl].float()).to(o.dtype)


def _merged_bwd_torch(dout, gate_up, dgate_up, activation):
    g, u = _halves(gate_up.view(-1, gate_up.shape[-1]))
    dg, du = _halves(dgate_up.view(-1, dgate_up.shape[-1]))
    d = dout.reshape(-1, dout.shape[-1])
    step = max(1, FALLBACK_ELEMS // max(1, d.shape[1]))
    for i in range(0, d.shape[0], step):
        sl = slice(i, i + step)
        gf, df = g[sl].float(), d[sl].float()
        dg[sl] = _act_backward_torch(df * u[sl].float(), gf, activation).to(dg.dtype)
        du[sl] = (df * _act_torch(gf, activation)).to(du.dtype)


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
    launch = _launch(launch, gate_up)
    rows = out.numel() // width
    block_m, block_n = _merged_tiles(launch, rows, width)
    with on_device(gate_up):
        gated_activation_merged_fwd_kernel[(cdiv(rows, block_m), cdiv(width, block_n))](
            gate_up,
            out,
            rows,
            width,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            ACTIVATION=ACTIVATIONS[activation],
            INTERPRETED=interpreter_enabled(),
            num_warps=launch.num_warps,
        )
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
    launch = _launch(launch, gate_up)
    width = gate_up.shape[-1] // 2
    rows = dout.numel() // width
    block_m, block_n = _merged_tiles(launch, rows, width)
    with on_device(gate_up):
        gated_activation_merged_bwd_kernel[(cdiv(rows, block_m), cdiv(width, block_n))](
            dout,
            gate_up,
            dgate_up,
            rows,
            width,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            ACTIVATION=ACTIVATIONS[activation],
            INTERPRETED=interpreter_enabled(),
            num_warps=launch.num_warps,
        )
    return dgate_up


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


# The merged layout has this op alone for its autograd (one path, eager and compiled alike).


@torch.library.custom_op("surgery::gated_activation_merged_fwd", mutates_args=())
def _merged_fwd_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_merged_fwd(gate_up, activation)


@_merged_fwd_op.register_fake
def _(gate_up, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("surgery::gated_activation_merged_bwd", mutates_args=())
def _merged_bwd_op(dout: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation_merged_bwd(dout, gate_up, activation)


@_merged_bwd_op.register_fake
def _(dout, gate_up, activation):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _save_merged(ctx, inputs, output):
    gate_up, activation = inputs
    ctx.save_for_backward(gate_up)
    ctx.activation = activation


def _merged_op_backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return _merged_bwd_op(dout.contiguous(), gate_up, ctx.activation), None


_merged_fwd_op.register_autograd(_merged_op_backward, setup_context=_save_merged)


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
    ``torch.ops.surgery.gated_activation_merged_fwd`` eager and under ``torch.compile`` alike;
    dispatch (Triton on CUDA and under ``TRITON_INTERPRET=1``, else a PyTorch path) and autocast as
    ``gated_activation``: elementwise, nothing is cast.
    """
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"gated_activation_merged: gate_up must be a tensor, got {type(gate_up)}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"gated_activation_merged: activation must be one of {tuple(ACTIVATIONS)}, got "
            f"{activation!r}"
        )
    if gate_up.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"gated_activation_merged: gate_up must be float32, bfloat16 or float16; got "
            f"{gate_up.dtype}"
        )
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"gated_activation_merged: gate_up {tuple(gate_up.shape)} must have an even last "
            "dimension (gate then up)"
        )
    return _merged_fwd_op(gate_up.contiguous(), activation)


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
