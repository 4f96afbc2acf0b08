"""Gated MLP activation kernels (act(gate) * up) against the fp64 reference and transformers' own
activations (ACT2FN, as the MLPs of every supported architecture apply them).

CPU: the Triton kernels run through the interpreter (small shapes); ``gpu``-marked tests run real
sizes on the GPU machine. Error budget (``tests.utils.TOLERANCES``): against the fp64 reference, the
kernel's error may exceed transformers' eager ``act_fn(gate) * up`` in the same dtype only by the
TOLERANCES margin.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from surgery.kernels import gated_activation, gated_activation_reference
from surgery.kernels.dispatch import use_triton
from surgery.kernels.gated_activation import (
    GatedActivationLaunch,
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_merged,
    gated_activation_merged_bwd,
    gated_activation_merged_fwd,
)
from tests.models.conftest import _one_cpu_thread  # noqa: F401  (autouse: tiny CPU ops, 1 thread)
from tests.utils import DEVICE, TOLERANCES, assert_close_budget, poisoned_empty

# sigmoid(z) = 1 / (1 + exp(-z)) takes exp(-z) = inf for z < -88 on purpose (the limit is exact);
# the interpreter evaluates exp with numpy, which warns about it, where a GPU says nothing.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Our activation name -> transformers' (the config's hidden_act / hidden_activation).
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def make_inputs(shape, dtype, device=DEVICE):
    # Gate pre-activations over the range where the activations bend (and their tails).
    gate = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    return gate, up


def output_and_grads(fn, gate, up, dout):
    out = fn(gate, up)
    return (out, *torch.autograd.grad(out, (gate, up), dout.to(out.dtype)))


def ground_truth(gate, up, activation, dout):
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    return output_and_grads(
        lambda g, u: gated_activation_reference(g, u, activation), g64, u64, dout.double()
    )


def hf_eager(activation):
    """transformers' MLP: ``act_fn(gate_proj(x)) * up_proj(x)``, in the inputs' dtype."""
    act_fn = ACT2FN[HF_ACTIVATIONS[activation]]
    return lambda g, u: act_fn(g) * u


# ---------------------------------------------------------------------------------------------
# Forward and gradients against the fp64 reference, within the budget of transformers' eager path.

SHAPES = [(37, 67), (37, 1000), (2, 3, 5, 7)]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get
)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
def test_matches_transformers_activation(activation, shape, dtype):
    gate, up = make_inputs(shape, dtype)
    dout = torch.randn(shape, device=DEVICE)
    got = output_and_grads(lambda g, u: gated_activation(g, u, activation), gate, up, dout)
    hf = output_and_grads(hf_eager(activation), gate, up, dout)
    ref = ground_truth(gate, up, activation, dout)
    assert got[0].dtype == dtype and got[0].shape == gate.shape
    for what, x, r, h in zip(("out", "dgate", "dup"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{activation} {what}")


def test_extreme_gates_stay_finite():
    """Saturated sigmoids (|gate| up to 1e4; gelu's cubic term overflows fp32 first) give the
    limits: act -> gate or 0, no NaN or inf."""
    gate = torch.tensor([-1e4, -300.0, -88.0, -20.0, 0.0, 20.0, 88.0, 300.0, 1e4], device=DEVICE)
    gate = gate.requires_grad_()
    up = torch.full_like(gate, 0.5).requires_grad_()
    for activation in HF_ACTIVATIONS:
        out = gated_activation(gate, up, activation)
        dg, du = torch.autograd.grad(out, (gate, up), torch.ones_like(out))
        ref = ground_truth(gate, up, activation, torch.ones_like(out))
        for what, x, r in zip(("out", "dgate", "dup"), (out, dg, du), ref):
            assert torch.isfinite(x).all(), f"{activation} {what}: {x}"
            torch.testing.assert_close(x.double(), r, rtol=1e-5, atol=1e-5)


def test_mixed_dtypes_promote():
    gate, _ = make_inputs((5, 16), torch.bfloat16)
    up = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    out = gated_activation(gate, up)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert gate.grad.dtype == torch.bfloat16 and up.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Under torch.autocast: transformers' ``act_fn(gate) * up`` is elementwise, which autocast leaves
# alone, so gate and up keep the dtype they arrive in (fp32 inputs stay fp32; in an fp32 model the
# autocast projections hand over the autocast dtype) and the product is rounded to it.

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("inputs", ["fp32", "autocast"])
@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
def test_under_autocast_matches_transformers_activation(activation, name, inputs):
    dtype = AUTOCAST_DTYPES[name]
    gate, up = make_inputs((37, 67), dtype if inputs == "autocast" else torch.float32)
    dout = torch.randn(37, 67, device=DEVICE)

    def ours(g, u):
        return gated_activation(g, u, activation)

    plain = output_and_grads(ours, gate, up, dout)
    with torch.autocast(DEVICE.type, dtype=dtype):
        got = output_and_grads(ours, gate, up, dout)
        hf = output_and_grads(hf_eager(activation), gate, up, dout)
    ref = ground_truth(gate, up, activation, dout)
    assert got[0].dtype == hf[0].dtype == gate.dtype
    for what, x, p, r, h in zip(("out", "dgate", "dup"), got, plain, ref, hf):
        # Autocast changes nothing inside the kernel: the call without it, bit for bit.
        assert torch.equal(x, p), what
        assert x.dtype == h.dtype, what
        assert_close_budget(x, r, h, gate.dtype, f"{activation} {name} {inputs} {what}")


@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
def test_mlp_with_fp32_weights_under_autocast(activation, name):
    """The gated MLP of an fp32 model under autocast, ``down(act(gate(x)) * up(x))`` with fp32
    weights and input: the output and the gradients of the input and of every weight against
    transformers' MLP under the same autocast."""
    dtype = AUTOCAST_DTYPES[name]
    g = torch.Generator().manual_seed(2)
    H, I = 48, 80
    x = torch.randn(37, H, generator=g).to(DEVICE).requires_grad_()
    weights = [
        (torch.randn(shape, generator=g) / shape[1] ** 0.5).to(DEVICE).requires_grad_()
        for shape in ((I, H), (I, H), (H, I))
    ]
    dout = torch.randn(37, H, generator=g).to(DEVICE)

    def mlp(middle, x, w_gate, w_up, w_down):
        return F.linear(middle(F.linear(x, w_gate), F.linear(x, w_up)), w_down)

    def run(middle, leaves):
        out = mlp(middle, *leaves)
        return (out, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))

    leaves = (x, *weights)
    with torch.autocast(DEVICE.type, dtype=dtype):
        got = run(lambda a, b: gated_activation(a, b, activation), leaves)
        hf = run(hf_eager(activation), leaves)
    leaves64 = tuple(t.detach().double().requires_grad_() for t in leaves)
    ref = run(lambda a, b: gated_activation_reference(a, b, activation), leaves64)
    assert got[0].dtype == hf[0].dtype == dtype
    names = ("out", "dx", "dw_gate", "dw_up", "dw_down")
    for what, a, r, h in zip(names, got, ref, hf):
        assert a.dtype == h.dtype, what
        assert_close_budget(a, r, h, dtype, f"{activation} {name} {what}")


