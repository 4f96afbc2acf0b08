"""PEFT: patching before or after get_peft_model, LoRA on attention and MLP, LoRA on attention and
a mixture's experts (3-D parameters, through peft's ``target_parameters``), modules_to_save on
lm_head (fused through the trained copy), LoRA on lm_head (trained from its logits, never
dropped)."""

from __future__ import annotations

import pytest
import torch

import surgery
import surgery.forwards.experts
from surgery.forwards import head as surgery_head
from tests.models.tiny import (
    ARCHS,
    assert_grads_close,
    attention_modules,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_model,
)
from tests.surgery.routing_helpers import is_mixture
from tests.utils import FP32_CLOSE as TOL

peft = pytest.importorskip("peft")

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(arch, order, **lora):
    """A LoRA model, patched before or after get_peft_model (or not at all), with LoRA B non-zero so
    the adapters change the loss."""
    model = tiny_model(arch).train()
    if order == "before":
        surgery.patch(model)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    if order == "after":
        assert surgery.patch(wrapped) is wrapped
    return wrapped


@pytest.fixture
def lce_calls(monkeypatch):
    calls = []
    original = surgery_head.linear_cross_entropy

    def spy(hidden, weight, labels, **kwargs):
        calls.append(weight)
        return original(hidden, weight, labels, **kwargs)

    monkeypatch.setattr(surgery_head, "linear_cross_entropy", spy)
    return calls


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_lora_attention_mlp(arch, order, lce_calls):
    model = peft_model(arch, order, target_modules=ATTN_MLP)
    reference = peft_model(arch, "never", target_modules=ATTN_MLP)
    batch = packed_batch(sequences([7, 5, 3]))
    loss, grads = loss_and_grads(model, **batch.kwargs())
    # unpatched transformers needs use_cache=False to keep packed sequences apart under sdpa
    want_loss, want = loss_and_grads(reference, **batch.kwargs(), use_cache=False)
    assert any("lora_A" in n for n in grads) and len(lce_calls) == 1
    # the fused MLP forward ran the LoRA projections (called as modules, weights never read)
    mlp = model.base_model.model.model.layers[0].mlp
    assert "forward" in mlp.__dict__ and hasattr(mlp.gate_proj, "lora_A")
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)
    surgery.unpatch(model)
    assert not surgery.is_patched(model)


MIXTURES = [arch for arch in ARCHS if is_mixture(tiny_model(arch))]


def attention_and_experts(arch) -> dict:
    """LoRA targets of ``arch``: the projections of the attention modules its spec patches (Mistral
    4's latent attention has its own) and its experts' 3-D parameters (``gate_up_proj``,
    ``down_proj``), which peft adapts through ``target_parameters`` (``ParamWrapper``)."""
    model = tiny_model(arch)
    attention = {
        name
        for module in attention_modules(model, arch)
        for name, child in module.named_children()
        if isinstance(child, torch.nn.Linear)
    }
    experts = {
        f"experts.{name}"
        for module in model.modules()
        if type(module).__name__.endswith("Experts")
        for name, _ in module.named_parameters(recurse=False)
    }
    return dict(target_modules=sorted(attention), target_parameters=sorted(experts))


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("arch", MIXTURES)
def test_lora_attention_and_experts(arch, order, lce_calls, monkeypatch):
    """LoRA on the attention projections and on every expert's weights, patched against
    unpatched in fp32: the same loss (the router's aux loss included) and LoRA gradients; the
    experts surgery fuses ran its fused forward on the adapted weights (peft swaps them in for
    the call); and unpatching gives transformers' step back, bit for bit."""
    products = []
    fused_product = surgery.forwards.experts.gated_activation_merged

    def counting(*args, **kwargs):
        products.append(args[0].shape)
        return fused_product(*args, **kwargs)

    monkeypatch.setattr(surgery.forwards.experts, "gated_activation_merged", counting)
    lora = attention_and_experts(arch)
    model = peft_model(arch, order, **lora)
    reference = peft_model(arch, "never", **lora)
    batch = padded_batch(sequences([7, 5, 3])).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want = loss_and_grads(reference, **batch)
    assert len(lce_calls) == 1
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    fused = [m for m in experts if surgery.forwards.experts.EXPERTS_PLAN_ATTR in m.__dict__]
    assert len(products) == len(fused)  # one fused product per fused experts forward
    adapted = {n for n in grads if ".experts." in n and "lora_" in n}
    # an A and a B per 3-D parameter of every experts module
    assert len(adapted) == 2 * len(lora["target_parameters"]) * len(experts), sorted(adapted)
    assert all(grads[n].abs().sum() > 0 for n in adapted)
    assert any("lora_A" in n and ".experts." not in n for n in grads)  # the attention's
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)

    surgery.unpatch(model)
    assert not surgery.is_patched(model)
    assert not any(
        surgery.forwards.experts.EXPERTS_PLAN_ATTR in m.__dict__ for m in model.modules()
    )
    assert model.config._experts_implementation == reference.config._experts_implementation
    products.clear()
    loss, grads = loss_and_grads(model, **batch)
    assert not products
    assert torch.equal(loss, want_loss)
    for name, g in want.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_modules_to_save_lm_head_is_fused(arch, order, lce_calls):
    lora = dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    model = peft_model(arch, order, **lora)
    reference = peft_model(arch, "never", **lora)
    batch = padded_batch(sequences([7, 5, 3]))
    loss, grads = loss_and_grads(model, **batch.kwargs())
    want_loss, want = loss_and_grads(reference, **batch.kwargs())
    trained = [n for n in grads if "modules_to_save" in n]
    assert trained, "the lm_head copy must be trainable"
    # the fused loss saw the trained copy's weight, not the frozen original
    assert len(lce_calls) == 1
    head = model.base_model.model.lm_head
    assert lce_calls[0] is head.modules_to_save["default"].weight
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)


@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_on_lm_head_is_trained_not_dropped(order, lce_calls):
    lora = dict(target_modules=["q_proj", "v_proj", "lm_head"])
    with pytest.warns(UserWarning, match="not fused"):
        model = peft_model("llama", order, **lora)
        loss, grads = loss_and_grads(model, **padded_batch(sequences([7, 5, 3])).kwargs())
    reference = peft_model("llama", "never", **lora)
    want_loss, want = loss_and_grads(reference, **padded_batch(sequences([7, 5, 3])).kwargs())
    head_lora = [n for n in grads if "lm_head.lora_B" in n]
    assert head_lora and grads[head_lora[0]].abs().sum() > 0
    assert not lce_calls
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": ["embed_tokens", "q_proj"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]},
    ],
    ids=["lora-embedding", "trained-embedding-copy"],
)
def test_input_embedding_adapted_or_trained(order, lora, lce_calls):
    """LoRA on the input embedding (its frozen base layer swapped), or a trained copy of it
    (``modules_to_save``): loss and every trained gradient as unpatched PEFT's."""
    model = peft_model("llama", order, **lora)
    reference = peft_model("llama", "never", **lora)
    batch = padded_batch(sequences([7, 5, 3]))
    loss, grads = loss_and_grads(model, **batch.kwargs())
    want_loss, want = loss_and_grads(reference, **batch.kwargs())
    assert any("embed_tokens" in n for n in grads) and len(lce_calls) == 1
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want, **TOL)
    surgery.unpatch(model)
    assert not surgery.is_patched(model)
