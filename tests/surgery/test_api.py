"""The public API: patch / unpatch / patched / apply_<arch> / revert / supported, what patching
leaves alone (state_dict, saving and loading), options, gradient checkpointing, deepcopy."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn

import surgery
from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS
from surgery.patching.swap import ORIGINAL_ATTR
from tests.models.tiny import (
    ARCHS,
    assert_grads_close,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
)
from tests.utils import FP32_CLOSE as TOL
from tests.utils import TOLERANCES, enable_activation_checkpointing

BATCH = padded_batch(sequences([7, 5, 3]))


def instance_forwards(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def surgery_attrs(model: nn.Module) -> list[str]:
    return [f"{n}.{a}" for n, m in model.named_modules() for a in m.__dict__ if "surgery" in a]


def test_supported_lists_every_architecture():
    specs = surgery.supported()
    assert list(specs.values()) == list(SPECS)  # one each: no two specs share a model_type
    assert list(specs) == ARCHS
    for model_type, spec in specs.items():
        assert spec.model_type == model_type
        assert tiny_config(model_type).model_type == model_type
        apply = getattr(surgery, spec.apply_name)
        assert apply is getattr(surgery.apply, spec.apply_name)
        assert spec.apply_name in surgery.__all__ and spec.apply_name in surgery.apply.__all__
        assert apply.__name__ == spec.apply_name and apply.__module__ == "surgery.apply"
        assert f"``{spec.causal_lm}``" in apply.__doc__


def test_stub_declares_what_the_module_makes():
    """``surgery.apply`` makes ``apply_<name>`` from the registry at run time; IDEs and type
    checkers read its stub instead (``apply.pyi``, written by ``write_stub()``). Run as Python,
    the committed stub defines every function the module makes, and nothing else, each taking
    keyword options only, and exports them."""
    # Every spec, and every multimodal wrapper under its model_type (with its text spec's where
    # they share it).
    wrappers = {w.model_type for spec in (*SPECS, *MULTIMODAL_ONLY_SPECS) for w in spec.multimodal}
    want = [spec.apply_name for spec in SPECS]
    want += sorted(f"apply_{name}" for name in wrappers if f"apply_{name}" not in want)
    made = [name for name in surgery.apply.__all__ if name != "revert"]
    assert sorted(want) == sorted(made)
    stub: dict = {}
    exec(compile(surgery.apply.STUB.read_text(), str(surgery.apply.STUB), "exec"), stub)
    declared = sorted(
        name for name in stub if name.startswith("apply_") and name != "apply_targets"
    )
    assert declared == sorted(made) and sorted(stub["__all__"]) == sorted(surgery.apply.__all__), (
        "surgery/apply.pyi (what IDEs and type checkers see) is stale: regenerate it with "
        "`python -c 'from surgery.apply import write_stub; write_stub()'`"
    )
    for name in declared:
        params = inspect.signature(stub[name]).parameters.values()
        assert [p.kind for p in params] == [inspect.Parameter.VAR_KEYWORD], name


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_patch_returns_same_object_and_keeps_state_dict(arch):
    model = tiny_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = [n for n, _ in model.named_modules()]
    params_before = [n for n, _ in model.named_parameters()]
    assert surgery.patch(model) is model
    after = model.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert [n for n, _ in model.named_modules()] == modules_before
    assert [n for n, _ in model.named_parameters()] == params_before


def test_patch_twice_is_a_noop_and_unpatch_restores_exactly():
    model = tiny_model("qwen3")
    original = instance_forwards(model)
    assert all(f is None for f in original.values())  # every forward is the class's
    surgery.patch(model)
    once = instance_forwards(model)
    patched_names = {n for n, f in once.items() if f is not None}
    assert "" in patched_names and "lm_head" in patched_names
    assert {"model.layers.0.self_attn", "model.layers.1.self_attn"} <= patched_names
    # every RMSNorm (Qwen3's q/k norms included) and every MLP
    for i in range(2):
        layer = f"model.layers.{i}"
        assert {f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"} <= patched_names
        assert {f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"} <= patched_names
        assert f"{layer}.mlp" in patched_names
    assert "model.norm" in patched_names
    assert surgery.is_patched(model)

    surgery.patch(model)
    twice = instance_forwards(model)
    assert all(twice[n] is once[n] for n in once)

    surgery.unpatch(model)
    assert instance_forwards(model) == original
    assert surgery_attrs(model) == []
    assert not surgery.is_patched(model)
    assert model.forward.__func__ is type(model).forward


def test_unpatch_restores_a_previous_instance_forward():
    """An instance forward that is the class's own (``model.forward = model.forward``) is replaced
    and put back; any other instance forward is refused (tests/surgery/test_foreign.py)."""
    model = tiny_model("llama")
    bound = model.forward
    model.forward = bound
    surgery.patch(model, rope=False, fused_linear_cross_entropy=False)
    assert model.__dict__[ORIGINAL_ATTR].previous is bound
    surgery.unpatch(model)
    assert model.__dict__["forward"] is bound


def test_patch_with_other_options_repatches():
    model = surgery.patch(tiny_model("llama").train())
    surgery.patch(model, rope=False, z_loss_scale=1e-3)
    assert surgery.patch_options(model) == surgery.PatchOptions(rope=False, z_loss_scale=1e-3)
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    assert model(**BATCH.kwargs()).z_loss is not None


def test_patched_context_restores_previous_state():
    model = tiny_model("mistral")
    with surgery.patched(model, z_loss_scale=1e-3) as m:
        assert m is model and surgery.patch_options(model).z_loss_scale == 1e-3
    assert not surgery.is_patched(model)
    surgery.patch(model, label_smoothing=0.1)
    with surgery.patched(model, loss_reduction="sequence"):
        assert surgery.patch_options(model).loss_reduction == "sequence"
        assert model.accepts_loss_kwargs is False
    assert surgery.patch_options(model) == surgery.PatchOptions(label_smoothing=0.1)
    assert "accepts_loss_kwargs" not in model.__dict__


def test_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(surgery.UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        surgery.patch(model)
    before = instance_forwards(model)
    with pytest.warns(UserWarning, match="left unpatched"):
        assert surgery.patch(model, strict=False) is model
    assert instance_forwards(model) == before
    assert surgery.unpatch(model) is model


@pytest.mark.parametrize(
    "options",
    [
        {"loss_reduction": "sum"},
        {"z_loss_scale": -1.0},
        {"label_smoothing": 1.0},
        {"rope": 1},
        {"rms_norm": "yes"},
        {"gated_mlp": None},
    ],
    ids=["reduction-sum", "negative-z", "smoothing-1", "rope-int", "norm-str", "mlp-none"],
)
def test_bad_options_raise(options):
    model = tiny_model("llama")
    with pytest.raises((ValueError, TypeError)):
        surgery.patch(model, **options)
    assert not surgery.is_patched(model)


def test_norm_and_mlp_options_turn_their_patches_off():
    model = surgery.patch(tiny_model("gemma3_text").train(), rms_norm=False, gated_mlp=False)
    layer = model.model.layers[0]
    assert "forward" in layer.self_attn.__dict__
    for module in (layer.input_layernorm, layer.self_attn.q_norm, model.model.norm, layer.mlp):
        assert "forward" not in module.__dict__
    surgery.patch(model)  # other options: repatched with the norm and MLP forwards
    assert all("forward" in m.__dict__ for m in (layer.self_attn.k_norm, layer.mlp))


def test_mlp_activation_without_kernel_keeps_the_mlp_forward():
    config = tiny_config("llama")
    config.hidden_act = "relu"
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    reference = twin(model)
    with pytest.warns(UserWarning, match="no fused kernel for the MLP activation 'relu'") as seen:
        surgery.patch(model)
    # The warning names the line that called patch.
    assert [w.filename for w in seen if "MLP activation" in str(w.message)] == [__file__]
    assert "forward" not in model.model.layers[0].mlp.__dict__
    assert "forward" in model.model.layers[0].input_layernorm.__dict__
    loss, grads = loss_and_grads(model, **BATCH.kwargs())
    want_loss, want = loss_and_grads(reference, **BATCH.kwargs())
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)


def test_signature_mismatch_raises():
    from surgery.attention.forward import attention_forward
    from surgery.patching.swap import check_signature

    class Attention(nn.Module):
        def forward(self, hidden_states, attention_mask, position_embeddings, **kwargs):
            return hidden_states

    with pytest.raises(RuntimeError, match="not supported"):
        check_signature(Attention(), Attention.forward, attention_forward)


@pytest.mark.parametrize("arch", ["llama", "mistral4", "qwen3_next"])
def test_cache_under_either_name(arch):
    """transformers 5.24 renamed ``past_key_values`` (and ``cache_params``) to ``cache``: a patched
    model takes its cache under the old name, the new one or by position, in any release, and
    continues the prompt as the unpatched model does."""
    from surgery.patching.signature import CACHE

    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    ids, step = sequences([7])[0][None], sequences([1], seed=3)[0][None]
    position = torch.tensor([[7]])

    def prompt_cache(lm):
        return getattr(lm(input_ids=ids, use_cache=True), CACHE)

    with torch.no_grad():
        cache = prompt_cache(reference)
        want = reference(input_ids=step, position_ids=position, **{CACHE: cache}).logits
        calls = {
            "past_key_values": lambda c: model(input_ids=step, position_ids=position,
                                               past_key_values=c),
            "cache": lambda c: model(input_ids=step, position_ids=position, cache=c),
            "by position": lambda c: model(step, None, position, c),
        }  # fmt: skip
        for name, call in calls.items():
            got = call(prompt_cache(model)).logits
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        both = dict(past_key_values=prompt_cache(model), cache=prompt_cache(model))
        with pytest.raises(ValueError, match="both cache and past_key_values"):
            model(input_ids=step, position_ids=position, **both)


def test_apply_and_revert_class_level():
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

    own_init = LlamaForCausalLM.__dict__["__init__"]
    try:
        surgery.apply_llama(z_loss_scale=1e-3)
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
        assert surgery.patch_options(model) == surgery.PatchOptions(z_loss_scale=1e-3)
        assert not surgery.is_patched(Qwen2ForCausalLM(tiny_config("qwen2")))
        surgery.apply_llama()  # again: replaces the options
        assert (
            surgery.patch_options(LlamaForCausalLM(tiny_config("llama"))) == surgery.PatchOptions()
        )
    finally:
        surgery.revert()
    assert LlamaForCausalLM.__dict__["__init__"] is own_init
    assert not surgery.is_patched(LlamaForCausalLM(tiny_config("llama")))
    assert surgery.is_patched(model)  # built while applied: stays patched until unpatch


def test_save_pretrained_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    model = surgery.patch(tiny_model("gemma2"))
    model.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert not surgery.is_patched(loaded)
    want = model.state_dict()
    assert list(loaded.state_dict()) == list(want)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # ... and loading while apply_gemma2 is active gives a patched model that computes the same
    try:
        surgery.apply_gemma2()
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    finally:
        surgery.revert()
    assert surgery.is_patched(again)
    model.train(), again.train()
    torch.testing.assert_close(again(**BATCH.kwargs()).loss, model(**BATCH.kwargs()).loss, **TOL)


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_model, save_model

    model = surgery.patch(tiny_model("llama"))
    save_model(model, str(tmp_path / "model.safetensors"))
    fresh = surgery.patch(tiny_model("llama", seed=1))
    missing, unexpected = load_model(fresh, str(tmp_path / "model.safetensors"))
    assert not missing and not unexpected
    for (k, v), (k2, v2) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_gradient_checkpointing(arch):
    model = tiny_model(arch).train()
    reference = twin(model)
    surgery.patch(model)
    enable_activation_checkpointing(model, use_reentrant=False)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    batch = packed_batch(sequences([7, 5, 3]))
    loss, grads = loss_and_grads(model, **batch.kwargs())
    want_loss, want = loss_and_grads(surgery.patch(reference), **batch.kwargs())
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)


def test_deepcopy_of_patched_model_is_patched_on_its_own_modules():
    model = surgery.patch(tiny_model("gemma3_text").train())
    clone = copy.deepcopy(model)
    assert surgery.is_patched(clone)
    attn = clone.model.layers[0].self_attn
    assert attn.forward.__self__ is attn
    assert attn.__dict__["_surgery_attention"].rotary is clone.model.rotary_emb
    assert clone.lm_head.forward.__self__ is clone.lm_head
    torch.testing.assert_close(clone(**BATCH.kwargs()).loss, model(**BATCH.kwargs()).loss, **TOL)


def test_return_logits_and_return_dict():
    model = surgery.patch(tiny_model("llama").train(), return_logits=True)
    reference = twin(tiny_model("llama")).train()
    out = model(**BATCH.kwargs())
    want = reference(**BATCH.kwargs())
    torch.testing.assert_close(out.logits, want.logits, **TOL)
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    as_tuple = model(**BATCH.kwargs(), return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], want.loss, **TOL)


def test_hf_loss_kwargs_keep_their_meaning():
    """num_items_in_batch (sum / n), shift_labels (pre-shifted), logits_to_keep (no labels)."""
    model = surgery.patch(tiny_model("qwen2").train())
    reference = twin(tiny_model("qwen2")).train()
    kwargs = BATCH.kwargs()
    got = model(**kwargs, num_items_in_batch=40).loss
    want = reference(**kwargs, num_items_in_batch=40).loss
    torch.testing.assert_close(got, want, **TOL)

    # shift_labels are the targets: labels (here the raw input ids, pads and the first half of
    # each row unmasked) only say that a loss is wanted. A forward that shifts labels instead
    # trains other targets.
    targets = BATCH.labels.clone()
    targets[:, : targets.shape[1] // 2] = -100
    shifted = torch.nn.functional.pad(targets, (0, 1), value=-100)[:, 1:]
    got = model(
        input_ids=BATCH.input_ids,
        attention_mask=BATCH.attention_mask,
        labels=BATCH.input_ids,
        shift_labels=shifted,
    ).loss
    want = reference(input_ids=BATCH.input_ids, attention_mask=BATCH.attention_mask,
                     labels=targets).loss  # fmt: skip
    torch.testing.assert_close(got, want, **TOL)
    wrong = reference(input_ids=BATCH.input_ids, attention_mask=BATCH.attention_mask,
                      labels=BATCH.input_ids).loss  # fmt: skip
    assert (want - wrong).abs() > 1e-3

    model.eval(), reference.eval()
    with torch.no_grad():
        last = model(
            input_ids=BATCH.input_ids, attention_mask=BATCH.attention_mask, logits_to_keep=1
        )
        full = reference(input_ids=BATCH.input_ids, attention_mask=BATCH.attention_mask)
    torch.testing.assert_close(last.logits, full.logits[:, -1:], **TOL)


@pytest.mark.parametrize("reduction", ["mean", "sequence"])
def test_pre_shifted_labels_train_no_packed_boundary(reduction):
    """A packed row's ``shift_labels`` shifted across the whole row (as transformers' Trainer
    makes them under context parallelism), the documents' first labels unmasked: a document's
    last token predicting the next document's first token is not trained, as with ``labels``
    (docs/packing.md), and only inside the row (its last target stays: the next shard's first
    token under context parallelism). Reference: the documents one by one, unpatched."""
    seqs = sequences([5, 1, 4, 3])
    batch = packed_batch(seqs, mask_first=False)
    shifted = torch.nn.functional.pad(batch.labels[:, 1:], (0, 1), value=-100)
    model = tiny_model("llama").train()
    reference = twin(model)
    surgery.patch(model, loss_reduction=reduction)
    loss, grads = loss_and_grads(model, input_ids=batch.input_ids, position_ids=batch.position_ids,
                                 labels=batch.labels, shift_labels=shifted)  # fmt: skip
    trained = [s for s in seqs if len(s) > 1]
    total = sum(len(s) - 1 for s in trained)
    reference.zero_grad(set_to_none=True)
    want = 0.0
    for s in trained:
        part = reference(input_ids=s[None], labels=s[None]).loss
        part = part * (len(s) - 1) / total if reduction == "mean" else part / len(trained)
        part.backward()
        want += part.detach()
    torch.testing.assert_close(loss, torch.as_tensor(want), **TOL)
    assert_grads_close(grads, {n: p.grad for n, p in reference.named_parameters()}, **TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_label_smoothing_and_z_loss_are_trained_through_the_patched_model(arch):
    """The patched training forward's loss and every gradient against the unpatched model's
    logits put through ``F.cross_entropy(label_smoothing=...)`` plus the z-loss by hand: a
    forward that drops (or adds) either option fails."""
    eps, z_scale = 0.1, 1e-3
    reference = tiny_model(arch).train()
    model = surgery.patch(twin(reference), label_smoothing=eps, z_loss_scale=z_scale)
    out = model(**BATCH.kwargs())
    out.loss.backward()
    logits = reference(input_ids=BATCH.input_ids, attention_mask=BATCH.attention_mask).logits
    x = logits[:, :-1].float().flatten(0, 1)
    targets = BATCH.labels[:, 1:].flatten()
    valid = targets != -100
    ce = torch.nn.functional.cross_entropy(x, targets, label_smoothing=eps)
    z = z_scale * torch.logsumexp(x[valid], dim=-1).square().mean()
    (ce + z).backward()
    torch.testing.assert_close(out.loss, (ce + z).detach(), **TOL)
    torch.testing.assert_close(out.z_loss, z.detach(), **TOL)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert_grads_close(grads, {n: p.grad for n, p in reference.named_parameters()}, **TOL)
    without = torch.nn.functional.cross_entropy(x, targets) + z
    assert (without - out.loss).abs() > 1e-3


def test_sequence_reduction_ignores_num_items_in_batch():
    model = surgery.patch(tiny_model("llama").train(), loss_reduction="sequence")
    batch = packed_batch(sequences([7, 5, 3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = model(**batch.kwargs()).loss
        b = model(**batch.kwargs(), num_items_in_batch=1000).loss
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("how", ["apply", "patch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_resize_token_embeddings_after_patch_stays_fused(arch, how):
    """``resize_token_embeddings`` puts a new lm_head Linear in place (untied models) after
    ``apply_<arch>()`` or ``patch``: the next training forward fuses it as ``patch`` would, with
    no warning, the loss equals the unpatched resized model's, and ``unpatch`` restores it."""
    spec = surgery.supported()[tiny_config(arch).model_type]
    if how == "apply":
        getattr(surgery, spec.apply_name)()
        try:
            model = tiny_model(arch)
        finally:
            surgery.revert()
    else:
        model = surgery.patch(tiny_model(arch))
    reference = twin(model)
    surgery.unpatch(reference)
    for m in (model, reference):
        torch.manual_seed(1)
        m.resize_token_embeddings(150)
        m.train()
    ids = torch.randint(1, 150, (2, 9))
    batch = {"input_ids": ids, "labels": ids}
    want_loss, want_grads = loss_and_grads(reference, **batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, grads = loss_and_grads(model, **batch)
        assert model(**batch).logits is None  # fused
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    surgery.unpatch(model)
    assert surgery_attrs(model) == []
    assert instance_forwards(model) == instance_forwards(reference)


def test_experts_implementation_is_an_option_put_back_by_unpatch():
    """``experts_implementation`` runs transformers' experts implementation of that name (the
    model's own choice otherwise) and ``unpatch`` puts the previous one back; the patched step
    equals the unpatched model's with the same implementation."""
    model = tiny_model("qwen3_moe").train()
    before = model.config._experts_implementation
    other = "batched_mm" if before != "batched_mm" else "eager"
    reference = twin(model)
    reference.set_experts_implementation(other)
    surgery.patch(model, experts_implementation=other)
    assert model.config._experts_implementation == other
    assert surgery.patch_options(model).experts_implementation == other
    batch = padded_batch(sequences([7, 5, 3])).kwargs()
    (loss, grads), (want, want_grads) = (loss_and_grads(m, **batch) for m in (model, reference))
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(loss, want, rtol=tol["rtol"], atol=tol["atol"])
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=tol["rtol"], atol=tol["atol"])
    surgery.unpatch(model)
    assert model.config._experts_implementation == before
    with pytest.raises(TypeError, match="experts_implementation"):
        surgery.patch(model, experts_implementation=1)
    assert not surgery.is_patched(model)
