"""RoPE whose frequencies follow the sequence's length (dynamic NTK, LongRoPE), patched against
the same model unpatched (fp32, CPU). transformers' rotary module rewrites its frequencies on every
forward (LongRoPE's in place) and hands each layer the cos/sin of that forward; a patched
attention must rotate with its own forward's too: when another forward runs before the backward,
when activation checkpointing runs the layer again in the backward, and in a copy of the
attention (PEFT's ``modules_to_save``), whose copied rotary module never runs."""

from __future__ import annotations

import pytest
import torch

import surgery
from tests.utils import FP32_CLOSE as TOL
from tests.utils import enable_activation_checkpointing

from .tiny import assert_grads_close, loss_and_grads, padded_batch, sequences, tiny_model, twin

# The plain and the partial rotary (Qwen3-Next; Qwen3.5's multimodal RoPE), RoPE per layer type
# (Gemma 3, on its full attention layers; Gemma 3n, whose last layers reuse earlier keys), the
# latent attention (Mistral 4), the interleaved layout (Llama 4).
ARCHS = [
    "llama", "qwen3_next", "qwen3_5_text", "gemma3_text", "gemma3n_text", "mistral4", "llama4_text"
]  # fmt: skip
ROPE_TYPES = ["dynamic", "longrope"]
ORIGINAL = 8  # max_position_embeddings: the long batch runs past it, the short one within it


def _parameters(rope_type: str, half: int, base: dict) -> dict:
    """``rope_type``'s parameters for a rotary of ``half`` frequencies, keeping ``base``'s
    partial rotary factor and query scale (Mistral 4's, with the length it reads)."""
    kept = ("partial_rotary_factor", "llama_4_scaling_beta", "original_max_position_embeddings")
    parameters = {k: base[k] for k in kept if k in base}
    parameters.update(rope_type=rope_type, rope_theta=10_000.0, factor=4.0)
    if rope_type == "longrope":
        # distinct short and long factors: the switch changes the angles
        parameters["original_max_position_embeddings"] = ORIGINAL
        parameters["short_factor"] = [1.0 + 0.5 * j for j in range(half)]
        parameters["long_factor"] = [3.0**j for j in range(half)]
    return parameters


def length_dependent_model(arch: str, rope_type: str):
    """The tiny ``arch`` model with ``rope_type`` RoPE (Gemma 3: on its full attention layers),
    its attention projections sharpened so that the rotation weighs in the loss (not the q/k
    norms: Gemma 3n, without a 1/sqrt(d) scale, would turn nearly one-hot, its gradients then
    amplifying fp32 rounding past the budget, patched or not)."""
    model = tiny_model(arch, max_position_embeddings=ORIGINAL)
    rotary = model.model.rotary_emb
    base = model.config.rope_parameters
    if "full_attention" in base and isinstance(base["full_attention"], dict):
        half = rotary.full_attention_inv_freq.shape[-1]
        full = _parameters(rope_type, half, base["full_attention"])
        rope = {**base, "full_attention": full}
    else:
        half = rotary.inv_freq.shape[-1]
        rope = _parameters(rope_type, half, base)
    model = tiny_model(arch, max_position_embeddings=ORIGINAL, rope_parameters=rope).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("q_" in name or "k_" in name) and "norm" not in name:
                p.mul_(4)
    return model


LONG = padded_batch(sequences([21, 17]))
SHORT = padded_batch(sequences([6, 5], seed=2))


def two_losses_and_grads(model):
    """The losses of a long batch and a short one summed, one backward: the short batch's forward
    rewrites the frequencies the long one's backward reads."""
    model.zero_grad(set_to_none=True)
    loss = model(**LONG.kwargs()).loss + model(**SHORT.kwargs()).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_another_forward_before_the_backward(arch, rope_type, checkpointing):
    model = length_dependent_model(arch, rope_type)
    reference = twin(model)
    surgery.patch(model)
    if checkpointing:  # the layers run again in the backward, after the short batch's forward
        for m in (model, reference):
            enable_activation_checkpointing(m, use_reentrant=False)
    loss, grads = two_losses_and_grads(model)
    want_loss, want_grads = two_losses_and_grads(reference)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_peft_copy_of_the_attention(rope_type):
    """``surgery.patch`` then PEFT's ``modules_to_save`` on the attention: the trained copy
    rotates with the frequencies of the forward it runs in."""
    peft = pytest.importorskip("peft")

    def wrapped(patch: bool):
        model = length_dependent_model("llama", rope_type)
        if patch:
            surgery.patch(model)
        config = peft.LoraConfig(
            r=4, target_modules=["gate_proj"], modules_to_save=["self_attn"], lora_dropout=0.0
        )
        return peft.get_peft_model(model, config)

    loss, grads = loss_and_grads(wrapped(patch=True), **LONG.kwargs())
    want_loss, want_grads = loss_and_grads(wrapped(patch=False), **LONG.kwargs())
    assert any("modules_to_save" in name for name in want_grads)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
