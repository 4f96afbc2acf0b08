"""``eager_attention_recompute``: the eager attention keeps no fp32 probabilities for the backward
and rebuilds them with transformers' own ops: loss and gradients bit for bit those of transformers'
eager attention, with and without Gemma 2's softcap, and 4 (softcap) or 2 bytes per attention score
and layer fewer kept for the backward."""

from __future__ import annotations

import sys

import pytest
import torch

import surgery
from surgery.attention.eager import lean_eager_attention
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


def transformers_eager(attention: torch.nn.Module):
    """transformers' own ``eager_attention_forward`` of ``attention``'s model (unpatched)."""
    return sys.modules[type(attention).__module__].eager_attention_forward


@pytest.mark.parametrize(
    ("arch", "dtype"), CASES, ids=[f"{a}-{str(d).removeprefix('torch.')}" for a, d in CASES]
)
def test_bitwise_equal_to_transformers_eager(arch, dtype):
    """``lean_eager_attention`` against transformers' own eager function of the model, on the
    same queries, keys, values (GQA), a padded causal mask and the model's softcap and scaling:
    the output, the probabilities and every input's gradient, bit for bit."""
    model = eager_model(arch, dtype)
    attention = model.model.layers[0].self_attn
    config = model.config
    B, T, D = 3, 9, config.head_dim
    g = torch.Generator().manual_seed(0)

    def leaf(heads):
        return torch.randn(B, heads, T, D, generator=g).to(dtype).requires_grad_()

    q = leaf(config.num_attention_heads)
    k, v = leaf(config.num_key_value_heads), leaf(config.num_key_value_heads)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T).clone()
    allowed[1, ..., 6:] = False  # right padding of the second row
    mask = torch.zeros(B, 1, T, T, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    options = dict(dropout=0.0, scaling=attention.scaling,
                   softcap=getattr(config, "attn_logit_softcapping", None))  # fmt: skip
    upstream = torch.randn(B, T, config.num_attention_heads, D, generator=g).to(dtype)

    def run(function, **extra):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, probs = function(attention, *inputs, mask, **options, **extra)
        grads = torch.autograd.grad(out, inputs, upstream)
        return out, probs, grads

    want = run(transformers_eager(attention))
    got = run(lean_eager_attention, eager=transformers_eager(attention))
    assert options["softcap"] is not None or arch != "gemma2"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, a, b in zip("qkv", got[2], want[2]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("arch", "dtype"), CASES, ids=[f"{a}-{str(d).removeprefix('torch.')}" for a, d in CASES]
)
def test_patched_step_bitwise_with_and_without_the_option(arch, dtype):
    """The whole patched step, the option on and off: loss and every gradient bit for bit (the
    lean attention is the only difference between the two)."""
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
