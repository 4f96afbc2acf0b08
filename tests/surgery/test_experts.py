"""Mixture-of-experts experts through surgery's experts implementation
(``surgery.forwards.experts``): against transformers' own implementations (its ``grouped_mm`` and
its eager loop) on every architecture of the registry whose experts dispatch through them, what the
backward keeps, the ``experts_implementation`` option, ``unpatch`` and ``describe``.

The architectures are derived from the registry: every spec whose tiny model has experts modules,
plus Gemma 4 with its mixture of experts (``GEMMA4_MOE_ARGUMENTS``; its tiny model is dense).
Llama 4's experts are a module of their own (``ArchitectureSpec.batched_experts``), not
dispatched through transformers' experts implementations: surgery swaps their forward, checked
against the class's own at the end.
"""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations import moe as transformers_moe

import surgery
from surgery.forwards import experts as surgery_experts
from surgery.forwards.experts import EXPERTS_PLAN_ATTR, SURGERY_EXPERTS
from surgery.patching.experts_install import experts_modules
from surgery.patching.swap import is_swapped
from tests.models.tiny import (
    ARCHS,
    SPECS,
    causal_lm_from_config,
    gemma4_moe_config,
    loss_and_grads,
    padded_batch,
    sequences,
    tiny_config,
    twin,
)
from tests.utils import DEVICE, assert_close_budget
from tests.utils import FP32_CLOSE as TOL

GEMMA4_MOE = "gemma4_text+moe"


def moe_config(case: str, **overrides):
    if case == GEMMA4_MOE:
        return gemma4_moe_config(**overrides)
    return tiny_config(case, **overrides)


def has_experts(case: str) -> bool:
    with torch.device("meta"):
        return bool(experts_modules(causal_lm_from_config(moe_config(case))))


CASES = [arch for arch in ARCHS if has_experts(arch)] + [GEMMA4_MOE]


def build(case: str, dtype=torch.float32, seed: int = 0, **config):
    """The tiny model of ``case``, its experts' weights O(1) (transformers' init makes their
    outputs tiny, where an absolute tolerance would hide an error)."""
    torch.manual_seed(seed)
    cfg = moe_config(case, **config)
    model = causal_lm_from_config(cfg, dtype=dtype, attn_implementation="sdpa").train()
    with torch.no_grad():
        for module in experts_modules(model) + llama4_experts(model):
            for w in (module.gate_up_proj, module.down_proj):
                w.copy_(torch.randn_like(w) / w.shape[-1] ** 0.5)
    return model.to(DEVICE)


def llama4_experts(model) -> list:
    """The modules of ``model`` that are Llama 4's batched experts."""
    spec = SPECS["llama4_text"]
    return [m for m in model.modules() if spec.is_instance(m, spec.batched_experts)]


def routing(tokens: int, num_experts: int, top_k: int, experts=None, seed: int = 1):
    """Distinct experts per token (among ``experts`` when given: the others get no row) and
    positive routing weights, both as a router makes them."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if experts is None else torch.tensor(experts)
    scores = torch.rand(tokens, len(pool), generator=g)
    index = pool[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return index.to(DEVICE), weights.to(DEVICE)


def experts_call(module, fn, hidden, index, weights, dout):
    """Output of ``fn(module, hidden, index, weights)`` and the gradients of the input, the
    routing weights and both expert weights."""
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = fn(module, hidden, index, weights)
    out.backward(dout.to(out.dtype))
    return {
        "out": out.detach(),
        "hidden": hidden.grad,
        "weights": weights.grad,
        "gate_up_proj": module.gate_up_proj.grad.clone(),
        "down_proj": module.down_proj.grad.clone(),
    }


def dispatched(module, hidden, index, weights):
    """The module's own call: transformers' dispatch on its config's implementation."""
    return module(hidden, index, weights)


def transformers_grouped_mm(module, hidden, index, weights):
    return transformers_moe.grouped_mm_experts_forward(module, hidden, index, weights)