# ---------------------------------------------------------------------------------------------
# Launch: poisoned outputs over several programs with a ragged last block; layouts.


@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAMES.get)
def test_poisoned_outputs_and_multi_block_launch(dtype, activation):
    gate, up = (t.detach() for t in make_inputs((37, 67), dtype))
    dout = torch.randn(37, 67, device=DEVICE).to(dtype)
    launch = GatedActivationLaunch(block=256)  # 10 programs, the last one partly masked
    out = gated_activation_fwd(
        gate, up, activation, launch, out=poisoned_empty(37, 67, dtype=dtype)
    )
    dg, du = gated_activation_bwd(
        dout,
        gate,
        up,
        activation,
        launch,
        out=(poisoned_empty(37, 67, dtype=dtype), poisoned_empty(37, 67, dtype=dtype)),
    )
    assert torch.equal(out, gated_activation_fwd(gate, up, activation))
    want_dg, want_du = gated_activation_bwd(dout, gate, up, activation)
    assert torch.equal(dg, want_dg) and torch.equal(du, want_du)


def test_non_contiguous_inputs():
    fused = torch.randn(3, 7, 2 * 40, device=DEVICE, requires_grad=True)  # a merged gate_up proj
    gate, up = fused[..., :40], fused[..., 40:]
    out = gated_activation(gate, up)
    want = gated_activation_reference(gate, up)
    torch.testing.assert_close(out, want)
    (g,) = torch.autograd.grad(out.sum(), fused)
    (w,) = torch.autograd.grad(want.sum(), fused)
    torch.testing.assert_close(g, w)


def test_empty_input():
    gate, up = make_inputs((0, 16), torch.float32)
    out = gated_activation(gate, up)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert gate.grad.shape == (0, 16)


@pytest.mark.parametrize(
    ("gate_shape", "up_shape", "kwargs", "error"),
    [
        ((4, 8), (4, 9), {}, ValueError),
        ((4, 8), (4, 8), {"activation": "relu"}, ValueError),
        ((4, 8), (4, 8), {"activation": "gelu"}, ValueError),  # exact (erf) GELU: no kernel
    ],
    ids=["shape", "relu", "gelu-erf"],
)
def test_bad_input_raises(gate_shape, up_shape, kwargs, error):
    gate, up = torch.randn(gate_shape, device=DEVICE), torch.randn(up_shape, device=DEVICE)
    with pytest.raises(error):
        gated_activation(gate, up, **kwargs)
    with pytest.raises(TypeError):
        gated_activation(gate.double(), gate.double())


