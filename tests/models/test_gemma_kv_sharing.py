"""What Gemma 3n and Gemma 4 do that the registry's tests do not reach: generation through layers
that reuse earlier layers' keys and values (with a KV cache), Gemma 4's mixture of experts (a
variant of its mini config) and Gemma 3n's MLPs with activation sparsity (left unfused)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import surgery
from surgery.forwards import layers as surgery_layers
from tests.utils import FP32_CLOSE as TOL

from .tiny import (
    TINY,
    assert_grads_close,
    gemma4_moe_config,
    left_padded_batch,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
)

LENGTHS = [7, 5, 3]
ARCHS = ["gemma4_text", "gemma3n_text"]


def model_of(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_shared_kv_matches_unpatched(arch):
    """Greedy generation with a KV cache: the shared layers read the keys and values their
    producer stored in this step (prompt and every new token), as transformers' do."""
    model = tiny_model(arch).eval()
    assert any(layer.self_attn.is_kv_shared_layer for layer in model.model.layers)
    reference = twin(model)
    surgery.patch(model)
    prompt = padded_batch(sequences([6, 4]))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    want = reference.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("keep", [1, 3])
def test_base_model_alone_keeps_the_last_positions_through_shared_layers(keep):
    """Gemma 4's base model patched alone (as a VLM's language model can be), called with an int
    ``logits_to_keep`` as ``generate`` calls it: transformers runs its kv-sharing layers on the
    last positions alone (cut hidden states, cos/sin and masks, not the position ids); those
    positions' outputs are the unpatched model's."""
    reference = tiny_model("gemma4_text").model.eval()
    model = surgery.patch(twin(reference))
    # Left-padded, the last positions real: with a mask transformers cuts more than one.
    batch = left_padded_batch(sequences(LENGTHS))
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    with torch.no_grad():
        got = model(**inputs, logits_to_keep=keep).last_hidden_state
        want = reference(**inputs, logits_to_keep=keep).last_hidden_state
    assert got.shape == want.shape
    torch.testing.assert_close(got[:, -keep:], want[:, -keep:], **TOL)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gemma4_moe_matches_unpatched(layout):
    """Gemma 4's experts beside the MLPs (no auxiliary loss): loss and every gradient, and the
    router logits when asked."""
    model = model_of(gemma4_moe_config()).train()
    assert model.model.layers[0].enable_moe_block
    reference = twin(model)
    reference.config.use_cache = False  # unpatched keeps packed sequences apart only without
    surgery.patch(model)
    seqs = sequences(LENGTHS)
    batch = (packed_batch(seqs) if layout == "packed" else padded_batch(seqs)).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


def test_gemma3n_sparse_mlps_keep_their_forward(monkeypatch):
    """An MLP with activation sparsity cuts its gate before the activation: not the fused gated
    kernel's math. It keeps transformers' forward; the others are fused; training is exact."""
    layers = max(TINY.num_hidden_layers, 3)
    config = tiny_config("gemma3n_text", activation_sparsity_pattern=[0.95] + [0.0] * (layers - 1))
    model = model_of(config).train()
    reference = twin(model)
    surgery.patch(model)
    mlps = [layer.mlp for layer in model.model.layers]
    assert [type(m).forward is m.forward.__func__ for m in mlps] == [True] + [False] * (layers - 1)
    calls = []
    for name in ("gated_activation", "gated_linear"):  # either one per fused MLP
        original = getattr(surgery_layers, name)
        spy = lambda *a, _original=original, **k: calls.append(1) or _original(*a, **k)
        monkeypatch.setattr(surgery_layers, name, spy)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    assert len(calls) == layers - 1