def transformers_eager(module, hidden, index, weights):
    """The experts class's own loop (the forward ``use_experts_implementation`` wraps)."""
    return type(module).forward.__wrapped__(module, hidden, index, weights)


def inputs_for(module, tokens=37, top_k=2, experts=None, dtype=torch.float32):
    hidden_size = module.gate_up_proj.shape[-1]
    index, weights = routing(tokens, module.num_experts, top_k, experts)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(DEVICE, dtype)
    dout = torch.randn(tokens, hidden_size, generator=g).to(DEVICE)
    return hidden, index, weights.to(dtype), dout


def assert_same(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


# ---------------------------------------------------------------------------------------------
# every architecture: transformers' grouped_mm and eager loop, fp32


@pytest.mark.parametrize("case", CASES)
def test_experts_match_transformers_implementations(case):
    """The patched model's experts (dispatched by transformers to ``surgery_grouped_mm``): output
    and the gradients of input, routing weights and both expert weights equal transformers'
    ``grouped_mm`` and eager loop on the same module, with every expert used and with experts
    that get no row."""
    model = surgery.patch(build(case))
    assert model.config._experts_implementation == SURGERY_EXPERTS
    modules = experts_modules(model)
    assert modules and all(EXPERTS_PLAN_ATTR in m.__dict__ for m in modules)
    module = modules[0]
    top_k = min(2, module.num_experts)
    for experts in (None, [0, module.num_experts - 1]):
        hidden, index, weights, dout = inputs_for(module, top_k=top_k, experts=experts)
        got = experts_call(module, dispatched, hidden, index, weights, dout)
        for fn in (transformers_grouped_mm, transformers_eager):
            want = experts_call(module, fn, hidden, index, weights, dout)
            assert_same(got, want, f"{case} {fn.__name__} experts={experts}")


def test_without_a_torch_grouped_gemm(monkeypatch):
    """Where torch has no grouped GEMM for the device (CPU before torch 2.9, older GPUs),
    transformers runs the groups through its per-expert loop op: surgery's experts too, with the
    same results."""
    model = surgery.patch(build("mixtral"))
    module = experts_modules(model)[0]
    monkeypatch.setattr(transformers_moe, "_can_use_grouped_mm", lambda *args: False)

    def refuse(*args, **kwargs):
        raise AssertionError("torch's grouped GEMM ran")

    for where, name in ((torch.nn.functional, "grouped_mm"), (torch, "_grouped_mm")):
        if hasattr(where, name):
            monkeypatch.setattr(where, name, refuse)
    hidden, index, weights, dout = inputs_for(module)
    got = experts_call(module, dispatched, hidden, index, weights, dout)
    want = experts_call(module, transformers_eager, hidden, index, weights, dout)
    assert_same(got, want, "fallback")


def test_transposed_weights_match_grouped_mm():
    """Experts whose weights are stored (experts, in, out) (``is_transposed``): the same as
    transformers' grouped_mm on them, the backward's GEMMs on the other side included."""
    model = surgery.patch(build("qwen3_moe"))
    module = experts_modules(model)[0]
    hidden, index, weights, dout = inputs_for(module)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(weight.transpose(1, 2).contiguous()))
    module.is_transposed = True
    got = experts_call(module, dispatched, hidden, index, weights, dout)
    want = experts_call(module, transformers_grouped_mm, hidden, index, weights, dout)
    assert_same(got, want, "transposed")


@pytest.mark.parametrize("case", CASES)
def test_patched_step_matches_grouped_mm_experts(case):
    """A training step (loss and every gradient, router aux loss included where the model has
    one) with surgery's experts equals the same patched model with transformers' grouped_mm."""
    model = build(case)
    reference = twin(model)
    surgery.patch(model)
    surgery.patch(reference, experts_implementation="grouped_mm")
    assert reference.config._experts_implementation == "grouped_mm"
    batch = padded_batch(sequences([7, 5, 3])).to(DEVICE).kwargs()
    if SPECS[model.config.model_type].router_aux_loss:
        batch["output_router_logits"] = True
    (loss, grads), (want, want_grads) = (loss_and_grads(m, **batch) for m in (model, reference))
    torch.testing.assert_close(loss, want, **TOL)
    assert_same(grads, want_grads, case)


