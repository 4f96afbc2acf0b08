"""``patch(model, fallback="loss")``: the fused loss alone on causal LMs outside the registry, each
against the same model unpatched (fp32, CPU): loss and every gradient, padded and packed, eval
logits, the loss options; and what the patch-time probe refuses (a logit scale, a softcap the config
does not declare, a custom forward, another loss or aux loss, another layout)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import surgery
from surgery.forwards import causal_lm as surgery_forward
from surgery.forwards import head as surgery_head
from surgery.patching.fallback import FALLBACK_ATTR, LossFallback, loss_only_options
from surgery.patching.swap import ORIGINAL_ATTR
from tests.models.tiny import (
    TINY,
    VOCAB,
    assert_grads_close,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
)
from tests.utils import FP32_CLOSE as TOL

LENGTHS = [7, 5, 3]

# model_type -> (transformers config class, what differs from the tiny shape, attention). Each
# class exists in transformers 5.17 and 5.23 with the standard causal-LM forward. Dropout off
# (SeedOss defaults to 0.1) so that a training step is deterministic.
MODELS: dict[str, tuple[str, dict, str]] = {
    "phi3": ("Phi3Config", {}, "sdpa"),
    "olmo2": ("Olmo2Config", {}, "sdpa"),
    "olmo3": ("Olmo3Config", {}, "sdpa"),
    "glm4": ("Glm4Config", {}, "sdpa"),
    "smollm3": ("SmolLM3Config", {}, "sdpa"),
    "exaone4": ("Exaone4Config", {}, "sdpa"),
    "stablelm": ("StableLmConfig", {}, "sdpa"),
    "phi": ("PhiConfig", {}, "sdpa"),
    "starcoder2": ("Starcoder2Config", {}, "sdpa"),
    "helium": ("HeliumConfig", {}, "sdpa"),
    "seed_oss": ("SeedOssConfig", {"attention_dropout": 0.0, "residual_dropout": 0.0}, "sdpa"),
    "apertus": ("ApertusConfig", {}, "sdpa"),
    "arcee": ("ArceeConfig", {}, "sdpa"),
    # final-logit softcap declared in the config: passed to the kernel (3.0 bends tiny logits)
    "vaultgemma": ("VaultGemmaConfig", {"final_logit_softcapping": 3.0}, "eager"),
    # mixtures of experts: with the router aux loss (handled), and without one (DeepSeek-V3)
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 5,
        },
        "eager",
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}, "sdpa"),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 16,
        },
        "sdpa",
    ),
    # logit scales: refused (the fused kernel takes none) unless the scale is 1
    "granite": ("GraniteConfig", {"logits_scaling": 4.0}, "sdpa"),
    "cohere2": ("Cohere2Config", {}, "sdpa"),  # logit_scale 0.0625 by default
    # a layout the generic forward does not call (gpt_neox / embed_out)
    "gpt_neox": ("GPTNeoXConfig", {}, "sdpa"),
}
DENSE = [
    "phi3",
    "olmo2",
    "olmo3",
    "glm4",
    "smollm3",
    "exaone4",
    "stablelm",
    "phi",
    "starcoder2",
    "helium",
    "seed_oss",
    "apertus",
    "arcee",
    "vaultgemma",
    "deepseek_v3",
]
ROUTER_AUX = ["gpt_oss", "olmoe"]
# transformers' GptOssModel builds its attention masks without the position ids, so packed
# sequences attend to each other, patched or not (flash attention aside).
NO_PACKING = ["gpt_oss"]
HANDLED = DENSE + ROUTER_AUX


def fallback_config(name: str, **overrides):
    config_class, arguments, _ = MODELS[name]
    kwargs = {
        **TINY.config_kwargs(),
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **arguments,
        **overrides,
    }
    return getattr(transformers, config_class)(**kwargs)


def fallback_model(name: str, cls: type | None = None, dtype=torch.float32, **overrides):
    """The tiny model of ``name`` (a key of ``MODELS``), built as ``cls`` if given (a subclass),
    with non-trivial norm weights as tests/models/tiny.py makes them."""
    config = fallback_config(name, **overrides)
    config._attn_implementation = MODELS[name][2]
    torch.manual_seed(0)
    if cls is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = cls(config).to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn_like(p))
    return model


def instance_forwards(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def surgery_attrs(model: nn.Module) -> list[str]:
    return [f"{n}.{a}" for n, m in model.named_modules() for a in m.__dict__ if "surgery" in a]


@pytest.fixture
def spies(monkeypatch):
    calls = {"linear_cross_entropy": 0, "cross_entropy": 0}

    def count(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    count(surgery_head, "linear_cross_entropy")
    count(surgery_forward, "cross_entropy")
    return calls


# ---------------------------------------------------------------------------------------------
# patched == unpatched


@pytest.mark.parametrize("name", HANDLED)
def test_padded_batch_matches_unpatched(name, spies):
    model = fallback_model(name).train()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    assert surgery.is_patched(model)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    lm_only = {"output_router_logits": False} if name in ROUTER_AUX else {}

    loss, grads = loss_and_grads(model, **batch, **lm_only)
    want_loss, want_grads = loss_and_grads(reference, **batch, **lm_only)

    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    assert spies == {"linear_cross_entropy": 1, "cross_entropy": 0}
    assert model(**batch).logits is None
    # only the loss is swapped: the causal LM's forward and the lm_head's
    swapped = {n for n, m in model.named_modules() if ORIGINAL_ATTR in m.__dict__}
    assert swapped == {"", "lm_head"}


@pytest.mark.parametrize("name", HANDLED)
def test_packed_batch_matches_sequences_one_by_one(name):
    """One row, position ids restarting, no attention mask: the loss and gradients of the same
    sequences run one by one (the router aux loss is a statistic of the whole batch, so MoE
    models compare the language-model loss). A model whose base model ignores packing compares
    with itself unpatched on the same row."""
    model = fallback_model(name).train()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    seqs = sequences(LENGTHS)
    packed = packed_batch(seqs).kwargs()
    lm_only = {"output_router_logits": False} if name in ROUTER_AUX else {}

    loss, grads = loss_and_grads(model, **packed, **lm_only)
    if name in NO_PACKING:
        want_loss, want = loss_and_grads(reference, **packed, **lm_only, use_cache=False)
        torch.testing.assert_close(loss, want_loss, **TOL)
        assert_grads_close(grads, want, **TOL)
        return

    n_tokens = sum(len(s) - 1 for s in seqs)
    reference.zero_grad(set_to_none=True)
    total = 0.0
    for s in seqs:
        part = reference(input_ids=s[None], labels=s[None], **lm_only).loss * (len(s) - 1)
        (part / n_tokens).backward()
        total += part.detach() / n_tokens
    want = {n: p.grad for n, p in reference.named_parameters()}
    torch.testing.assert_close(loss, torch.as_tensor(total), **TOL)
    assert_grads_close(grads, want, **TOL)


@pytest.mark.parametrize("name", ROUTER_AUX)
def test_router_aux_loss_matches_unpatched(name):
    """A mixture of experts' load-balancing loss is trained and returned as transformers computes
    it, over the caller's attention mask."""
    model = fallback_model(name).train()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    batch = {**padded_batch(sequences(LENGTHS)).kwargs(), "output_router_logits": True}

    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    got, want = model(**batch), reference(**batch)
    assert got.logits is None and got.aux_loss is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    assert len(got.router_logits) == len(want.router_logits)


