"""TRL's fused LM head on a patched model: served by surgery's kernel with TRL's semantics.

The reference is TRL's own head (``add_fused_lm_head`` of the installed TRL release, whose
``ChunkedLogProbFunction`` runs its PyTorch path on CPU) on an unpatched copy of the model:
every per-token output, the loss, the MoE aux loss and every parameter's gradient must agree
(fp32: tight). And what surgery reads of TRL is pinned: the release, the function's name and
closure; another release gets TRL's own head and a warning."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery import kernels as surgery_kernels
from surgery.integrations import trl as serving
from tests.models import test_multimodal as mm
from tests.models.tiny import packed_batch, padded_batch, sequences, tiny_model, twin
from tests.utils import expect_transformers_failure

trl = pytest.importorskip("trl")
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")

CASES = {
    # SFTTrainer's request
    "sft-padded": dict(arch="llama", batch="padded", outputs=("log_probs", "entropy", "is_top1")),
    "sft-packed": dict(arch="qwen3", batch="packed", outputs=("log_probs", "entropy", "is_top1")),
    # GRPO / RLOO: a sampling temperature, an fp32 head, every statistic
    "grpo": dict(arch="qwen2", batch="padded", outputs=ALL_OUTPUTS, temperature=0.7),
    "grpo-fp32-head": dict(
        arch="llama",
        batch="padded",
        outputs=ALL_OUTPUTS,
        temperature=1.3,
        cast_lm_head_to_fp32=True,
    ),
    # a final-logit softcap (Gemma 2), pre-shifted labels (context parallelism), an MoE aux loss
    "softcap": dict(arch="gemma2", batch="padded", outputs=ALL_OUTPUTS),
    "shift_labels": dict(arch="mistral", batch="packed", outputs=ALL_OUTPUTS, shift_labels=True),
    "moe": dict(arch="qwen3_moe", batch="packed", outputs=ALL_OUTPUTS, num_items_in_batch=11),
    # TRL's head ignores logits_to_keep: every position's outputs come back
    "logits_to_keep": dict(arch="llama", batch="padded", outputs=ALL_OUTPUTS, logits_to_keep=3),
}


def _batch(kind):
    seqs = sequences([7, 4, 9], seed=5)
    batch = padded_batch(seqs) if kind == "padded" else packed_batch(seqs)
    inputs = {"input_ids": batch.input_ids}
    if batch.attention_mask is not None:
        inputs["attention_mask"] = batch.attention_mask
    if batch.position_ids is not None:
        inputs["position_ids"] = batch.position_ids
    return inputs, batch.labels


def _with_top1_targets(model, inputs, labels):
    """``labels`` with every third target the model's own top-1 (a random model's next-token
    prediction is rarely its label): ``is_top1`` is then checked both ways."""
    with torch.no_grad():
        top = model(**inputs).logits.argmax(-1)
    labels = labels.clone()
    chosen = torch.zeros_like(labels, dtype=torch.bool)
    chosen[:, 1::3] = True
    chosen &= labels != -100
    labels[:, 1:][chosen[:, 1:]] = top[:, :-1][chosen[:, 1:]]
    return labels


def _run(model, inputs, labels, case, g):
    """TRL's call, then the gradient of every parameter for a loss that reaches every
    differentiable output: the loss itself, the log-probabilities and the entropy (weights ``g``,
    as an RL objective with an entropy bonus has)."""
    kwargs = dict(inputs)
    if case.get("shift_labels"):
        kwargs["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((1, 1), -100)], 1)
    else:
        kwargs["labels"] = labels
    for key in ("num_items_in_batch", "logits_to_keep"):
        if key in case:
            kwargs[key] = case[key]
    model.zero_grad(set_to_none=True)
    out = model(**kwargs, fused_lm_head=True)
    total = out.loss + (out.log_probs * g[0][: out.log_probs.shape[1]]).sum()
    if out.entropy is not None:
        total = total + (out.entropy * g[1][: out.entropy.shape[1]]).sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _install(model, case):
    keys = ("temperature", "cast_lm_head_to_fp32", "outputs")
    add_fused_lm_head(model, **{k: case[k] for k in keys if k in case})


@pytest.fixture
def served(monkeypatch):
    """Counts the calls of surgery's per-token kernel."""
    calls = []
    original = surgery_kernels.linear_log_probs

    def spy(*args, **kwargs):
        calls.append(kwargs.get("outputs"))
        return original(*args, **kwargs)

    import surgery.forwards.head as head_module

    monkeypatch.setattr(head_module, "linear_log_probs", spy)
    return calls


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_served_head_equals_trls_own(name, served):
    case = CASES[name]
    overrides = {"output_router_logits": True} if case["arch"] == "qwen3_moe" else {}
    model = tiny_model(case["arch"], **overrides)
    reference = twin(model)
    surgery.patch(model)
    _install(model, case)
    _install(reference, case)
    inputs, labels = _batch(case["batch"])
    labels = _with_top1_targets(reference, inputs, labels)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2, labels.shape[1], generator=gen)
    out, grads = _run(model, inputs, labels, case, g)
    want, want_grads = _run(reference, inputs, labels, case, g)
    assert served == [case["outputs"]], "surgery's kernel did not serve TRL's head"
    assert type(out) is type(want)
    torch.testing.assert_close(out.label_mask, want.label_mask, rtol=0, atol=0)
    for field in PER_TOKEN:
        got, ref = getattr(out, field), getattr(want, field)
        assert (got is None) == (ref is None), field
        if ref is not None:
            assert got.shape == ref.shape and got.dtype == ref.dtype, field
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5, msg=field)
    if want.is_top1 is not None:
        torch.testing.assert_close(out.is_top1, want.is_top1, rtol=0, atol=0)
        assert want.is_top1.any(), "no top-1 token in the batch: the check would be empty"
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    if want.aux_loss is not None or out.aux_loss is not None:
        torch.testing.assert_close(out.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for param in want_grads:
        torch.testing.assert_close(grads[param], want_grads[param], rtol=2e-4, atol=2e-6,
                                   msg=lambda m, n=param: f"{n}: {m}")  # fmt: skip


def test_no_grad_call_as_a_reference_model_makes_it(served):
    """KTO's and GRPO's reference model: eval mode, no gradients."""
    model = tiny_model("llama").eval()
    reference = twin(model)
    surgery.patch(model)
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs",))
    inputs, labels = _batch("padded")
    with torch.no_grad():
        out = model(**inputs, labels=labels, fused_lm_head=True)
        want = reference(**inputs, labels=labels, fused_lm_head=True)
    assert served and not out.log_probs.requires_grad
    torch.testing.assert_close(out.log_probs, want.log_probs, rtol=1e-4, atol=2e-5)
    assert out.entropy is None and want.entropy is None


def test_calls_without_the_flag_stay_surgerys_forward(served):
    """Generation and the plain loss go through TRL's forward to surgery's, untouched."""
    model = surgery.patch(tiny_model("llama"))
    add_fused_lm_head(model)
    inputs, labels = _batch("padded")
    out = model(**inputs, labels=labels)
    assert not served and out.logits is None and torch.isfinite(out.loss)
    generated = model.eval().generate(inputs["input_ids"][:1, :3], max_new_tokens=2,
                                      do_sample=False)  # fmt: skip
    assert generated.shape == (1, 5)


def test_another_trl_release_keeps_trls_head_and_warns(monkeypatch, served):
    monkeypatch.setattr(serving, "CHECKED", ("0.0",))
    model = surgery.patch(tiny_model("llama"))
    add_fused_lm_head(model)
    inputs, labels = _batch("padded")
    with pytest.warns(UserWarning, match="not one surgery has checked"):
        out = model(**inputs, labels=labels, fused_lm_head=True)
    assert not served and out.log_probs.shape == (labels.shape[0], labels.shape[1] - 1)


def test_lora_on_the_head_keeps_trls_head(served):
    peft = pytest.importorskip("peft")
    model = surgery.patch(tiny_model("llama"))
    add_fused_lm_head(model)
    config = peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"])
    wrapped = peft.get_peft_model(model, config)
    inputs, labels = _batch("padded")
    out = wrapped(**inputs, labels=labels, fused_lm_head=True)
    assert not served and torch.isfinite(out.loss)


def test_peft_lora_model_is_served(served):
    """The trainer calls the PeftModel; PEFT calls the causal LM through its module call, where
    the hook runs."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    reference = twin(model)
    surgery.patch(model)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    outs = []
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
        torch.manual_seed(0)
        wrapped = peft.get_peft_model(m, config)
        inputs, labels = _batch("padded")
        outs.append(wrapped(**inputs, labels=labels, fused_lm_head=True))
    assert served
    torch.testing.assert_close(outs[0].log_probs, outs[1].log_probs, rtol=1e-4, atol=2e-5)


def test_unpatch_removes_the_hook():
    model = surgery.patch(tiny_model("llama"))
    surgery.unpatch(model)
    assert not model._forward_pre_hooks
    surgery.patch(model)
    surgery.patch(model)  # idempotent: one hook
    assert len(model._forward_pre_hooks) == 1


def test_what_surgery_reads_of_trl_is_there():
    """Pinned against the installed release: its version is a checked one, its fused forward is
    found behind ``model.forward`` and its closure holds every setting read."""
    assert ".".join(trl.__version__.split(".")[:2]) in serving.CHECKED
    model = tiny_model("llama")
    add_fused_lm_head(model, temperature=0.5, outputs=("log_probs", "is_top1"))
    fn = serving._trl_function(model.forward)
    assert fn is not None
    assert set(serving._CLOSURE) <= set(fn.__code__.co_freevars)
    from trl.trainer.utils import FusedCausalLMOutput

    fields = set(FusedCausalLMOutput.__dataclass_fields__)
    assert {"loss", "label_mask", "aux_loss", *ALL_OUTPUTS} == fields
    assert set(serving.TRL_OUTPUTS) == set(ALL_OUTPUTS)  # what serving fills of it


def test_loss_options_that_do_not_apply_under_trl_are_named(served):
    model = surgery.patch(tiny_model("llama"), loss_reduction="sequence", z_loss_scale=1e-4)
    add_fused_lm_head(model)
    inputs, labels = _batch("padded")
    with pytest.warns(UserWarning, match=r"loss_reduction='sequence', z_loss_scale=0.0001.*TRL"):
        model(**inputs, labels=labels, fused_lm_head=True)
    assert served


@pytest.mark.parametrize("pair", mm.WRAPPERS, ids=mm.WRAPPERS)
def test_multimodal_wrapper_is_served_as_trl_computes_it(pair, served, request):
    """A vision-language wrapper under TRL's head: images in the batch, the wrapper's own
    arguments through to its model. Llama 4's wrapper, whose language model is the causal LM,
    keeps TRL's head (its patched forward delegates; surgery serves the text causal LM)."""
    spec, wrapper = mm.PAIRS[pair]
    expect_transformers_failure(request, wrapper.wrapper_class())
    model = mm.tiny_vlm(spec, wrapper)
    reference = twin(model)
    surgery.patch(model)
    batch = mm.image_batch(model, wrapper)
    labels = batch.pop("labels")
    outs = []
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
        m.zero_grad(set_to_none=True)
        out = m(**batch, labels=labels, fused_lm_head=True)
        (out.loss + out.entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        outs.append((out, grads))
    (out, grads), (want, want_grads) = outs
    assert bool(served) == (wrapper.model_type != "llama4")
    for field in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(out, field), getattr(want, field), rtol=1e-4, atol=2e-5)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert (grads[name] - g).norm() <= 1e-4 * g.norm() + 1e-6, name


def test_a_copy_is_served_with_its_own_weights_and_a_later_head_adapter_is_not(served):
    """What can change after the first served call is checked on every call: a deep copy shares
    TRL's function, whose closure calls the original model's forward (TRL's head runs on the
    copy); an adapter put on the head afterwards keeps TRL's head."""
    import copy

    peft = pytest.importorskip("peft")
    model = surgery.patch(tiny_model("llama"))
    add_fused_lm_head(model)
    inputs, labels = _batch("padded")
    model(**inputs, labels=labels, fused_lm_head=True)
    assert len(served) == 1
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(1.5)
    got = clone(**inputs, labels=labels, fused_lm_head=True).log_probs
    assert len(served) == 1  # TRL's head on the copy
    reference = twin(tiny_model("llama"))
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(1.5)
    add_fused_lm_head(reference)
    want = reference(**inputs, labels=labels, fused_lm_head=True).log_probs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"]))
    out = wrapped(**inputs, labels=labels, fused_lm_head=True)
    assert len(served) == 1 and torch.isfinite(out.loss)