# ---------------------------------------------------------------------------------------------
# the Triton kernel (interpreter on CPU), half precision


@pytest.mark.parametrize("case", ["qwen3_moe", GEMMA4_MOE])  # SwiGLU and GeGLU (tanh)
def test_triton_path_matches_grouped_mm(case, interpreted, monkeypatch):
    """The experts through the Triton kernel itself (the PyTorch path would raise)."""
    kernel_module = importlib.import_module("surgery.kernels.gated_activation.launch")

    def refuse(*args):
        raise AssertionError("the PyTorch path ran, not the Triton kernel")

    monkeypatch.setattr(kernel_module, "_merged_fwd_torch", refuse)
    monkeypatch.setattr(kernel_module, "_merged_bwd_torch", refuse)
    model = surgery.patch(build(case))
    module = experts_modules(model)[0]
    hidden, index, weights, dout = inputs_for(module, tokens=13)
    got = experts_call(module, dispatched, hidden, index, weights, dout)
    want = experts_call(module, transformers_grouped_mm, hidden, index, weights, dout)
    assert_same(got, want, case)


@pytest.mark.parametrize("case", ["mixtral", GEMMA4_MOE])
def test_bf16_within_transformers_error_budget(case):
    """bf16: against transformers' eager loop in fp64 on the same weights, the error is within
    the budget of transformers' own grouped_mm in bf16 (one rounding of act(gate) * up instead of
    two)."""
    model = surgery.patch(build(case, dtype=torch.bfloat16))
    module = experts_modules(model)[0]
    hidden, index, weights, dout = inputs_for(module, dtype=torch.bfloat16)
    got = experts_call(module, dispatched, hidden, index, weights, dout)
    bf16 = experts_call(module, transformers_grouped_mm, hidden, index, weights, dout)
    reference = twin(module).double()
    want = experts_call(
        reference, transformers_eager, hidden.double(), index, weights.double(), dout.double()
    )
    for name, w in want.items():
        assert_close_budget(got[name], w, bf16[name], torch.bfloat16, f"{case} {name}")


# ---------------------------------------------------------------------------------------------
# what the backward keeps


class GemmSpy:
    """Weak references to the input and output of every grouped GEMM the experts run."""

    def __init__(self, grouped_linear):
        self.inner = grouped_linear
        self.calls: list[tuple[weakref.ref, weakref.ref]] = []

    def __call__(self, input, weight, offs, *args, **kwargs):
        out = self.inner(input, weight, offs, *args, **kwargs)
        self.calls.append((weakref.ref(input), weakref.ref(out)))
        return out

    def alive(self) -> list[tuple[bool, bool]]:
        gc.collect()
        return [(i() is not None, o() is not None) for i, o in self.calls]


def kept_after_forward(module, fn, monkeypatch, where) -> list[tuple[bool, bool]]:
    spy = GemmSpy(where._grouped_linear)
    monkeypatch.setattr(where, "_grouped_linear", spy)
    hidden, index, weights, _ = inputs_for(module)
    hidden.requires_grad_()
    out = fn(module, hidden, index, weights.requires_grad_())  # the graph stays alive
    kept = spy.alive()
    out.sum().backward()
    monkeypatch.undo()
    return kept


@pytest.mark.parametrize("recompute_mlp_product", [True, False])
def test_gathered_rows_product_and_down_output_are_not_kept(recompute_mlp_product, monkeypatch):
    """After the forward, transformers' grouped_mm keeps the gathered rows (the up GEMM's input),
    the product (the down GEMM's input) and the down GEMM's output (for the routing weights'
    gradient); surgery's keeps none of them (the product only without ``recompute_mlp_product``),
    only the up GEMM's output, for the activation's backward."""
    model = surgery.patch(build("qwen3_moe"), recompute_mlp_product=recompute_mlp_product)
    module = experts_modules(model)[0]
    theirs = kept_after_forward(module, transformers_grouped_mm, monkeypatch, transformers_moe)
    assert [kept_input for kept_input, _ in theirs] == [True, True]  # the probe sees them
    ours = kept_after_forward(module, dispatched, monkeypatch, surgery_experts)
    assert ours == [(False, True), (not recompute_mlp_product, False)]


