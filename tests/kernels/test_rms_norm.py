"""RMSNorm kernels against the fp64 reference and transformers' own RMSNorm modules.

CPU: the Triton kernels run through the interpreter (small shapes). ``gpu``-marked tests run real
sizes on the GPU machine (the CPU tests run there too, on CUDA tensors). Error budget
(``tests.utils.TOLERANCES``): against the fp64 reference, the kernel's error may exceed
transformers' eager module's error in the same dtype only by the TOLERANCES margin; against the
module itself the forward is equal but for rare elements an ulp or two apart (the same cast points,
another rsqrt and summation order).
"""

from __future__ import annotations

import pytest
import torch

from surgery.kernels import rms_norm, rms_norm_reference
from surgery.kernels.rms_norm import RmsNormLaunch, rms_norm_bwd, rms_norm_fwd
from surgery.models import SPECS
from tests.models.conftest import _one_cpu_thread  # noqa: F401  (autouse: tiny CPU ops, 1 thread)
from tests.utils import DEVICE, TOLERANCES, assert_close_budget, poisoned_empty, rel_err

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# Every RMSNorm class surgery patches, by architecture (the spec's short name): transformers' class
# and the spec's style. The tests below hold the style to the class's own forward, so a spec that
# misdescribes its norm fails here.
HF_NORMS = {spec.name: spec for spec in SPECS if spec.rms_norm is not None}
EPS = 1e-6


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def hf_norm(family: str, N: int, dtype: torch.dtype, device=DEVICE):
    """transformers' module with random weights around its own init (ones, or Gemma's zeros)."""
    spec = HF_NORMS[family]
    norm = spec.rms_norm_class()(N, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.add_(0.2 * torch.randn(N, device=device).to(dtype))
    return norm, spec.rms_norm_style.offset, spec.rms_norm_style.casting


def make_x(shape, dtype, device=DEVICE):
    # Rows of different scales: the normalisation must undo them.
    scale = torch.rand(*shape[:-1], 1, device=device) * 4 + 0.1
    return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()


def ground_truth(x, weight, offset, casting, dy):
    """fp64 output and gradients: every cast of the reference is exact in fp64."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y64 = rms_norm_reference(x64, w64, EPS, offset, casting)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    return y64, dx64, dw64


def output_and_grads(fn, x, weight, dy):
    y = fn(x, weight)
    dx, dw = torch.autograd.grad(y, (x, weight), dy.to(y.dtype))
    return y, dx, dw


def assert_within_ulps(y, want, what, ulps=2):
    """Equal but for rare differences of an ulp or two: the same cast points, with another rsqrt
    and summation order (an intermediate rounded one ulp apart can move the output by two)."""
    assert y.dtype == want.dtype and y.shape == want.shape, what
    assert torch.isfinite(y).all(), what
    w = want.float()
    _, exponent = torch.frexp(w)  # |w| in [2^(e-1), 2^e): one ulp is 2^(e-1) * eps
    ulp = torch.ldexp(torch.full_like(w, torch.finfo(want.dtype).eps), exponent - 1)
    diff = (y.float() - w).abs()
    assert (diff <= ulps * ulp).all(), f"{what}: {(diff / ulp).max():.1f} ulps apart"
    frac = (y != want).float().mean().item()
    assert frac <= 0.01, f"{what}: {frac:.2%} of the elements differ"


# ---------------------------------------------------------------------------------------------
# transformers' modules: forward (equal but for rare ulps) and gradients of input and weight.

SHAPES = [(37, 67), (37, 1000), (2, 3, 5, 64)]  # odd rows and widths; a (B, T, H, D) q/k shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("family", list(HF_NORMS))
def test_matches_transformers_module(family, shape, dtype):
    norm, offset, casting = hf_norm(family, shape[-1], dtype)
    x = make_x(shape, dtype)
    dy = torch.randn(shape, device=DEVICE)

    got = output_and_grads(lambda a, w: rms_norm(a, w, EPS, offset, casting), x, norm.weight, dy)
    hf = output_and_grads(lambda a, w: norm(a), x, norm.weight, dy)
    ref = ground_truth(x, norm.weight, offset, casting, dy)

    if dtype == torch.float32:
        tol = TOLERANCES[torch.float32]
        torch.testing.assert_close(got[0], hf[0], rtol=tol["rtol"], atol=tol["atol"])
    else:
        assert_within_ulps(got[0], hf[0], f"{family} forward")
    for what, g, r, h in zip(("y", "dx", "dw"), got, ref, hf):
        assert g.dtype == h.dtype, what
        assert_close_budget(g, r, h, dtype, f"{family} {what}")


# ---------------------------------------------------------------------------------------------
# Under torch.autocast, fp32 weights (an fp32 model under HF Trainer bf16=True): x in fp32 (the
# residual stream) or in the autocast dtype (Qwen3's and Gemma 3's q/k norms after an autocast
# projection). transformers' norms are elementwise, which autocast leaves alone: type promotion
# picks the output dtype (Llama's ``weight * normed.to(x.dtype)``: fp32; Gemma's ``.type_as(x)``:
# x's dtype).

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("x_dtype", ["fp32", "autocast"], ids=["x_fp32", "x_autocast"])
@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma3"])
def test_under_autocast_matches_transformers_module(family, name, x_dtype):
    dtype = AUTOCAST_DTYPES[name]
    norm, offset, casting = hf_norm(family, 67, torch.float32)
    x = make_x((37, 67), dtype if x_dtype == "autocast" else torch.float32)
    dy = torch.randn(37, 67, device=DEVICE)

    def ours(a, w):
        return rms_norm(a, w, EPS, offset, casting)

    plain = output_and_grads(ours, x, norm.weight, dy)
    with torch.autocast(DEVICE.type, dtype=dtype):
        got = output_and_grads(ours, x, norm.weight, dy)
        hf = output_and_grads(lambda a, w: norm(a), x, norm.weight, dy)
    ref = ground_truth(x, norm.weight, offset, casting, dy)

    want_dtype = torch.float32 if casting == "llama" else x.dtype
    assert got[0].dtype == hf[0].dtype == want_dtype
    for what, g, p, r, h in zip(("y", "dx", "dw"), got, plain, ref, hf):
        # Autocast changes nothing inside the kernel: the call without it, bit for bit.
        assert torch.equal(g, p), what
        assert g.dtype == h.dtype, what
        assert_close_budget(g, r, h, x.dtype, f"{family} {name} {x_dtype} {what}")


# ---------------------------------------------------------------------------------------------
# The reference, every dtype and both castings, a weight dtype other than x's.

REF_CASES = [
    # (shape, x dtype, weight dtype, offset, casting)
    ((37, 67), torch.float32, torch.float32, 0.0, "llama"),
    ((37, 1000), torch.bfloat16, torch.bfloat16, 0.0, "llama"),
    ((37, 1000), torch.float16, torch.float16, 1.0, "gemma"),
    ((37, 67), torch.bfloat16, torch.float32, 0.0, "llama"),  # fp32 weight: fp32 output
    ((37, 67), torch.bfloat16, torch.float32, 1.0, "gemma"),  # Gemma keeps x's dtype
    ((4, 9, 128), torch.float16, torch.float16, 0.5, "llama"),
]


def ref_id(case) -> str:
    shape, dt, wdt, offset, casting = case
    return f"{shape_id(shape)}-{DTYPE_NAMES[dt]}-w{DTYPE_NAMES[wdt]}-o{offset}-{casting}"


@pytest.mark.parametrize("case", REF_CASES, ids=ref_id)
def test_matches_reference(case):
    shape, dtype, w_dtype, offset, casting = case
    x = make_x(shape, dtype)
    weight = (torch.randn(shape[-1], device=DEVICE) * 0.3 + (1.0 - offset)).to(w_dtype)
    weight.requires_grad_()
    dy = torch.randn(shape, device=DEVICE)
    got = output_and_grads(lambda a, w: rms_norm(a, w, EPS, offset, casting), x, weight, dy)
    eager = output_and_grads(
        lambda a, w: rms_norm_reference(a, w, EPS, offset, casting), x, weight, dy
    )
    ref = ground_truth(x, weight, offset, casting, dy)
    want_dtype = torch.promote_types(dtype, w_dtype) if casting == "llama" else dtype
    assert got[0].dtype == want_dtype and got[1].dtype == dtype and got[2].dtype == w_dtype
    for what, g, r, e in zip(("y", "dx", "dw"), got, ref, eager):
        assert_close_budget(g, r, e, dtype, what)


# ---------------------------------------------------------------------------------------------
# Launch: poisoned outputs, several programs each looping over several row tiles.


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAMES.get)
def test_poisoned_outputs_and_multi_program_launch(dtype, casting):
    rows, N = 37, 67
    x = make_x((rows, N), dtype).detach()
    w = (torch.randn(N, device=DEVICE) * 0.3 + 1).to(dtype)
    dy = torch.randn(rows, N, device=DEVICE).to(dtype)
    y_want, rstd_want = rms_norm_fwd(x, w, EPS, 0.5, casting)
    dx_want, dw_want = rms_norm_bwd(dy, x, w, rstd_want, 0.5, casting)
    # 2 rows per tile (BLOCK_N = 128), 19 tiles over 3 programs: every program loops.
    launch = RmsNormLaunch(tile_elems=256, programs=3)
    y = poisoned_empty(rows, N, dtype=y_want.dtype)
    rstd = poisoned_empty(rows)
    rms_norm_fwd(x, w, EPS, 0.5, casting, launch=launch, out=(y, rstd))
    dx = poisoned_empty(rows, N, dtype=dtype)
    _, dw = rms_norm_bwd(dy, x, w, rstd, 0.5, casting, launch=launch, out=dx)
    torch.testing.assert_close(y, y_want, rtol=0, atol=0)
    torch.testing.assert_close(rstd, rstd_want, rtol=1e-6, atol=0)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(dx, dx_want, rtol=tol["rtol"], atol=tol["atol"])
    # Another split of the rows sums dw in another order; fp32 sums, one rounding at the end.
    assert rel_err(dw, dw_want) <= (1e-6 if dtype == torch.float32 else 8e-3)


# ---------------------------------------------------------------------------------------------
# Layouts, frozen weights, empty input.


def test_strided_rows_and_non_unit_last_stride():
    base = make_x((37, 100), torch.float32).detach()
    w = torch.randn(67, device=DEVICE)
    x = base[:, 10:77]  # row stride 100: read in place
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    xt = make_x((67, 37), torch.float32).detach().t()  # last dim stride 37: copied first
    torch.testing.assert_close(rms_norm(xt, w, EPS), rms_norm_reference(xt, w, EPS))


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_bf16_weight_gradient_is_its_fp32_sum_rounded_to_nearest(casting):
    """The weight gradient in bf16 is the kernel's fp32 column sum rounded once to nearest even,
    as a GPU rounds it, the interpreter too (it truncates a bare conversion): the same call with
    an fp32 weight, whose values the gradient does not read, gives that sum unrounded."""
    torch.manual_seed(0)
    x = (3.0 * torch.randn(64, 96, device=DEVICE)).bfloat16()
    offset = 1.0 if casting == "gemma" else 0.0
    w = (1.0 - offset + 0.3 * torch.randn(96, device=DEVICE)).bfloat16()
    dy = torch.randn(64, 96, device=DEVICE).bfloat16()
    _, rstd = rms_norm_fwd(x, w, EPS, offset, casting)
    _, dw = rms_norm_bwd(dy, x, w, rstd, offset, casting)
    _, dw_fp32 = rms_norm_bwd(dy, x, w.float(), rstd, offset, casting)
    assert dw.dtype == torch.bfloat16 and dw_fp32.dtype == torch.float32
    assert torch.equal(dw, dw_fp32.bfloat16())


def test_frozen_weight_gets_no_gradient():
    x = make_x((2, 5, 67), torch.bfloat16)
    norm, offset, casting = hf_norm("qwen3", 67, torch.bfloat16)
    norm.weight.requires_grad_(False)
    dy = torch.randn(2, 5, 67, device=DEVICE, dtype=torch.bfloat16)
    y = rms_norm(x, norm.weight, EPS, offset, casting)
    (y * dy).sum().backward()
    assert norm.weight.grad is None
    (hf_dx,) = torch.autograd.grad(norm(x), x, dy)
    _, ref_dx, _ = ground_truth(x, norm.weight, offset, casting, dy)
    assert_close_budget(x.grad, ref_dx, hf_dx, torch.bfloat16, "dx")


def test_empty_rows():
    x = torch.empty(0, 3, 64, device=DEVICE, requires_grad=True)
    w = torch.ones(64, device=DEVICE, requires_grad=True)
    y = rms_norm(x, w, EPS)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "kwargs", "error"),
    [
        ((4, 8), (7,), {}, ValueError),
        ((4, 8), (2, 4), {}, ValueError),
        ((4, 8), (8,), {"casting": "fp32"}, ValueError),
        ((4, 8), (8,), {"eps": -1.0}, ValueError),
    ],
    ids=["width", "weight-2d", "casting", "eps"],
)
def test_bad_input_raises(x_shape, w_shape, kwargs, error):
    x, w = torch.randn(x_shape, device=DEVICE), torch.randn(w_shape, device=DEVICE)
    args = {"eps": EPS, **kwargs}
    with pytest.raises(error):
        rms_norm(x, w, **args)
    with pytest.raises(TypeError):
        rms_norm(x.double(), torch.randn(8, device=DEVICE), EPS)


# ---------------------------------------------------------------------------------------------
# torch.library registration: schema, fake tensors, autograd, and tracing with fullgraph=True.


def test_ops_pass_opcheck():
    x = torch.randn(5, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(24, device=DEVICE, requires_grad=True)
    ops = torch.ops.surgery
    torch.library.opcheck(ops.rms_norm_fwd.default, (x, w, EPS, 1.0, "gemma"))
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    xb = x.detach().bfloat16()
    torch.library.opcheck(ops.rms_norm_fwd.default, (xb, w, EPS, 0.0, "llama"), test_utils=quick)
    _, rstd = ops.rms_norm_fwd(x.detach(), w.detach(), EPS, 0.0, "llama")
    dy = torch.randn(5, 24, device=DEVICE)
    args = (dy, x.detach(), w.detach(), rstd, 0.0, "llama")
    torch.library.opcheck(ops.rms_norm_bwd.default, (*args, True), test_utils=quick)
    torch.library.opcheck(ops.rms_norm_bwd.default, (*args, False), test_utils=quick)


def test_traces_with_fullgraph_on_cpu():
    # Inductor needs a compiler on CPU; aot_eager still checks fake tensors and the graph.
    x = make_x((2, 3, 40), torch.bfloat16)
    w = torch.randn(40, device=DEVICE, requires_grad=True)
    fn = torch.compile(lambda a, b: rms_norm(a, b, EPS, 1.0, "gemma"), fullgraph=True,
                       backend="aot_eager")  # fmt: skip
    got, want = fn(x, w), rms_norm(x, w, EPS, 1.0, "gemma")
    assert torch.equal(got, want)
    dy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: real sizes (8192 rows of 2048/4096; q/k norms over (2, 4096, 32, 128)), compile, graphs.

REAL = [
    ("llama", (8192, 2048)),
    ("llama", (8192, 4096)),
    ("gemma3", (8192, 2048)),
    ("gemma2", (8192, 4096)),
    ("qwen3", (2, 4096, 32, 128)),  # q/k norms over the head dim
    ("gemma3", (2, 4096, 8, 256)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family", "shape"), REAL, ids=lambda v: v if isinstance(v, str) else shape_id(v)
)
def test_gpu_real_sizes_match_transformers(family, shape):
    dtype = torch.bfloat16
    norm, offset, casting = hf_norm(family, shape[-1], dtype)
    x = make_x(shape, dtype)
    dy = torch.randn(shape, device=DEVICE)
    got = output_and_grads(lambda a, w: rms_norm(a, w, EPS, offset, casting), x, norm.weight, dy)
    hf = output_and_grads(lambda a, w: norm(a), x, norm.weight, dy)
    ref = ground_truth(x, norm.weight, offset, casting, dy)
    assert_within_ulps(got[0], hf[0], f"{family} forward")
    for what, g, r, h in zip(("y", "dx", "dw"), got, ref, hf):
        assert_close_budget(g, r, h, dtype, f"{family} {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpu_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    norm, offset, casting = hf_norm("llama", 2048, torch.bfloat16)

    def block(a, w):
        h = rms_norm(a, w, EPS, offset, casting)
        return (h.float().square().sum() * 1e-3, h)

    x = make_x((2, 1024, 2048), torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    loss_c, y_c = compiled(x, norm.weight)
    g_c = torch.autograd.grad(loss_c, (x, norm.weight))
    loss_e, y_e = block(x, norm.weight)
    g_e = torch.autograd.grad(loss_e, (x, norm.weight))
    assert torch.equal(y_c, y_e)
    assert rel_err(g_c[0], g_e[0]) < 1e-2 and rel_err(g_c[1], g_e[1]) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    x = make_x((4096, 2048), torch.bfloat16).detach()
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y, rstd = rms_norm_fwd(x, w, EPS)  # compile and warm up outside the capture
        rms_norm_bwd(dy, x, w, rstd)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, rstd = rms_norm_fwd(x, w, EPS)
        dx, dw = rms_norm_bwd(dy, x, w, rstd)
    x.copy_(torch.randn_like(x))
    graph.replay()
    y_want, rstd_want = rms_norm_fwd(x, w, EPS)
    dx_want, dw_want = rms_norm_bwd(dy, x, w, rstd_want)
    assert torch.equal(y, y_want) and torch.equal(dx, dx_want) and torch.equal(dw, dw_want)
