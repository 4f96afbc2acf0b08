"""Which path a kernel call takes (``kernels.dispatch.kernel_path``), for every kernel whose one
autograd formula serves two ways: under torch.compile the graph holds the torch.library forward op
and, in the backward graph, the backward op (the formula registered on the op); an eager call that
autograd records runs the kernel's ``autograd.Function`` over the launchers and dispatches no op;
an eager call with nothing to differentiate runs the launcher alone. Values and gradients are
checked against the references in each kernel's own tests; here the paths, and that the eager
and compiled paths give the same values and gradients, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from surgery.kernels import apply_rope, apply_rotary_pos_emb, gated_activation, rms_norm
from surgery.kernels.gated_activation import gated_activation_merged
from tests.utils import DEVICE


def _rope_inputs():
    q = torch.randn(2, 4, 6, 16, device=DEVICE)
    k = torch.randn(2, 2, 6, 16, device=DEVICE)
    return q, k


_POS = torch.tensor([[0, 1, 2, 0, 1, 2], [3, 4, 5, 6, 7, 8]], device=DEVICE)
_INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 16, 2, device=DEVICE).float() / 16))
_ANGLES = (_POS[..., None].float() * _INV_FREQ).repeat(1, 1, 2)

# name: (call on the differentiable inputs, their shapes' maker, forward op, backward op, Function)
KERNELS = {
    "rms_norm": (
        lambda x, w: rms_norm(x, w, 1e-6, 1.0, "gemma"),
        lambda: (torch.randn(3, 5, 24, device=DEVICE), torch.randn(24, device=DEVICE)),
        "rms_norm_fwd",
        "rms_norm_bwd",
        "RmsNormFunction",
    ),
    "gated_activation": (
        lambda g, u: gated_activation(g, u, "gelu_tanh"),
        lambda: (torch.randn(3, 40, device=DEVICE), torch.randn(3, 40, device=DEVICE)),
        "gated_activation_fwd",
        "gated_activation_bwd",
        "GatedActivationFunction",
    ),
    "gated_activation_merged": (
        lambda gu: gated_activation_merged(gu, "silu"),
        lambda: (torch.randn(3, 2, 48, device=DEVICE),),
        "gated_activation_merged_fwd",
        "gated_activation_merged_bwd",
        "GatedActivationMergedFunction",
    ),
    "apply_rope": (
        lambda q, k: apply_rope(q, k, _POS, _INV_FREQ, 0.9),
        _rope_inputs,
        "rope_fwd",
        "rope_bwd",
        "RopeFwdFunction",
    ),
    "apply_rotary_pos_emb": (
        lambda q, k: apply_rotary_pos_emb(q, k, _ANGLES.cos(), _ANGLES.sin()),
        _rope_inputs,
        "rope_cos_sin_fwd",
        "rope_cos_sin_bwd",
        "RopeCosSinFwdFunction",
    ),
}


class SurgeryOps(TorchDispatchMode):
    """The ``torch.ops.surgery`` ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.called: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "surgery":
            self.called.append(func._opname)
        return func(*args, **(kwargs or {}))


def _graph_ops(gm: torch.fx.GraphModule) -> set[str]:
    return {
        n.target._opname
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "surgery"
    }


def _recorded_by(t: torch.Tensor) -> str:
    # The node that computed ``t``, past the views the public function puts on the result.
    node = t.grad_fn
    while node.name() in ("ViewBackward0", "TransposeBackward0"):
        node = node.next_functions[0][0]
    return node.name()


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _leaves(make):
    return tuple(t.requires_grad_() for t in make())


def _grads(call, leaves, seed=0):
    outs = _outputs(call(*leaves))
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    douts = [torch.randn(o.shape, generator=gen, device=DEVICE, dtype=o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, leaves, douts)


@pytest.mark.parametrize("name", KERNELS)
def test_eager_calls_take_the_function_or_the_launcher_and_no_op(name):
    call, make, _, _, function = KERNELS[name]
    leaves = _leaves(make)
    with SurgeryOps() as seen:
        outs, _ = _grads(call, leaves)
        with torch.no_grad():
            plain = _outputs(call(*leaves))
        detached = _outputs(call(*(t.detach() for t in leaves)))
    assert seen.called == [], f"{name}: eager calls dispatched {seen.called}"
    assert _recorded_by(outs[0]) == f"{function}Backward"
    for out, p, d in zip(outs, plain, detached):
        assert p.grad_fn is None and d.grad_fn is None
        assert torch.equal(out, p) and torch.equal(out, d)


@pytest.mark.parametrize("name", KERNELS)
def test_compiled_graphs_hold_the_forward_and_backward_ops(name):
    call, make, fwd_op, bwd_op, _ = KERNELS[name]
    graphs = {}

    def recorder(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    compiled = torch.compile(call, fullgraph=True, backend=backend)
    leaves = _leaves(make)
    outs, grads = _grads(compiled, leaves)
    assert fwd_op in _graph_ops(graphs["forward"]), _graph_ops(graphs["forward"])
    assert bwd_op in _graph_ops(graphs["backward"]), _graph_ops(graphs["backward"])
    eager_outs, eager_grads = _grads(call, leaves)
    for a, b in zip(outs + grads, eager_outs + eager_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["rms_norm", "gated_activation", "gated_activation_merged"])
def test_double_backward_raises_rather_than_drop_terms(name):
    # Their backward is not differentiable (the rotary maps' is: tests/kernels/test_rope.py).
    call, make, _, _, _ = KERNELS[name]
    leaves = _leaves(make)
    out = _outputs(call(*leaves))[0]
    dout = torch.randn_like(out, requires_grad=True)  # recorded too, as in a Hessian-vector product
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        sum(g.sum() for g in grads).backward()