def test_checkpointed_recomputation_stops_before_the_down_gemm(monkeypatch):
    """Under non-reentrant checkpointing (FSDP2's, accelerate's) the experts' recomputation stops
    once every tensor they saved is back: it reruns the up GEMM, not the down GEMM that ends them
    (as transformers' grouped_mm, whose products save their inputs before running, does not)."""
    from torch.utils.checkpoint import checkpoint

    model = surgery.patch(build("qwen3_moe"))
    module = experts_modules(model)[0]
    spy = GemmSpy(surgery_experts._grouped_linear)
    monkeypatch.setattr(surgery_experts, "_grouped_linear", spy)
    hidden, index, weights, dout = inputs_for(module)
    hidden.requires_grad_()
    products = {}
    for checkpointed in (False, True):
        if checkpointed:
            out = checkpoint(dispatched, module, hidden, index, weights, use_reentrant=False)
        else:
            out = dispatched(module, hidden, index, weights)
        before = len(spy.calls)
        out.backward(dout)
        products[checkpointed] = len(spy.calls) - before
    assert products[True] == products[False] + 1  # the up GEMM, recomputed


class KeptBytes(TorchDispatchMode):
    """Bytes of the storages that a forward's ops created and that are still alive: what its
    graph keeps for the backward, once the forward's locals are gone."""

    def __init__(self):
        super().__init__()
        self.created: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.created.append(weakref.ref(t))
        return out

    def alive(self, *exclude: torch.Tensor) -> int:
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        storages = {}
        for ref in self.created:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in skip:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def saved_bytes(module, fn, hidden, index, weights) -> int:
    hidden, weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    with KeptBytes() as mode:
        out = fn(module, hidden, index, weights)
    kept = mode.alive(out, hidden, weights, *module.parameters())
    out.sum().backward()
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_bytes_per_layer(dtype):
    """What one experts layer keeps for the backward: transformers' grouped_mm keeps, per row
    (token x top_k), the gathered row (hidden), the up GEMM's output (2 x width), act(gate) and
    the product (width each) and the down GEMM's output (hidden); surgery's only the up GEMM's
    output: (rows x 2 (hidden + width)) values fewer, the down GEMM's output included."""
    hidden_size, width, top_k = 64, 32, 2  # width: wider than what is kept per row besides
    model = build("qwen3_moe", dtype, hidden_size=hidden_size, moe_intermediate_size=width)
    module = experts_modules(surgery.patch(model))[0]
    hidden, index, weights, _ = inputs_for(module, top_k=top_k, dtype=dtype)
    theirs = saved_bytes(module, transformers_grouped_mm, hidden, index, weights)
    ours = saved_bytes(module, dispatched, hidden, index, weights)
    rows, size = hidden.shape[0] * top_k, dtype.itemsize
    assert theirs - ours >= rows * 2 * (hidden_size + width) * size
    # Besides the up GEMM's output, only row indices and routing weights: less than one value
    # per row and width (a product, act(gate) or down GEMM output kept would be more).
    gate_up = rows * 2 * width * size
    assert gate_up <= ours < gate_up + rows * width * size


class IndexPuts(TorchDispatchMode):
    """The index_put ops (scatters) run under it whose values are rows (2-D or more)."""

    def __init__(self):
        super().__init__()
        self.row_scatters: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "index_put" in func.name() and args[2].dim() >= 2:
            self.row_scatters.append(func.name())
        return func(*args, **(kwargs or {}))


