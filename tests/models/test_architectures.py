"""Every supported architecture, patched against the same model unpatched (fp32, CPU): loss and the
gradient of every parameter on padded batches (with every kernel, and with some turned off), on
packed batches (against the sequences run one by one), eval logits, generation, z-loss, the
per-sequence reduction and dynamic RoPE's rewritten frequencies."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.attention import forward as surgery_attention
from surgery.forwards import causal_lm as surgery_forward
from surgery.forwards import head as surgery_head
from surgery.forwards import layers as surgery_layers
from tests.utils import FP32_CLOSE as TOL

from .tiny import (
    ARCHS,
    assert_grads_close,
    attn_for,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
    unpatched_packs_exactly,
)

LENGTHS = [7, 5, 3]  # odd, unequal, one shorter than the sliding window (5)


@pytest.fixture
def spies(monkeypatch):
    """Counts calls of the kernels that the patched forwards must reach."""
    calls = {
        "apply_rope": 0,
        "linear_cross_entropy": 0,
        "cross_entropy": 0,
        "rms_norm": 0,
        "gated_activation": 0,
        "gated_linear": 0,
    }

    def count(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    count(surgery_attention, "apply_rope")
    count(surgery_head, "linear_cross_entropy")
    count(surgery_forward, "cross_entropy")
    count(surgery_layers, "rms_norm")
    count(surgery_layers, "gated_activation")
    count(surgery_layers, "gated_linear")  # the product and a plain down_proj as one step
    return calls


# Patch options of a case: every kernel (the defaults), or the norm / MLP kernels turned off.
OPTIONS = {
    "all": {},
    "no-norm-mlp": {"rms_norm": False, "gated_mlp": False},
    "norm-only": {"gated_mlp": False},
    "mlp-only": {"rms_norm": False},
}
# sdpa for every architecture (Gemma2 has eager only), eager for two more; each option set once.
PADDED_CASES = [(arch, attn_for(arch, "sdpa"), "all") for arch in ARCHS] + [
    ("llama", "eager", "all"),
    ("gemma3_text", "eager", "all"),
    ("llama", "sdpa", "no-norm-mlp"),
    ("qwen3", "sdpa", "norm-only"),
    ("gemma2", "eager", "mlp-only"),
]


@pytest.mark.parametrize(
    ("arch", "attn", "options"), PADDED_CASES, ids=["-".join(case) for case in PADDED_CASES]
)
def test_padded_batch_matches_unpatched(arch, attn, options, spies, interpreted):
    model = tiny_model(arch, attn).train()
    reference = twin(model)
    surgery.patch(model, **OPTIONS[options])
    batch = padded_batch(sequences(LENGTHS))
    spec = surgery.supported()[arch]
    norm_calls = []  # of the unpatched model (Gemma 3n's AltUp calls its router norm twice)
    for m in reference.modules():
        if isinstance(m, spec.rms_norm_class()):
            m.register_forward_hook(lambda *_: norm_calls.append(1))

    loss, grads = loss_and_grads(model, **batch.kwargs())
    want_loss, want_grads = loss_and_grads(reference, **batch.kwargs())

    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    layers = model.config.num_hidden_layers
    # One RoPE per attention layer (a hybrid's linear-attention layers have none, nor the layers
    # without RoPE of spec.rope_layer_attr).
    assert spies["apply_rope"] == sum(
        spec.is_instance(m, spec.attention)
        and (spec.rope_layer_attr is None or getattr(m, spec.rope_layer_attr))
        for m in model.modules()
    )
    assert spies["linear_cross_entropy"] == 1 and spies["cross_entropy"] == 0
    # Every norm (q/k norms included) runs as often as unpatched, every MLP once.
    patched = surgery.patch_options(model)
    norms = sum(isinstance(m, spec.rms_norm_class()) for m in model.modules())
    assert norms >= 2 * layers + 1 and len(norm_calls) >= norms
    assert spies["rms_norm"] == (len(norm_calls) if patched.rms_norm else 0)
    mlps = sum(spec.is_instance(m, spec.mlp) for m in model.modules()) if spec.mlp else 0
    fused_mlps = spies["gated_activation"] + spies["gated_linear"]
    assert fused_mlps == (mlps if patched.gated_mlp else 0)
    assert model(**batch.kwargs()).logits is None


# A mixture of experts' load-balancing loss is one statistic of the whole batch (expert loads
# over all its tokens), not a sum over sequences: packed or one by one, transformers' own differs.
# Sequences are compared on their language-model loss; test_router_aux_loss_matches_unpatched
# compares the aux loss itself on the same batch, packed and padded.
LM_LOSS_ONLY = {
    spec.model_type: {"output_router_logits": False}
    for spec in surgery.supported().values()
    if spec.router_aux_loss
}
MOE_ARCHS = list(LM_LOSS_ONLY)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_aux_loss_matches_unpatched(arch, layout):
    """The router's load-balancing loss is in the trained loss and returned as ``aux_loss``, as
    transformers computes it: over the caller's attention mask (also when the attention itself
    runs without it, ``causal_right_padding``), router logits returned, gradients equal."""
    model = tiny_model(arch).train()
    reference = twin(model)
    reference.config.use_cache = False  # unpatched keeps packed sequences apart only without
    surgery.patch(model)
    seqs = sequences(LENGTHS)
    batch = (packed_batch(seqs) if layout == "packed" else padded_batch(seqs)).kwargs()
    # Unpatched, a hybrid's linear-attention layers carry state across packed documents: its
    # reference is the same documents padded (the same tokens, each apart).
    want_batch = batch if unpatched_packs_exactly(arch) else padded_batch(seqs).kwargs()

    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **want_batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    got, want = model(**batch), reference(**want_batch)
    assert got.aux_loss is not None and got.logits is None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    assert len(got.router_logits) == len(want.router_logits)
    # and off when asked: the language-model loss alone
    plain = model(**batch, output_router_logits=False)
    assert plain.aux_loss is None
    torch.testing.assert_close(
        plain.loss + model.router_aux_loss_coef * got.aux_loss, got.loss, **TOL
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_batch_matches_sequences_one_by_one(arch, interpreted):
    """One packed row (position ids restarting, no attention mask, use_cache on in the config)
    gives the loss and gradients of the same sequences run one by one: nothing attends across a
    boundary."""
    model = tiny_model(arch).train()
    reference = twin(model)
    assert model.config.use_cache
    surgery.patch(model)
    seqs = sequences(LENGTHS)
    packed = packed_batch(seqs)
    lm_only = LM_LOSS_ONLY.get(arch, {})

    loss, grads = loss_and_grads(model, **packed.kwargs(), **lm_only)

    # The same token mean, from each sequence alone (sum of its token losses over all tokens).
    n_tokens = sum(len(s) - 1 for s in seqs)
    reference.zero_grad(set_to_none=True)
    total = 0.0
    for s in seqs:
        out = reference(input_ids=s[None], labels=s[None], **lm_only)
        part = out.loss * (len(s) - 1) / n_tokens
        part.backward()
        total += part.detach()
    want = {n: p.grad for n, p in reference.named_parameters()}

    torch.testing.assert_close(loss, torch.as_tensor(total), **TOL)
    assert_grads_close(grads, want, **TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_packed_batch_unmasked_first_labels(arch):
    """Without the collator's -100 on each sequence's first label, the prediction across a boundary
    is still never trained: the loss equals the masked one."""
    model = surgery.patch(tiny_model(arch).train())
    seqs = sequences(LENGTHS)
    masked = model(**packed_batch(seqs, mask_first=True).kwargs()).loss
    unmasked = model(**packed_batch(seqs, mask_first=False).kwargs()).loss
    torch.testing.assert_close(unmasked, masked, **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_sequence_reduction_equals_unpacked_mean(arch):
    model = surgery.patch(tiny_model(arch).train(), loss_reduction="sequence")
    reference = twin(tiny_model(arch))  # same seed: same weights
    seqs = sequences(LENGTHS)
    lm_only = LM_LOSS_ONLY.get(arch, {})
    loss = model(**packed_batch(seqs).kwargs(), **lm_only).loss
    want = torch.stack(
        [reference(input_ids=s[None], labels=s[None], **lm_only).loss for s in seqs]
    ).mean()
    torch.testing.assert_close(loss, want, **TOL)
    assert model.accepts_loss_kwargs is False


@pytest.mark.parametrize("arch", ARCHS)
def test_eval_logits_and_loss_match_unpatched(arch, spies):
    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    batch = padded_batch(sequences(LENGTHS))
    with torch.no_grad():
        out = model(**batch.kwargs())
        want = reference(**batch.kwargs())
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    torch.testing.assert_close(out.logits, want.logits, **TOL)
    torch.testing.assert_close(logits, want.logits, **TOL)
    assert spies["cross_entropy"] == 1 and spies["linear_cross_entropy"] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_generate_matches_unpatched(arch):
    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    prompt = padded_batch(sequences([6]))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    want = reference.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_z_loss_in_output(arch):
    scale = 1e-2
    model = surgery.patch(tiny_model(arch).train(), z_loss_scale=scale)
    reference = twin(tiny_model(arch))
    batch = padded_batch(sequences(LENGTHS))
    out = model(**batch.kwargs())
    with torch.no_grad():
        logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        valid = batch.labels[:, 1:] != -100
        z = torch.logsumexp(logits[:, :-1].float(), -1).square()[valid].mean() * scale
        ce = reference(**batch.kwargs()).loss
    assert out.z_loss is not None and not out.z_loss.requires_grad
    torch.testing.assert_close(out.z_loss, z, **TOL)
    torch.testing.assert_close(out.loss.detach(), ce + z, **TOL)
    assert surgery.patch(tiny_model(arch).train())(**batch.kwargs()).z_loss is None


def test_dynamic_rope_rotates_with_the_rewritten_frequencies():
    """Dynamic NTK RoPE rewrites the rotary module's frequencies past max_position_embeddings; the
    patched attention must rotate with the rewritten ones (more in test_length_dependent_rope)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(
        "llama",
        max_position_embeddings=8,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    reference = twin(model)
    surgery.patch(model)
    batch = padded_batch(sequences([21, 17]))
    loss, grads = loss_and_grads(model, **batch.kwargs())
    want_loss, want_grads = loss_and_grads(reference, **batch.kwargs())
    assert not torch.equal(
        model.model.rotary_emb.inv_freq, model.model.rotary_emb.original_inv_freq
    )
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text"])
def test_tied_lm_head_stays_tied(arch):
    spec = surgery.supported()[arch]
    model = surgery.patch(tiny_model(arch).train())
    assert spec.tied_lm_head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = twin(tiny_model(arch))
    batch = padded_batch(sequences(LENGTHS))
    _, grads = loss_and_grads(model, **batch.kwargs())
    _, want = loss_and_grads(reference, **batch.kwargs())
    # one gradient, from the embedding lookup and the head together
    torch.testing.assert_close(
        grads["model.embed_tokens.weight"], want["model.embed_tokens.weight"], **TOL
    )
