"""PEFT: patching before or after get_peft_model, LoRA on attention and MLP, modules_to_save on
lm_head (fused through the trained copy), LoRA on lm_head (trained from its logits, never
dropped)."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery import forward as surgery_forward
from tests.models.tiny import (
    assert_grads_close,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_model,
)
from tests.utils import TOLERANCES

peft = pytest.importorskip("peft")

TOL = {k: TOLERANCES[torch.float32][k] for k in ("rtol", "atol")}
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
    original = surgery_forward.linear_cross_entropy

    def spy(hidden, weight, labels, **kwargs):
        calls.append(weight)
        return original(hidden, weight, labels, **kwargs)

    monkeypatch.setattr(surgery_forward, "linear_cross_entropy", spy)
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