def test_backward_gathers_the_routed_rows():
    """The backward of the gather of the token rows and of the per-token sum at the end are
    gathers, each the other's adjoint: no scatter of (tokens x top_k) rows into zeros, which
    autograd runs for an index (atomics and a zero fill on a GPU) and transformers' grouped_mm
    runs twice; the gradients stay transformers' (``test_experts_match_transformers_...``)."""
    module = experts_modules(surgery.patch(build("qwen3_moe")))[0]
    hidden, index, weights, dout = inputs_for(module)
    scatters = {}
    for name, fn in (("theirs", transformers_grouped_mm), ("ours", dispatched)):
        out = fn(module, hidden.detach().requires_grad_(), index, weights.requires_grad_())
        with IndexPuts() as mode:
            out.backward(dout)
        scatters[name] = mode.row_scatters
    assert len(scatters["theirs"]) == 2  # the probe sees them
    assert scatters["ours"] == []


def assert_compiled_step_rebuilds_and_keeps_less(dtype: torch.dtype) -> None:
    from tests.surgery.test_compile import GraphRecorder, transformers_hooks_installed

    batch = padded_batch(sequences([9, 6, 3])).to(DEVICE).kwargs()
    saved = {}
    for implementation in ("auto", "grouped_mm"):
        torch._dynamo.reset()
        model = surgery.patch(build("qwen3_moe", dtype), experts_implementation=implementation)
        transformers_hooks_installed(model, batch)
        recorder = GraphRecorder()
        model.compile(backend=recorder, fullgraph=True)
        loss_and_grads(model, **batch)
        saved[implementation] = recorder.saved_bytes()
        rebuilt = recorder.ops(recorder.backward).count(
            "surgery.gated_activation_merged_fwd.default"
        )
        assert rebuilt == (len(experts_modules(model)) if implementation == "auto" else 0)
    torch._dynamo.reset()
    config = model.config
    rows = batch["input_ids"].numel() * config.num_experts_per_tok
    per_layer = rows * (2 * config.hidden_size + config.moe_intermediate_size) * dtype.itemsize
    assert saved["grouped_mm"] - saved["auto"] >= len(experts_modules(model)) * per_layer


@pytest.mark.skipif(
    not hasattr(torch.ops.transformers, "grouped_mm_fallback_backward"),
    reason="this transformers' grouped GEMM fallback (fp32 on CPU under torch.compile) has a "
    "backward the compiler cannot trace, for its own grouped_mm too (later releases make it an op)",
)
def test_compiled_step_rebuilds_and_keeps_less():
    """Under ``torch.compile`` (fullgraph, inductor's partitioner) the backward rebuilds the
    product and regathers the rows, and has no down GEMM output to receive: at least
    (rows x (2 hidden + expert width)) fp32 values fewer per MoE layer than with transformers'
    grouped_mm compiled (whose act(gate) the partitioner already recomputes)."""
    assert_compiled_step_rebuilds_and_keeps_less(torch.float32)