# ---------------------------------------------------------------------------------------------
# torch.library registration: schema, fake tensors, autograd, and tracing with fullgraph=True.


def test_ops_pass_opcheck():
    gate, up = make_inputs((5, 24), torch.float32)
    ops = torch.ops.surgery
    torch.library.opcheck(ops.gated_activation_fwd.default, (gate, up, "silu"))
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (gate.detach().bfloat16(), up.detach().bfloat16(), "gelu_tanh")
    torch.library.opcheck(ops.gated_activation_fwd.default, args, test_utils=quick)
    dout = torch.randn(5, 24, device=DEVICE)
    bwd_args = (dout, gate.detach(), up.detach(), "gelu_tanh")
    torch.library.opcheck(ops.gated_activation_bwd.default, bwd_args, test_utils=quick)


def test_traces_with_fullgraph_on_cpu():
    # Inductor needs a compiler on CPU; aot_eager still checks fake tensors and the graph.
    gate, up = make_inputs((2, 3, 40), torch.bfloat16)
    fn = torch.compile(
        lambda g, u: gated_activation(g, u, "gelu_tanh"), fullgraph=True, backend="aot_eager"
    )
    got, want = fn(gate, up), gated_activation(gate, up, "gelu_tanh")
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    grads_c = torch.autograd.grad(got, (gate, up), dout)
    grads_e = torch.autograd.grad(want, (gate, up), dout)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: real sizes (8192 tokens x intermediate 8192 / 14336), compile, CUDA graphs.