@pytest.mark.parametrize("name", ["phi3", "vaultgemma", "olmoe"])
def test_eval_logits_loss_and_generation_match_unpatched(name, spies):
    model = fallback_model(name).eval()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    batch = padded_batch(sequences(LENGTHS))
    with torch.no_grad():
        out, want = model(**batch.kwargs()), reference(**batch.kwargs())
    torch.testing.assert_close(out.logits, want.logits, **TOL)
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    assert spies == {"linear_cross_entropy": 0, "cross_entropy": 1}
    prompt = padded_batch(sequences([6]))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    expected = reference.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    torch.testing.assert_close(got, expected)


def test_triton_kernel_end_to_end(interpreted):
    """The fused loss through the Triton kernel itself (the interpreter on CPU), softcap on."""
    model = fallback_model("vaultgemma").train()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    batch = padded_batch(sequences([5, 3])).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


def test_peft_lora_model():
    from peft import LoraConfig, get_peft_model

    base = fallback_model("phi3").train()
    config = LoraConfig(r=4, target_modules=["qkv_proj", "o_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = get_peft_model(base, config)
    reference = copy.deepcopy(peft_model)
    assert surgery.patch(peft_model, fallback="loss") is peft_model
    assert surgery.is_patched(peft_model) and surgery.is_patched(base)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    loss, grads = loss_and_grads(peft_model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    assert any("lora" in n for n in grads)
    surgery.unpatch(peft_model)
    assert not surgery.is_patched(peft_model) and surgery_attrs(peft_model) == []


# ---------------------------------------------------------------------------------------------
# the loss options, through the fallback as through the registry


def test_loss_options_behave_as_for_the_families():
    model = fallback_model("olmo2").train()
    reference = copy.deepcopy(model).eval()
    seqs = sequences(LENGTHS)
    padded = padded_batch(seqs)
    with torch.no_grad():
        logits = reference(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
    flat = logits[:, :-1].reshape(-1, VOCAB).float()
    targets = padded.labels[:, 1:].reshape(-1)
    valid = targets != -100

    # z-loss: trained and returned on its own
    surgery.patch(model, fallback="loss", z_loss_scale=1e-2)
    out = model(**padded.kwargs())
    z = torch.logsumexp(flat[valid], -1).square().mean() * 1e-2
    ce = torch.nn.functional.cross_entropy(flat, targets)
    torch.testing.assert_close(out.z_loss, z, **TOL)
    torch.testing.assert_close(out.loss.detach(), ce + z, **TOL)

    # label smoothing, as F.cross_entropy defines it
    surgery.patch(model, fallback="loss", label_smoothing=0.1)
    smoothed = torch.nn.functional.cross_entropy(flat, targets, label_smoothing=0.1)
    torch.testing.assert_close(model(**padded.kwargs()).loss.detach(), smoothed, **TOL)

    # ignore_index, num_items_in_batch and shift_labels keep transformers' meaning
    surgery.patch(model, fallback="loss")
    reference.train()
    minus_one = padded.labels.masked_fill(padded.labels == -100, -1)
    got = model(
        input_ids=padded.input_ids,
        attention_mask=padded.attention_mask,
        labels=minus_one,
        ignore_index=-1,
        num_items_in_batch=torch.tensor(20),
    ).loss
    want = reference(**padded.kwargs(), num_items_in_batch=torch.tensor(20)).loss
    torch.testing.assert_close(got, want, **TOL)
    shifted = torch.nn.functional.pad(padded.labels[:, 1:], (0, 1), value=-100)
    got = model(**padded.kwargs() | {"labels": padded.labels}, shift_labels=shifted).loss
    torch.testing.assert_close(got, reference(**padded.kwargs()).loss, **TOL)

    # per-sequence mean on a packed row: the mean of the sequences' own losses
    surgery.patch(model, fallback="loss", loss_reduction="sequence")
    assert model.accepts_loss_kwargs is False
    loss = model(**packed_batch(seqs).kwargs()).loss
    per_sequence = [reference(input_ids=s[None], labels=s[None]).loss for s in seqs]
    torch.testing.assert_close(loss, torch.stack(per_sequence).mean(), **TOL)
    surgery.unpatch(model)
    assert "accepts_loss_kwargs" not in model.__dict__


# ---------------------------------------------------------------------------------------------
# patch / unpatch / options


def test_not_applied_unless_asked():
    model = fallback_model("phi3")
    before = instance_forwards(model)
    with pytest.raises(surgery.UnsupportedModelError, match=r"Phi3ForCausalLM.*fallback='loss'"):
        surgery.patch(model)
    with pytest.warns(UserWarning, match="left unpatched"):
        assert surgery.patch(model, strict=False) is model
    assert instance_forwards(model) == before and not surgery.is_patched(model)
    with pytest.raises(ValueError, match="fallback"):
        surgery.patch(model, fallback="everything")


def test_supported_model_ignores_the_fallback():
    from tests.models.tiny import tiny_model

    model = surgery.patch(tiny_model("llama"), fallback="loss")
    assert FALLBACK_ATTR not in model.__dict__
    assert "forward" in model.model.layers[0].self_attn.__dict__  # the full patch


def test_patch_twice_noop_other_options_repatch_and_unpatch_restores():
    model = fallback_model("glm4").train()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    original = instance_forwards(model)
    model.model.layers[1].eval()  # a mixed training state, which the probe must keep
    rng = torch.get_rng_state()

    surgery.patch(model, fallback="loss", rope=True, rms_norm=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and not model.model.layers[1].training and model.model.layers[0].training
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    proof = model.__dict__[FALLBACK_ATTR]
    assert isinstance(proof, LossFallback) and proof.spec.model_type == "glm4"
    # the options acting on modules the fallback leaves alone are off
    options = surgery.patch_options(model)
    assert options == loss_only_options(surgery.PatchOptions())
    assert not options.rope and not options.rms_norm and not options.causal_right_padding
    once = instance_forwards(model)

    surgery.patch(model, fallback="loss")  # same options in force: a no-op
    assert instance_forwards(model) == once
    surgery.patch(model, fallback="loss", z_loss_scale=1e-3)  # repatched, not probed again
    assert surgery.patch_options(model).z_loss_scale == 1e-3
    assert model.__dict__[FALLBACK_ATTR] is proof

    with surgery.patched(model, fallback="loss", label_smoothing=0.1):
        assert surgery.patch_options(model).label_smoothing == 0.1
    assert surgery.patch_options(model).z_loss_scale == 1e-3

    assert surgery.unpatch(model) is model
    assert instance_forwards(model) == original
    assert surgery_attrs(model) == []
    assert not surgery.is_patched(model) and surgery.patch_options(model) is None
    assert model.forward.__func__ is type(model).forward


def test_deepcopy_of_a_fallback_patched_model():
    model = surgery.patch(fallback_model("helium").train(), fallback="loss")
    clone = copy.deepcopy(model)
    assert surgery.is_patched(clone) and FALLBACK_ATTR in clone.__dict__
    assert clone.lm_head.forward.__self__ is clone.lm_head
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    torch.testing.assert_close(clone(**batch).loss, model(**batch).loss, **TOL)
    surgery.unpatch(clone)
    assert surgery.is_patched(model) and not surgery.is_patched(clone)


def test_logits_to_keep_and_bf16():
    """A bf16 model passes the probe (logits in the model's dtype) and keeps logits_to_keep."""
    model = fallback_model("phi3", dtype=torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    ids = sequences([7])[0][None]
    with torch.no_grad():
        got = model(input_ids=ids, logits_to_keep=2).logits
        want = reference(input_ids=ids, logits_to_keep=2).logits
    assert got.shape == (1, 2, VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# what the probe refuses


def _refused(model, match: str):
    before = instance_forwards(model)
    with pytest.raises(surgery.FallbackRefusedError, match=match):
        surgery.patch(model, fallback="loss")
    assert instance_forwards(model) == before and surgery_attrs(model) == []
    with pytest.warns(UserWarning, match="left unpatched"):
        surgery.patch(model, fallback="loss", strict=False)
    assert not surgery.is_patched(model)


def test_logit_scale_refused():
    _refused(fallback_model("granite"), r"0\.25 x the lm_head's output: a logit scale")
    _refused(fallback_model("cohere2"), r"0\.0625 x the lm_head's output: a logit scale")
    # a scale of 1 computes nothing else: the probe passes and the loss is exact
    model = fallback_model("granite", logits_scaling=1.0).train()
    reference = copy.deepcopy(model)
    surgery.patch(model, fallback="loss")
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    torch.testing.assert_close(model(**batch).loss, reference(**batch).loss, **TOL)


def test_softcap_declared_but_not_applied_refused():
    # The config declares a cap that Phi-3's forward never applies: what the kernel would compute
    # is not what the model computes.
    model = fallback_model("phi3", final_logit_softcapping=3.0)
    _refused(model, r"not softcap\(lm_head output, 3\)")


def _subclass(name: str, transform):
    """A subclass of ``name``'s causal LM whose forward changes the logits (and, as computed from
    them, the loss): what a user's custom forward might do."""
    base = type(fallback_model(name))

    class Custom(base):
        def forward(
            self,
            input_ids=None,
            attention_mask=None,
            position_ids=None,
            past_key_values=None,
            inputs_embeds=None,
            labels=None,
            use_cache=None,
            logits_to_keep=0,
            **kwargs,
        ):
            out = super().forward(
                input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, None,
                use_cache, logits_to_keep, **kwargs,
            )  # fmt: skip
            out.logits = transform(out.logits)
            if labels is not None:
                out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
            return out

    return fallback_model(name, cls=Custom)


CUSTOM = {
    "doubled": (lambda x: x * 2, r"2 x the lm_head's output"),
    "doubled-in-place": (lambda x: x.mul_(2), r"2 x the lm_head's output"),
    "shifted": (lambda x: x + 1, r"logits it returns are not the lm_head's output"),
    "capped": (lambda x: 10 * torch.tanh(x / 10), r"bounded by [\d.]+ where .* a softcap\?"),
    "upcast": (lambda x: x.float(), r"dtype torch.float32, expected torch.bfloat16"),
}


@pytest.mark.parametrize("case", list(CUSTOM))
def test_custom_forward_refused(case):
    transform, match = CUSTOM[case]
    model = _subclass("phi3", transform)
    if case == "upcast":
        model = model.to(torch.bfloat16)
    _refused(model, match)


def test_custom_forward_computing_the_same_is_not_replaced():
    """The probe passes, but surgery replaces transformers' forwards only
    (surgery.patching.foreign)."""
    model = _subclass("phi3", lambda x: x)
    before = instance_forwards(model)
    with pytest.raises(surgery.ForeignForwardError, match="in place of transformers' own forward"):
        surgery.patch(model, fallback="loss")
    assert instance_forwards(model) == before and surgery_attrs(model) == []


def test_custom_loss_refused():
    base = type(fallback_model("smollm3"))

    class SumLoss(base):
        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, **kwargs)
            if labels is not None:
                shifted = out.logits[:, :-1].flatten(0, 1).float()
                out.loss = nn.functional.cross_entropy(
                    shifted, labels[:, 1:].flatten(), reduction="sum"
                )
            return out

    # its signature (*args) is not the standard one
    _refused(fallback_model("smollm3", cls=SumLoss), r"forward's arguments are not the standard")

    class SumLossStandard(base):
        def forward(
            self,
            input_ids=None,
            attention_mask=None,
            position_ids=None,
            past_key_values=None,
            inputs_embeds=None,
            labels=None,
            use_cache=None,
            logits_to_keep=0,
            **kwargs,
        ):
            out = super().forward(
                input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, None,
                use_cache, logits_to_keep, **kwargs,
            )  # fmt: skip
            if labels is not None:
                shifted = out.logits[:, :-1].flatten(0, 1).float()
                out.loss = nn.functional.cross_entropy(
                    shifted, labels[:, 1:].flatten(), reduction="sum"
                )
            return out

    _refused(fallback_model("smollm3", cls=SumLossStandard), r"its loss .* is not the token-mean")


def test_other_router_aux_loss_refused():
    base = type(fallback_model("olmoe"))

    class HalfAux(base):
        def forward(
            self,
            input_ids=None,
            attention_mask=None,
            position_ids=None,
            past_key_values=None,
            inputs_embeds=None,
            labels=None,
            use_cache=None,
            output_router_logits=None,
            logits_to_keep=0,
            **kwargs,
        ):
            out = super().forward(
                input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels,
                use_cache, output_router_logits, logits_to_keep, **kwargs,
            )  # fmt: skip
            if out.aux_loss is not None:
                out.aux_loss = out.aux_loss / 2
            return out

    _refused(fallback_model("olmoe", cls=HalfAux), r"aux_loss is not .*load_balancing_loss_func")


def test_other_layout_refused():
    _refused(fallback_model("gpt_neox"), r"GPTNeoXForCausalLM: it has no `model` module")