@pytest.mark.gpu
def test_gpu_compiled_step_rebuilds_and_keeps_less():
    """The same in bf16 with torch's grouped GEMM, on the GPU machine's torch (whose partitioner
    kept the rows an autograd.Function gathered inside the rebuild's checkpoint region)."""
    assert_compiled_step_rebuilds_and_keeps_less(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the option, unpatch, describe


def marked(model) -> int:
    return sum(EXPERTS_PLAN_ATTR in m.__dict__ for m in model.modules())


def test_default_fuses_grouped_mm_and_unpatch_restores():
    model = build("qwen3_moe")
    assert model.config._experts_implementation == "grouped_mm"
    surgery.patch(model)
    assert surgery.patch_options(model).experts_implementation == "auto"
    assert model.config._experts_implementation == SURGERY_EXPERTS and marked(model) == 1
    surgery.patch(model)  # idempotent
    assert model.config._experts_implementation == SURGERY_EXPERTS and marked(model) == 1
    surgery.unpatch(model)
    assert model.config._experts_implementation == "grouped_mm" and marked(model) == 0
    assert not any(k.startswith("_surgery") for k in model.__dict__)


@pytest.mark.parametrize("chosen", ["batched_mm", "eager"])
def test_default_keeps_another_implementation(chosen):
    """``"auto"`` fuses only where the model runs grouped_mm: a choice of the user's stays."""
    model = build("mixtral")
    model.set_experts_implementation(chosen)
    surgery.patch(model)
    assert model.config._experts_implementation == chosen and marked(model) == 0
    surgery.unpatch(model)
    assert model.config._experts_implementation == chosen


@pytest.mark.parametrize(
    ("option", "want", "fused"),
    [
        (None, "eager", False),
        ("grouped_mm", "grouped_mm", False),
        (SURGERY_EXPERTS, SURGERY_EXPERTS, True),
    ],
)
def test_explicit_values(option, want, fused):
    """None leaves the model's own; a name of transformers' sets it (nothing fused); surgery's
    name fuses whatever the model ran before; unpatch puts the model's back."""
    model = build("qwen2_moe")
    model.set_experts_implementation("eager")
    surgery.patch(model, experts_implementation=option)
    assert model.config._experts_implementation == want
    assert marked(model) == (len(experts_modules(model)) if fused else 0)
    # and again with other options: the first patch is undone first
    surgery.patch(model, experts_implementation=option, z_loss_scale=1e-4)
    assert model.config._experts_implementation == want
    surgery.unpatch(model)
    assert model.config._experts_implementation == "eager" and marked(model) == 0


def test_bad_values_change_nothing():
    model = build("qwen3_moe")
    with pytest.raises(ValueError, match="not supported"):
        surgery.patch(model, experts_implementation="no_such_implementation")
    assert not surgery.is_patched(model)
    assert model.config._experts_implementation == "grouped_mm" and marked(model) == 0
    with pytest.raises(TypeError, match="experts_implementation"):
        surgery.patch(model, experts_implementation=1)
    dense = build("llama")
    surgery.patch(dense)  # "auto": nothing to do on a dense model
    assert not any(k.startswith("_surgery_experts") for k in dense.__dict__)
    surgery.unpatch(dense)
    with pytest.raises(ValueError, match="no experts implementations"):
        surgery.patch(dense, experts_implementation=SURGERY_EXPERTS)
    assert not surgery.is_patched(dense)


def test_activation_without_kernel_is_left_to_transformers():
    """Exact GELU (erf) is not the kernel's math: ``"auto"`` leaves grouped_mm, surgery's name
    warns and runs transformers' grouped_mm, and ``describe`` says why."""
    model = build("qwen3_moe", hidden_act="gelu")
    surgery.patch(model, gated_mlp=False)
    assert model.config._experts_implementation == "grouped_mm" and marked(model) == 0
    report = surgery.describe(model)
    assert any(
        g.cls == "Qwen3MoeExperts" and "no gated_activation kernel for 'gelu'" in g.what
        for g in report.left_alone
    )
    surgery.unpatch(model)
    with pytest.warns(UserWarning, match="fuses none"):
        surgery.patch(model, gated_mlp=False, experts_implementation=SURGERY_EXPERTS)
    module = experts_modules(model)[0]
    hidden, index, weights, dout = inputs_for(module)
    got = experts_call(module, dispatched, hidden, index, weights, dout)
    want = experts_call(module, transformers_eager, hidden, index, weights, dout)
    assert_same(got, want, "gelu")


def test_describe_reports_the_experts():
    model = surgery.patch(build("qwen3_moe"))
    report = surgery.describe(model)
    fused = [g for g in report.patched if g.cls == "Qwen3MoeExperts"]
    assert len(fused) == 1 and fused[0].count == 1
    assert SURGERY_EXPERTS in fused[0].what and "(silu)" in fused[0].what
    surgery.patch(model, experts_implementation="grouped_mm")
    report = surgery.describe(model)
    assert not any(g.cls == "Qwen3MoeExperts" for g in report.patched)
    assert any(g.cls == "Qwen3MoeExperts" and "'grouped_mm'" in g.what for g in report.left_alone)


# ---------------------------------------------------------------------------------------------
# Llama 4's batched experts: a swapped forward, against the class's own


def llama4_inputs(module, tokens=13, dtype=torch.float32):
    """The experts' input as Llama 4's MoE block makes it (every token once per expert, scaled by
    its sigmoid routing weight: zero where the top-1 router did not pick the expert) and an
    output gradient."""
    g = torch.Generator().manual_seed(3)
    experts, hidden_size = module.num_experts, module.hidden_size
    hidden = torch.randn(tokens, hidden_size, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    top, picked = logits.topk(1, dim=-1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, picked, top).sigmoid()
    routed = hidden.repeat(experts, 1) * scores.t().reshape(-1, 1)
    dout = torch.randn(experts * tokens, hidden_size, generator=g)
    return routed.to(DEVICE, dtype), dout.to(DEVICE)


def llama4_call(module, fn, routed, dout) -> dict:
    routed = routed.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = fn(module, routed)
    out.backward(dout.to(out.dtype))
    return {
        "out": out.detach(),
        "hidden": routed.grad,
        "gate_up_proj": module.gate_up_proj.grad.clone(),
        "down_proj": module.down_proj.grad.clone(),
    }


def llama4_patched(module, routed):
    return module(routed)


def llama4_own(module, routed):
    return type(module).forward(module, routed)


@pytest.mark.parametrize("recompute_mlp_product", [True, False])
def test_llama4_experts_match_their_forward(recompute_mlp_product):
    """fp32: the swapped forward's output and the gradients of its input and both expert weights
    equal ``Llama4TextExperts.forward``'s on the same module."""
    model = surgery.patch(build("llama4_text"), recompute_mlp_product=recompute_mlp_product)
    modules = llama4_experts(model)
    assert modules and all(is_swapped(m) and EXPERTS_PLAN_ATTR in m.__dict__ for m in modules)
    routed, dout = llama4_inputs(modules[0])
    got = llama4_call(modules[0], llama4_patched, routed, dout)
    want = llama4_call(modules[0], llama4_own, routed, dout)
    assert_same(got, want, "llama4")


def test_llama4_triton_path_matches_their_forward(interpreted, monkeypatch):
    kernel_module = importlib.import_module("surgery.kernels.gated_activation.launch")

    def refuse(*args):
        raise AssertionError("the PyTorch path ran, not the Triton kernel")

    monkeypatch.setattr(kernel_module, "_merged_fwd_torch", refuse)
    monkeypatch.setattr(kernel_module, "_merged_bwd_torch", refuse)
    module = llama4_experts(surgery.patch(build("llama4_text")))[0]
    routed, dout = llama4_inputs(module, tokens=5)
    got = llama4_call(module, llama4_patched, routed, dout)
    want = llama4_call(module, llama4_own, routed, dout)
    assert_same(got, want, "llama4 triton")


def test_llama4_patched_step_matches_their_experts():
    """A training step (loss and every gradient) with the batched experts swapped equals the same
    patched model with ``experts_implementation=None`` (their own forward)."""
    model = build("llama4_text")
    reference = twin(model)
    surgery.patch(model)
    surgery.patch(reference, experts_implementation=None)
    assert llama4_experts(model)[0].__dict__.get(EXPERTS_PLAN_ATTR) is not None
    assert not any(is_swapped(m) for m in llama4_experts(reference))
    batch = padded_batch(sequences([7, 5, 3])).to(DEVICE).kwargs()
    (loss, grads), (want, want_grads) = (loss_and_grads(m, **batch) for m in (model, reference))
    torch.testing.assert_close(loss, want, **TOL)
    assert_same(grads, want_grads, "llama4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama4_saved_bytes(dtype):
    """The class's forward keeps, per row (experts x tokens), the up GEMM's output (2 x width),
    act(gate) and the product (width each); the swapped one only the up GEMM's output."""
    module = llama4_experts(surgery.patch(build("llama4_text", dtype)))[0]
    routed, _ = llama4_inputs(module, dtype=dtype)

    def kept(fn) -> int:
        x = routed.detach().requires_grad_()
        with KeptBytes() as mode:
            out = fn(module, x)
        alive = mode.alive(out, x, *module.parameters())
        out.sum().backward()
        return alive

    rows, width, size = routed.shape[0], module.expert_dim, dtype.itemsize
    theirs, ours = kept(llama4_own), kept(llama4_patched)
    assert ours == rows * 2 * width * size
    assert theirs - ours >= rows * 2 * width * size


def test_llama4_option_unpatch_and_describe():
    """``"auto"`` and surgery's name swap the experts' forward, None leaves it; ``describe`` says
    which; ``unpatch`` puts the class's forward back with nothing left on the module."""
    model = build("llama4_text")
    module = llama4_experts(model)[0]
    before = set(module.__dict__)
    for option in ("auto", SURGERY_EXPERTS):
        surgery.patch(model, experts_implementation=option)
        assert is_swapped(module) and marked(model) == 1
        fused = [g for g in surgery.describe(model).patched if g.cls == "Llama4TextExperts"]
        assert len(fused) == 1 and "gated_activation_merged (silu)" in fused[0].what
        surgery.unpatch(model)
        assert not is_swapped(module) and marked(model) == 0 and set(module.__dict__) == before
        assert "forward" not in module.__dict__
    surgery.patch(model, experts_implementation=None)
    assert not is_swapped(module) and marked(model) == 0
    left = [g for g in surgery.describe(model).left_alone if g.cls == "Llama4TextExperts"]
    assert len(left) == 1 and "experts_implementation=None" in left[0].what
    surgery.unpatch(model)
    assert not experts_modules(model)  # transformers' dispatch never involved


def test_llama4_activation_without_kernel_keeps_their_forward():
    model = build("llama4_text", hidden_act="gelu")
    surgery.patch(model, gated_mlp=False)
    assert marked(model) == 0
    left = [g for g in surgery.describe(model).left_alone if g.cls == "Llama4TextExperts"]
    assert len(left) == 1 and "no gated_activation kernel for 'gelu'" in left[0].what
    surgery.unpatch(model)
    with pytest.warns(UserWarning, match="Llama4TextExperts"):
        surgery.patch(model, gated_mlp=False, experts_implementation=SURGERY_EXPERTS)
    assert marked(model) == 0


# ---------------------------------------------------------------------------------------------
# GPU: a Qwen3-30B-A3B-shaped layer (hidden 2048, 64 experts, top 8, width 768), bf16


def qwen3_moe_layer_experts():
    model = build(
        "qwen3_moe",
        dtype=torch.bfloat16,
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=64,
        num_experts_per_tok=8,
        num_hidden_layers=1,
    )
    surgery.patch(model)
    return experts_modules(model)[0]


@pytest.mark.gpu
def test_gpu_real_layer_within_budget_and_keeps_less():
    """8192 tokens: surgery's experts within bf16's budget of transformers' grouped_mm against an
    fp32 reference, and after the forward at least rows x 2 (hidden + width) bf16 values fewer
    allocated (the gathered rows, act(gate), the product and the down GEMM's output)."""
    module = qwen3_moe_layer_experts()
    hidden, index, weights, dout = inputs_for(module, tokens=8192, top_k=8, dtype=torch.bfloat16)
    got = experts_call(module, dispatched, hidden, index, weights, dout)
    bf16 = experts_call(module, transformers_grouped_mm, hidden, index, weights, dout)
    reference = twin(module).float()
    want = experts_call(
        reference, transformers_grouped_mm, hidden.float(), index, weights.float(), dout
    )
    for name, w in want.items():
        assert_close_budget(got[name], w, bf16[name], torch.bfloat16, name)
    del reference

    def kept(fn):
        x, w = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn(module, x, index, w)
        after = torch.cuda.memory_allocated()
        out.float().sum().backward()
        return after - before

    rows, width = 8192 * 8, module.gate_up_proj.shape[1] // 2
    saving = kept(transformers_grouped_mm) - kept(dispatched)
    assert saving >= rows * 2 * (hidden.shape[1] + width) * 2
