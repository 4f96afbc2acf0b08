"""Ministral 3 and Mistral 4 beyond the registry's tests: the query scale from the position ids,
the KV cache (generation, and what the cache holds), Mistral 4's other attention variants (query
without the low-rank pair, RoPE without interleaving, eager attention, left padding), and which
path a packed half-precision batch takes.

The registry's tests (tests/models/test_architectures.py) already compare both, patched against
unpatched, on padded and packed batches, with the query scale changing along the sequences (the
mini configs' original context is 2 positions)."""

from __future__ import annotations

import pytest
import torch

import surgery
import surgery.attention.forward as attention
import surgery.attention.varlen as varlen_module
from surgery.patching.signature import CACHE
from tests.surgery.test_varlen_attention import ReferenceVarlen
from tests.utils import FP32_CLOSE as TOL

from .tiny import (
    assert_grads_close,
    causal_lm_from_config,
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
ARCHS = ["ministral3", "mistral4"]


def _model(arch: str, attn: str = "sdpa", **overrides):
    if not overrides:
        return tiny_model(arch, attn)
    torch.manual_seed(0)
    config = tiny_config(arch, **overrides)
    model = causal_lm_from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_query_scale_is_transformers_at_the_position_ids(arch):
    """The scale each token's query gets: transformers' function of its own position id (a packed
    row's documents restart at 1), growing within the tests' sequences."""
    model = tiny_model(arch)
    spec = surgery.supported()[arch]
    module = model.model.layers[0].self_attn
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    scale = attention.position_query_scale(module, spec, positions)
    rope = model.config.rope_parameters
    beta, original = rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]
    want = 1 + beta * torch.log1p(torch.floor(positions / original))
    assert scale.shape == (1, 1, 12, 1)
    torch.testing.assert_close(scale[0, 0, :, 0], want[0])
    assert len(set(scale.flatten().tolist())) > 2


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_unpatched(arch):
    """Greedy generation with the KV cache: each new token's RoPE and query scale come from its
    position after the cached ones."""
    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    prompt = padded_batch(sequences([6]))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    want = reference.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    torch.testing.assert_close(got, want)


def test_mistral4_cache_holds_transformers_latents():
    """Mistral 4's cache holds the normed latent and the rotary key as transformers writes them
    (rotated pairs de-interleaved: the layout decides what the cache holds, though attention
    scores would not tell), so a cache filled patched can be read unpatched and back."""
    model = tiny_model("mistral4").eval()
    reference = twin(model)
    surgery.patch(model)
    ids = sequences([7])[0][None]
    with torch.no_grad():
        got = getattr(model(input_ids=ids, use_cache=True), CACHE)
        want = getattr(reference(input_ids=ids, use_cache=True), CACHE)
        for layer, want_layer in zip(got.layers, want.layers):
            torch.testing.assert_close(layer.keys, want_layer.keys, **TOL)  # the latent
            torch.testing.assert_close(layer.values, want_layer.values, **TOL)  # the rotary key
        # the next token on each cache, crossed
        step = sequences([1], seed=3)[0][None]
        position = torch.tensor([[7]])
        crossed = reference(input_ids=step, position_ids=position, **{CACHE: got}).logits
        own = model(input_ids=step, position_ids=position, **{CACHE: want}).logits
    torch.testing.assert_close(crossed, own, **TOL)


MISTRAL4_VARIANTS = {
    "q_proj": {"q_lora_rank": None},
    "rotate_half": {"rope_interleave": False},
    "narrow_values": {"v_head_dim": 6},
}


@pytest.mark.parametrize("variant", list(MISTRAL4_VARIANTS))
def test_mistral4_attention_variants_match_unpatched(variant):
    model = _model("mistral4", **MISTRAL4_VARIANTS[variant]).train()
    reference = twin(model)
    surgery.patch(model)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mistral4_left_padding_matches_unpatched(attn):
    """Left padding: rows of pad queries that attend to no key (the shared sdpa mask's rows set
    as sdpa sets them), through each attention implementation."""
    model = tiny_model("mistral4", attn).train()
    reference = twin(model)
    surgery.patch(model)
    batch = left_padded_batch(sequences(LENGTHS)).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


def test_ministral3_positional_call():
    """Ministral 3's attention takes ``position_ids`` positionally, before the cache."""
    model = tiny_model("ministral3")
    reference = twin(model)
    surgery.patch(model)
    hidden = torch.randn(1, 5, model.config.hidden_size)
    positions = torch.arange(3, 8)[None]
    rotary = reference.model.rotary_emb(hidden, positions)
    got, _ = model.model.layers[0].self_attn(hidden, rotary, None, positions)
    want, _ = reference.model.layers[0].self_attn(hidden, rotary, None, positions)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize(("v_head_dim", "varlen"), [(None, True), (6, False)])
def test_mistral4_packed_half_precision_path(v_head_dim, varlen, monkeypatch):
    """A packed bf16 batch runs the documents through the varlen kernel when the value heads are
    as wide as the query/key heads (flash attention needs one head size), else transformers'
    mask."""
    kernel = ReferenceVarlen()
    monkeypatch.setattr(varlen_module, "varlen_kernel", lambda device: kernel)
    overrides = {} if v_head_dim is None else {"v_head_dim": v_head_dim}
    model = _model("mistral4", **overrides).to(torch.bfloat16).train()
    surgery.patch(model)
    loss = model(**packed_batch(sequences(LENGTHS)).kwargs()).loss
    assert torch.isfinite(loss)
    assert len(kernel.calls) == (model.config.num_hidden_layers if varlen else 0)