REAL = [(8192, 8192), (2, 4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL, ids=shape_id)
@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
def test_gpu_real_sizes_match_transformers(activation, shape):
    dtype = torch.bfloat16
    gate, up = make_inputs(shape, dtype)
    dout = torch.randn(shape, device=DEVICE)
    got = output_and_grads(lambda g, u: gated_activation(g, u, activation), gate, up, dout)
    hf = output_and_grads(hf_eager(activation), gate, up, dout)
    ref = ground_truth(gate, up, activation, dout)
    for what, x, r, h in zip(("out", "dgate", "dup"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{activation} {what}")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    torch._dynamo.reset()
    gate, up = make_inputs((2, 1024, 4096), torch.bfloat16)

    def mlp_middle(g, u):
        h = gated_activation(g, u, "silu")
        return h.float().square().sum() * 1e-3, h

    compiled = torch.compile(mlp_middle, fullgraph=True)
    loss_c, h_c = compiled(gate, up)
    g_c = torch.autograd.grad(loss_c, (gate, up))
    loss_e, h_e = mlp_middle(gate, up)
    g_e = torch.autograd.grad(loss_e, (gate, up))
    assert torch.equal(h_c, h_e)
    tol = TOLERANCES[torch.bfloat16]
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    gate, up = (t.detach() for t in make_inputs((4096, 8192), torch.bfloat16))
    dout = torch.randn_like(gate)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gated_activation_fwd(gate, up, "gelu_tanh")  # compile and warm up outside the capture
        gated_activation_bwd(dout, gate, up, "gelu_tanh")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_activation_fwd(gate, up, "gelu_tanh")
        dg, du = gated_activation_bwd(dout, gate, up, "gelu_tanh")
    gate.copy_(torch.randn_like(gate))
    graph.replay()
    want = gated_activation_fwd(gate, up, "gelu_tanh")
    want_dg, want_du = gated_activation_bwd(dout, gate, up, "gelu_tanh")
    assert torch.equal(out, want) and torch.equal(dg, want_dg) and torch.equal(du, want_du)


# ---------------------------------------------------------------------------------------------
# The merged layout (gate then up in one (..., 2 I) tensor, transformers' experts' gate_up_proj):
# against the same references, through views of the merged tensor.

MERGED_SHAPES = [(37, 67), (3, 5, 40), (1, 1)]


def make_merged(shape, dtype, device=DEVICE):
    *lead, width = shape
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(*lead, width, generator=g) * 3
    up = torch.randn(*lead, width, generator=g)
    return torch.cat([gate, up], -1).to(device=device, dtype=dtype).requires_grad_()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get
)
@pytest.mark.parametrize("shape", MERGED_SHAPES, ids=shape_id)
@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
def test_merged_matches_transformers_activation(activation, shape, dtype):
    gate_up = make_merged(shape, dtype)
    dout = torch.randn(shape, device=DEVICE)

    def merged(fn):
        return lambda gu: fn(*gu.chunk(2, -1))

    def run(fn, leaf, d):
        out = fn(leaf)
        (grad,) = torch.autograd.grad(out, leaf, d.to(out.dtype))
        return out, grad

    got = run(lambda gu: gated_activation_merged(gu, activation), gate_up, dout)
    hf = run(merged(hf_eager(activation)), gate_up, dout)
    leaf64 = gate_up.detach().double().requires_grad_()
    ref = run(
        merged(lambda g, u: gated_activation_reference(g, u, activation)), leaf64, dout.double()
    )
    assert got[0].dtype == dtype and got[0].shape == shape and got[0].is_contiguous()
    assert got[1].shape == gate_up.shape
    for what, x, r, h in zip(("out", "dgate_up"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{activation} merged {what}")


@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAMES.get)
def test_merged_poisoned_outputs_and_ragged_tiles(dtype, activation):
    """Several row and column tiles, both ragged, every element written (NaN-poisoned outputs);
    the same bits as ``gated_activation`` on the two halves (the Triton path: one formula)."""
    gate_up = make_merged((37, 67), dtype).detach()
    dout = torch.randn(37, 67, device=DEVICE).to(dtype)
    launch = GatedActivationLaunch(block=256)  # tiles of 8 rows x 32 columns
    out = gated_activation_merged_fwd(
        gate_up, activation, launch, out=poisoned_empty(37, 67, dtype=dtype)
    )
    dgate_up = gated_activation_merged_bwd(
        dout, gate_up, activation, launch, out=poisoned_empty(37, 134, dtype=dtype)
    )
    assert torch.equal(out, gated_activation_merged_fwd(gate_up, activation))
    assert torch.equal(dgate_up, gated_activation_merged_bwd(dout, gate_up, activation))
    if use_triton(gate_up):
        gate, up = (t.contiguous() for t in gate_up.chunk(2, -1))
        assert torch.equal(out, gated_activation_fwd(gate, up, activation))
        dg, du = gated_activation_bwd(dout, gate, up, activation)
        assert torch.equal(dgate_up, torch.cat([dg, du], -1))


def test_merged_keeps_only_its_input_for_backward():
    """The op saves gate_up itself (no copy of either half) and nothing else."""
    gate_up = make_merged((5, 24), torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gated_activation_merged(gate_up, "silu")
    assert len(saved) == 1 and saved[0].data_ptr() == gate_up.data_ptr()
    out.sum().backward()
    assert gate_up.grad.shape == gate_up.shape


def test_merged_empty_and_bad_input():
    empty = make_merged((0, 16), torch.float32)
    out = gated_activation_merged(empty)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert empty.grad.shape == (0, 32)
    with pytest.raises(ValueError, match="even"):
        gated_activation_merged(torch.randn(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        gated_activation_merged(torch.randn(4, 8, device=DEVICE), "relu")
    with pytest.raises(TypeError):
        gated_activation_merged(torch.randn(4, 8, device=DEVICE).double())


def test_merged_ops_pass_opcheck_and_trace_with_fullgraph():
    gate_up = make_merged((5, 24), torch.float32)
    ops = torch.ops.surgery
    torch.library.opcheck(ops.gated_activation_merged_fwd.default, (gate_up, "silu"))
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    dout = torch.randn(5, 24, device=DEVICE)
    bwd_args = (dout, gate_up.detach(), "gelu_tanh")
    torch.library.opcheck(ops.gated_activation_merged_bwd.default, bwd_args, test_utils=quick)
    fn = torch.compile(
        lambda gu: gated_activation_merged(gu, "gelu_tanh"), fullgraph=True, backend="aot_eager"
    )
    got, want = fn(gate_up), gated_activation_merged(gate_up, "gelu_tanh")
    assert torch.equal(got, want)
    (g_c,) = torch.autograd.grad(got, gate_up, dout)
    (g_e,) = torch.autograd.grad(want, gate_up, dout)
    assert torch.equal(g_c, g_e)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", list(HF_ACTIVATIONS))
def test_gpu_merged_expert_sizes_match_transformers(activation):
    """A MoE layer's rows (8192 tokens x top 8) at an expert width of 768, bf16."""
    shape = (65536, 768)
    gate_up = make_merged(shape, torch.bfloat16)
    dout = torch.randn(shape, device=DEVICE)
    out = gated_activation_merged(gate_up, activation)
    (grad,) = torch.autograd.grad(out, gate_up, dout.to(out.dtype))
    gate, up = (t.detach().requires_grad_() for t in gate_up.chunk(2, -1))
    hf = output_and_grads(hf_eager(activation), gate, up, dout)
    ref = ground_truth(gate, up, activation, dout)
    assert_close_budget(out, ref[0], hf[0], torch.bfloat16, f"{activation} out")
    ref_grad, hf_grad = torch.cat(ref[1:], -1), torch.cat(hf[1:], -1)
    assert_close_budget(grad, ref_grad, hf_grad, torch.bfloat16, f"{activation} dgate_up")
