"""``surgery.kernels.gated_activation.gated_linear``: a gated MLP's product and down projection as
one step, the product rebuilt inside the activation's backward kernel.

Its values are those of the unfused ``F.linear(gated_activation(gate, up), W)``, bit for bit,
forward and backward (the same kernels and products on the same operands); what changes is what
the forward keeps and which kernels the backward runs. CPU: the kernels run through the Triton
interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from surgery.kernels.gated_activation import gated_activation, gated_linear, gated_linear_fuses
from tests.utils import MatrixProducts


def operands(dtype, device, shape=(2, 7, 24), out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(*shape, generator=g).to(device, dtype) for _ in range(2))
    weight = (torch.randn(out, shape[-1], generator=g) / shape[-1] ** 0.5).to(device, dtype)
    dy = torch.randn(*shape[:-1], out, generator=g).to(device, dtype)
    return gate, up, weight, dy


def step(fn, gate, up, weight, dy, activation):
    gate, up, weight = (t.detach().clone().requires_grad_() for t in (gate, up, weight))
    y = fn(gate, up, weight, activation)
    y.backward(dy)
    return y.detach(), gate.grad, up.grad, weight.grad


def unfused(gate, up, weight, activation):
    return F.linear(gated_activation(gate, up, activation), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_values_are_the_unfused_ones_bit_for_bit(dtype, activation, device):
    ops = operands(dtype, device)
    got = step(gated_linear, *ops, activation)
    want = step(unfused, *ops, activation)
    for name, g, w in zip(("out", "dgate", "dup", "dweight"), got, want):
        assert torch.equal(g, w), name


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_keeps_no_product_and_rebuilds_it_in_the_backward_kernel(device):
    """The forward keeps gate, up and the weight (no (tokens x I) product); the backward runs the
    activation's backward kernel that writes the product too, and no forward kernel again."""
    gate, up, weight, dy = operands(torch.float32, device)
    gate, up, weight = (t.requires_grad_() for t in (gate, up, weight))
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = gated_linear(gate, up, weight)
    assert {t.data_ptr() for t in kept} == {gate.data_ptr(), up.data_ptr(), weight.data_ptr()}
    with Ops() as mode:
        y.backward(dy)
    assert "surgery::gated_activation_bwd_with_output" in mode.names
    assert "surgery::gated_activation_fwd" not in mode.names


def test_checkpointed_recomputation_stops_before_the_down_projection(device):
    """Under non-reentrant checkpointing (FSDP2's, accelerate's) a layer's recomputation stops once
    every tensor it saved is back: a gated MLP ending in ``gated_linear`` recomputes its gate and up
    products but not the down projection, as the unfused ``nn.Linear`` MLP does (its products save
    their inputs before running). Same products in the backward for both."""
    from torch.utils.checkpoint import checkpoint

    gate, _, weight, dy = operands(torch.float32, device)
    x = gate.detach().clone().requires_grad_()
    w_gate, w_up = (torch.randn(24, 24, device=device, requires_grad=True) for _ in range(2))
    weight.requires_grad_()
    counts = {}
    for name, fn in (("fused", gated_linear), ("unfused", unfused)):

        def mlp(x, fn=fn):
            return fn(F.linear(x, w_gate), F.linear(x, w_up), weight, "silu")

        y = checkpoint(mlp, x, use_reentrant=False)
        with MatrixProducts() as products:
            y.backward(dy)
        counts[name] = products.count
    # recomputed gate and up; dX and dW of each of the three projections
    assert counts == {"fused": 8, "unfused": 8}


@pytest.mark.parametrize("needs", ["weight", "inputs"])
def test_partial_gradients(needs, device):
    gate, up, weight, dy = operands(torch.float32, device)
    want = step(unfused, gate, up, weight, dy, "silu")
    gate, up, weight = gate.clone(), up.clone(), weight.clone()
    (weight if needs == "weight" else gate).requires_grad_()
    if needs == "inputs":
        up.requires_grad_()
    gated_linear(gate, up, weight).backward(dy)
    if needs == "weight":
        assert gate.grad is None and torch.equal(weight.grad, want[3])
    else:
        assert weight.grad is None and torch.equal(gate.grad, want[1])
        assert torch.equal(up.grad, want[2])


def test_falls_back_to_the_unfused_expression(device):
    """A weight in another dtype than the product, or autocast (which casts the product), runs
    the unfused expression, whose result it is."""
    gate, up, weight, _ = operands(torch.bfloat16, device)
    assert gated_linear_fuses(gate, up, weight)
    assert not gated_linear_fuses(gate, up, weight.float())
    with pytest.raises(RuntimeError):  # F.linear refuses mixed dtypes: so does the fallback
        gated_linear(gate, up, weight.float())
    with torch.autocast(device.type, dtype=torch.bfloat16):
        assert not gated_linear_fuses(gate, up, weight)
        got = gated_linear(gate.float(), up.float(), weight.float())
        want = unfused(gate.float(), up.float(), weight.float(), "silu")
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_compiled_matches_and_rebuilds_in_the_backward_kernel():
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    ops = operands(torch.float32, torch.device("cpu"))
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(gated_linear, backend=backend, fullgraph=True)
    got = step(compiled, *ops, "silu")
    for g, w in zip(got, step(unfused, *ops, "silu")):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    backward = [str(n.target) for gm in backend.bw_graphs for n in gm.graph.nodes]
    assert "surgery.gated_activation_bwd_with_output.default" in backward
    assert "surgery.gated_activation_fwd.default" not in backward


@pytest.mark.gpu
def test_gpu_llama_mlp_shape_bit_for_bit():
    """A Llama ~1B MLP's shapes (8192 tokens, intermediate 8192, hidden 2048) in bf16 on the GPU:
    the fused step's values are the unfused ones, bit for bit."""
    ops = operands(torch.bfloat16, torch.device("cuda"), shape=(2, 4096, 8192), out=2048)
    got = step(gated_linear, *ops, "silu")
    want = step(unfused, *ops, "silu")
    for name, g, w in zip(("out", "dgate", "dup", "dweight"), got, want):
        assert torch.equal(g, w), name
