"""How the patched attention treats masks.

``share_attention_mask``: sdpa gets one additive mask per forward, shared by every layer: the same
loss and gradients, bit for bit, as handing it the boolean mask (masked weights underflow to
exactly 0 either way); the shared tensor is freed with the forward's graph. (The memory it saves,
one mask per layer kept by sdpa's masked backends, is measured on the GPU:
tests/surgery/test_gpu.py.)

``causal_right_padding``: a right-padded training batch with ignored padding labels runs as plain
causal attention (no mask) with the same loss and gradients as the masked run; every other batch
keeps its mask.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import surgery
from surgery.attention import shared_additive_mask
from tests.models.tiny import (
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
)

LENGTHS = [9, 6, 3]
OFF = {"share_attention_mask": False}
# The masked path, for the shared-mask tests (a right-padded batch would otherwise run unmasked).
MASKED = {"causal_right_padding": False}


@pytest.fixture
def sdpa_masks(monkeypatch):
    """Every attn_mask that reaches F.scaled_dot_product_attention, in call order."""
    seen: list[torch.Tensor | None] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        assert mask is not None or kwargs.get("is_causal"), "neither a mask nor is_causal"
        seen.append(mask)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def batch_of(kind):
    seqs = sequences(LENGTHS)
    return (packed_batch(seqs) if kind == "packed" else padded_batch(seqs)).kwargs()


CASES = [
    (arch, dtype, kind)
    for arch in ("llama", "qwen3", "gemma3_text")
    for dtype in (torch.float32, torch.bfloat16)
    for kind in ("padded", "packed")
]


@pytest.mark.parametrize(
    ("arch", "dtype", "kind"),
    CASES,
    ids=[f"{a}-{str(d).removeprefix('torch.')}-{k}" for a, d, k in CASES],
)
def test_same_loss_and_grads_as_boolean_mask(arch, dtype, kind, sdpa_masks):
    model = tiny_model(arch, dtype=dtype).train()
    reference = twin(model)
    surgery.patch(model, **MASKED)
    surgery.patch(reference, **OFF, **MASKED)
    batch = batch_of(kind)
    loss, grads = loss_and_grads(model, **batch)
    shared = list(sdpa_masks)
    sdpa_masks.clear()
    want_loss, want_grads = loss_and_grads(reference, **batch)
    assert torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name
    # The patched model really ran on the additive mask, the reference on transformers' boolean.
    layers = tiny_config(arch).num_hidden_layers
    assert len(shared) == len(sdpa_masks) == layers
    assert all(m is not None and m.dtype == dtype for m in shared)
    assert all(m is not None and m.dtype == torch.bool for m in sdpa_masks)


def test_one_tensor_for_all_layers_and_freed_with_the_graph(sdpa_masks):
    model = surgery.patch(tiny_model("llama").train(), **MASKED)
    out = model(**batch_of("padded"))
    storages = {m.untyped_storage().data_ptr() for m in sdpa_masks}
    assert len(sdpa_masks) == tiny_config("llama").num_hidden_layers and len(storages) == 1
    ref = weakref.ref(sdpa_masks[0])
    sdpa_masks.clear()
    out.loss.backward()
    del out
    gc.collect()
    assert ref() is None, "the shared mask outlived the forward's graph"


def test_alternating_masks_each_converted_once(sdpa_masks):
    # Gemma 3 alternates sliding-window and full-attention layers: two boolean masks per forward,
    # so two additive ones, each shared by the layers of its kind.
    config = tiny_config("gemma3_text")
    config.num_hidden_layers = 4
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    surgery.patch(model, **MASKED)
    model.train()(**batch_of("padded")).loss.backward()
    ptrs = [m.untyped_storage().data_ptr() for m in sdpa_masks]
    assert len(ptrs) == 4 and ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]


def test_helper_values_and_pass_through():
    mask = torch.tensor([[True, False], [True, True]])[None, None]
    additive = shared_additive_mask(mask, torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    low = torch.finfo(torch.bfloat16).min
    assert torch.equal(additive[0, 0], torch.tensor([[0.0, low], [0.0, 0.0]]).bfloat16())
    assert shared_additive_mask(mask, torch.bfloat16) is additive  # cached on the mask
    assert shared_additive_mask(mask, torch.float32).dtype == torch.float32  # dtype change
    for other in (None, torch.zeros(1, 1, 2, 2), torch.ones(2, 2, dtype=torch.bool)):
        assert shared_additive_mask(other, torch.float32) is other


def test_option_is_validated():
    with pytest.raises(TypeError, match="share_attention_mask"):
        surgery.patch(tiny_model("llama"), share_attention_mask="yes")


# ---------------------------------------------------------------------------------------------
# causal_right_padding


def test_padding_only_behind():
    from surgery.forward import padding_only_behind

    labels = torch.tensor([[5, 6, 7, -100], [5, 6, -100, -100]])
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert padding_only_behind(right, labels, -100)
    assert padding_only_behind(right.bool(), labels, -100)
    assert padding_only_behind(torch.ones(2, 4), labels, -100)  # no padding at all
    assert not padding_only_behind(right, labels.masked_fill(labels == -100, 0), -100)
    assert not padding_only_behind(right, labels, 0)  # another ignore_index
    assert not padding_only_behind(right.flip(1), labels.flip(1), -100)  # left padding
    holes = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    assert not padding_only_behind(holes, labels.masked_fill(holes == 0, -100), -100)
    assert not padding_only_behind(right[:, :3], labels, -100)  # shapes differ
    assert not padding_only_behind(torch.ones(2, 1, 4, 4), labels, -100)  # a 4-D mask


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_right_padding_runs_causal_with_the_same_loss_and_grads(arch, sdpa_masks):
    model = surgery.patch(tiny_model(arch).train())
    masked = surgery.patch(twin(model), **MASKED)
    batch = batch_of("padded")
    loss, grads = loss_and_grads(model, **batch)
    unmasked_calls = sum(m is None for m in sdpa_masks)
    sdpa_masks.clear()
    want_loss, want_grads = loss_and_grads(masked, **batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    # Full-attention layers ran without a mask (sliding-window layers keep their window mask).
    full_layers = sum(
        t == "full_attention"
        for t in getattr(model.config, "layer_types", None)
        or ["full_attention"] * model.config.num_hidden_layers
    )
    assert unmasked_calls >= min(1, full_layers) and not any(m is None for m in sdpa_masks)


def _left_padded():
    batch = batch_of("padded")
    return {k: v.flip(1) for k, v in batch.items()}


def _labelled_padding():
    batch = batch_of("padded")
    batch["labels"] = batch["input_ids"].clone()
    return batch


def _with_position_ids():
    batch = batch_of("padded")
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None].expand(3, -1)
    return batch


KEEPS_MASK = {
    "left-padding": (_left_padded, {}, {}, True),
    "labels-on-padding": (_labelled_padding, {}, {}, True),
    "position-ids": (_with_position_ids, {}, {}, True),
    "eval": (lambda: batch_of("padded"), {}, {}, False),
    "return-logits": (lambda: batch_of("padded"), {"return_logits": True}, {}, True),
    "hidden-states": (lambda: batch_of("padded"), {}, {"output_hidden_states": True}, True),
    "option-off": (lambda: batch_of("padded"), MASKED, {}, True),
}


@pytest.mark.parametrize("case", list(KEEPS_MASK))
def test_mask_kept_unless_dropping_is_exact(case, sdpa_masks):
    make_batch, options, call_kwargs, training = KEEPS_MASK[case]
    model = surgery.patch(tiny_model("llama").train(training), **options)
    out = model(**make_batch(), **call_kwargs)
    assert torch.isfinite(out.loss)
    assert sdpa_masks and all(m is not None for m in sdpa_masks), case
