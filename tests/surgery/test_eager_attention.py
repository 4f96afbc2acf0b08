"""``eager_attention_recompute``: the eager attention keeps no fp32 probabilities for the backward
and rebuilds them with transformers' own ops: loss and gradients bit for bit those of transformers'
eager attention, with and without Gemma 2's softcap, and 4 (softcap) or 2 bytes per attention score
and layer fewer kept for the backward."""

from __future__ import annotations

import pytest
import torch

import surgery
from tests.models.tiny import loss_and_grads, padded_batch, sequences, tiny_config, tiny_model, twin
from tests.surgery.test_recompute import kept_bytes

LENGTHS = [9, 6, 3]
OFF = {"eager_attention_recompute": False}
CASES = [
    (arch, dtype)
    for arch in ("gemma2", "llama", "qwen3")
    for dtype in (torch.float32, torch.bfloat16)
]


def eager_model(arch, dtype=torch.float32):
    return tiny_model(arch, attn="eager", dtype=dtype).train()


@pytest.mark.parametrize(
    ("arch", "dtype"), CASES, ids=[f"{a}-{str(d).removeprefix('torch.')}" for a, d in CASES]
)
def test_bitwise_equal_to_transformers_eager(arch, dtype):
    model = eager_model(arch, dtype)
    reference = surgery.patch(twin(model), **OFF)
    surgery.patch(model)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    assert torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize(("arch", "per_score"), [("gemma2", 4), ("llama", 2)])
def test_fp32_probabilities_not_kept(arch, per_score):
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    config = tiny_config(arch)
    B, T = batch["input_ids"].shape
    scores = B * config.num_attention_heads * T * T  # per layer
    kept = {}
    for name, options in (("transformers", OFF), ("lean", {})):
        model = eager_model(arch, torch.bfloat16)  # in fp32 the fp32 probabilities are the output
        kept[name] = kept_bytes(surgery.patch(model, **options), batch)
    # The backward also keeps the additive mask, one (B, 1, T, T) tensor per kind of layer
    # (sliding / full), shared by all layers of that kind.
    masks = B * T * T * 2 * len(set(getattr(config, "layer_types", None) or ["full_attention"]))
    saved = kept["transformers"] - kept["lean"]
    assert saved == per_score * scores * config.num_hidden_layers - masks


def test_without_grad_and_with_dropout_the_model_function_runs():
    model = surgery.patch(eager_model("gemma2"))
    reference = surgery.patch(twin(model), **OFF)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, reference(**batch).loss)
    for m in (model, reference):
        m.config.attention_dropout = 0.5
        for layer in m.model.layers:
            layer.self_attn.attention_dropout = 0.5
    torch.manual_seed(3)
    loss = model(**batch).loss
    torch.manual_seed(3)
    assert torch.equal(loss, reference(**batch).loss)  # the same dropout draws: the same function
