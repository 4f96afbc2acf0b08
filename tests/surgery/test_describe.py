"""``surgery.describe``: what it reports against what the patch actually installed (the modules
holding a swapped forward), for models patched through the registry, by the loss-only fallback,
and not at all."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import surgery
from surgery.integrations import fla
from surgery.patching.fallback import FALLBACK_ATTR, loss_only_options
from surgery.patching.swap import ORIGINAL_ATTR
from tests.models.tiny import causal_lm_from_config, tiny_config, tiny_model
from tests.surgery.test_fallback import fallback_model


def swapped_classes(model: nn.Module) -> Counter:
    return Counter(type(m).__name__ for m in model.modules() if ORIGINAL_ATTR in m.__dict__)


def counts(groups) -> Counter:
    total: Counter = Counter()
    for group in groups:
        total[group.cls] += group.count
    return total


def kernels_of(report, cls: str) -> set[str]:
    return {g.what for g in report.patched if g.cls == cls}


def reasons_of(report, cls: str) -> set[str]:
    return {g.what for g in report.left_alone if g.cls == cls}


def with_forward(model: nn.Module) -> int:
    """Modules with a forward of their own (containers such as ModuleList have none)."""
    return sum(type(m).forward is not nn.Module.forward for m in model.modules())


def test_unpatched_models():
    report = surgery.describe(tiny_model("llama"))
    assert report.how == "unpatched" and report.options is None
    assert report.patched == () and report.left_alone == ()
    assert "not patched" in str(report) and "nothing is patched" in str(report)
    assert any("surgery.patch(model) patches it" in note for note in report.notes)

    outside = surgery.describe(fallback_model("phi3"))
    assert outside.how == "unpatched" and outside.model == "Phi3ForCausalLM"
    assert any("fallback='loss'" in note for note in outside.notes)

    assert "no transformers model" in str(surgery.describe(nn.Linear(2, 2)))


def test_registry_patch_reports_what_was_installed():
    model = surgery.patch(tiny_model("qwen3"), loss_reduction="sequence")
    report = surgery.describe(model)
    assert report.how == "registry" and report.model_type == "qwen3"
    assert report.options == surgery.patch_options(model)
    assert counts(report.patched) == swapped_classes(model)
    assert counts(report.patched) + counts(report.left_alone) == Counter(
        type(m).__name__ for m in model.modules() if type(m).forward is not nn.Module.forward
    )
    assert sum(counts(report.patched + report.left_alone).values()) == with_forward(model)
    assert all("apply_rope" in k for k in kernels_of(report, "Qwen3Attention"))
    assert all(k.startswith("rms_norm (llama") for k in kernels_of(report, "Qwen3RMSNorm"))
    assert all(k.startswith("gated_activation (silu)") for k in kernels_of(report, "Qwen3MLP"))
    assert kernels_of(report, "Linear") == {
        "lm_head: linear_cross_entropy (no logits materialised)"
    }
    assert kernels_of(report, "Embedding") == {
        "input embedding: weight gradient in one op, torch's eager kernel (also compiled)"
    }
    assert "Qwen3DecoderLayer" in counts(report.left_alone)
    assert any("accepts_loss_kwargs is False" in note for note in report.notes)
    text = str(report)
    assert "patched through the registry" in text and "loss_reduction='sequence'" in text


def test_options_off_are_the_reasons():
    model = surgery.patch(tiny_model("gemma3_text"), rope=False, gated_mlp=False)
    report = surgery.describe(model)
    assert reasons_of(report, "Gemma3Attention") == {"rope=False"}
    assert reasons_of(report, "Gemma3MLP") == {"gated_mlp=False"}
    assert all(
        "(gemma cast points, scale (1 + weight))" in k for k in kernels_of(report, "Gemma3RMSNorm")
    )
    assert counts(report.patched) == swapped_classes(model)
    assert "Gemma's scaled one" in reasons_of(report, "Gemma3TextScaledWordEmbedding").pop()
    off = surgery.describe(surgery.patch(tiny_model("qwen3"), embedding_backward=False))
    assert reasons_of(off, "Embedding") == {"embedding_backward=False"}

    config = tiny_config("llama")
    config.hidden_act = "relu"
    from transformers import AutoModelForCausalLM

    relu = AutoModelForCausalLM.from_config(config)
    with pytest.warns(UserWarning, match="no fused kernel"):
        surgery.patch(relu)
    assert reasons_of(surgery.describe(relu), "LlamaMLP") == {
        "no gated_activation kernel for 'relu'"
    }


def test_sparse_gemma3n_mlp_gives_its_sparsity_as_the_reason():
    """Gemma 3n's first layers cut the gate by a Gaussian top-k before the activation: those MLPs
    keep their own forward, and the report says why (not a missing activation kernel)."""
    config = tiny_config("gemma3n_text")
    config.activation_sparsity_pattern = [0.95] + [0.0] * (config.num_hidden_layers - 1)
    model = surgery.patch(causal_lm_from_config(config))
    report = surgery.describe(model)
    assert reasons_of(report, "Gemma3nTextMLP") == {
        "activation sparsity 0.95: the gate is cut by a Gaussian top-k before the activation, "
        "not the fused kernel's math"
    }
    assert counts(report.patched)["Gemma3nTextMLP"] == config.num_hidden_layers - 1


def test_lora_on_lm_head_is_reported_unfused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "lm_head"])
    )
    surgery.patch(model)
    report = surgery.describe(model)
    assert report.model == "LlamaForCausalLM"
    unfused = {g.cls for g in report.left_alone if "not fused" in g.what}
    assert "Linear" in unfused  # the adapter's lora_A / lora_B, under lm_head
    assert counts(report.patched) == swapped_classes(model)


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("phi3", None),
        ("vaultgemma", "softcap config.final_logit_softcapping in the kernel"),
        ("gpt_oss", "router aux loss kept"),
    ],
)
def test_fallback_patch_reports_the_loss_alone_and_the_probe(name, detail):
    model = surgery.patch(fallback_model(name), fallback="loss", z_loss_scale=1e-4)
    report = surgery.describe(model)
    lm = type(model).__name__
    assert report.how == "fallback" and report.model == lm
    assert counts(report.patched) == swapped_classes(model) == Counter({lm: 1, "Linear": 1})
    assert sum(counts(report.patched + report.left_alone).values()) == with_forward(model)
    assert {g.what for g in report.left_alone} == {"loss-only fallback: transformers' own forward"}
    assert report.options == loss_only_options(surgery.PatchOptions(z_loss_scale=1e-4))
    proof = model.__dict__[FALLBACK_ATTR]
    assert [f"probe: {check}" for check in proof.checks] == [
        n for n in report.notes if n.startswith("probe: ")
    ]
    (forward,) = kernels_of(report, lm)
    assert (detail in forward) if detail else ("softcap" not in forward and "aux" not in forward)
    text = str(report)
    assert "patched by the loss-only fallback" in text and "rope=False" in text

    surgery.unpatch(model)
    assert surgery.describe(model).how == "unpatched"


def test_softcap_value_in_the_probe_notes():
    model = surgery.patch(fallback_model("vaultgemma"), fallback="loss")
    notes = surgery.describe(model).notes
    assert any("3 * tanh(lm_head output / 3)" in note for note in notes)
    assert model.config.final_logit_softcapping == 3.0
    assert isinstance(model(input_ids=torch.tensor([[3, 4, 5]])).logits, torch.Tensor)


@pytest.mark.parametrize(
    ("arch", "cls", "what"),
    [
        ("llama4_text", "Llama4TextModel", "position ids, the chunked layers' packed mask"),
        ("qwen3_next", "Qwen3NextModel", "packed documents"),
    ],
)
def test_base_model_and_linear_attention_say_what_they_do(arch, cls, what):
    """The base model's wrapped forward names what it hands its layers; a hybrid's linear
    attention says what runs it (without fla on CPU: what installing it would do, and one packed
    document at a time meanwhile; no generic "a surgery forward")."""
    report = surgery.describe(surgery.patch(tiny_model(arch)))
    assert kernels_of(report, cls) == {
        f"base model forward: transformers' own, handing its layers {what}"
    }
    assert not any(g.what == "a surgery forward" for g in report.patched)
    if arch == "qwen3_next":
        assert kernels_of(report, "Qwen3NextGatedDeltaNet") == {
            "linear attention, each document alone: on CUDA, "
            f"{fla.EXTRA} would run them with flash-linear-attention's kernels; without it: "
            "transformers' forward, one packed document at a time"
        }


def test_describe_names_shared_inputs_and_padding_free():
    """The attention and MLP lines say where their projections share their input; the notes say
    whether right-padded batches run padding-free, and why not where they do not."""
    llama = surgery.describe(surgery.patch(tiny_model("llama")))
    text = str(llama)
    assert "q/k/v share their input (shared_input_linear)" in text
    assert "gate/up sharing their input (shared_input_linear)" in text
    assert "padding_free: right-padded training batches run their real tokens only" in text
    hooked = tiny_model("llama")
    for layer in hooked.model.layers:
        layer.self_attn.k_proj.register_forward_hook(lambda *a: None)
    text = str(surgery.describe(surgery.patch(hooked)))
    assert "q/k/v share their input" not in text and "gate/up sharing their input" in text
    gemma3 = str(surgery.describe(surgery.patch(tiny_model("gemma3_text"))))
    assert "padding_free is off for this model" in gemma3
    assert (
        "padding_free"
        not in str(surgery.describe(surgery.patch(tiny_model("llama"), padding_free=False)))
        .split("notes:")[1]
        .split("options in force:")[0]
    )
