"""The attention forward of multi-head latent attention (MLA: Mistral 4's, after DeepSeek V2/V3):
transformers' ``Mistral4Attention.forward`` op for op, but RoPE through ``apply_rope`` from the
position ids, and a packed batch's documents through ``varlen_attention`` (``ArchitectureSpec.
latent_attention``).

Each head's query and key are a part without RoPE (``qk_nope_head_dim`` channels) then a rotary
part (``qk_rope_head_dim``). The query comes from ``q_proj``, or from a low-rank pair
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; keys and values from one compressed latent per
token: ``kv_a_proj_with_mqa`` yields ``kv_lora_rank`` channels (normed by ``kv_a_layernorm``) and
the rotary key, one head shared by every query head. The KV cache stores these two, as
transformers' does; the module's own ``expand_kv`` then expands them per head through
``kv_b_proj`` into the keys' non-rotary part and the values (``v_head_dim`` channels).

RoPE: with ``config.rope_interleave`` transformers rotates the channel pairs (2j, 2j + 1) and
writes them de-interleaved at (j, j + r/2) (``apply_rotary_pos_emb_interleave``): ``apply_rope``'s
``"interleaved_to_half"`` layout; without it ``rotate_half``: the ``"half"`` layout. The rotary
module's frequencies cover the rotary part alone (yarn's ``partial_rotary_factor``), read at call
time as in the generic forward (where they follow the sequence's length, the layer's cos/sin
instead, as there). Both norms are the model's RMSNorm class and get the fused norm
with the others. The softmax scale is the module's ``scaling`` (transformers folds yarn's mscale
into it).

A packed batch (``surgery.attention.forward``'s ``varlen_attention``) runs through flash attention's
varlen kernel when query/key and value heads have one size (Mistral Small 4: 128 and 128), half
precision, no dropout and no cache; otherwise through transformers' mask, as in the generic
forward (DeepSeek V3's 192-channel keys over 128-channel values would need the values padded).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from surgery.attention import forward as attention
from surgery.attention.forward import (
    BINDING_ATTR,
    CAUSAL_KWARG,
    PACKED_KWARG,
    AttentionBinding,
    PackedSequences,
    attention_interface,
    flash_head_size,
    position_query_scale,
    rope_frequencies,
    varlen_attention,
    zero_unattended_rows,
)
from surgery.attention.linear import DOCUMENTS_KWARG
from surgery.forwards import recompute
from surgery.forwards.recompute import RECOMPUTE_ATTR
from surgery.patching.signature import cache_argument, update_cache

__all__ = ["mla_attention_forward"]


def _rope(
    self: nn.Module,
    binding: AttentionBinding,
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rot (B, H, T, r) and k_rot (B, 1, T, r) rotated as transformers rotates them."""
    interleave = self.config.rope_interleave
    if position_ids is None or (
        position_embeddings is not None and attention.length_dependent(binding.rotary)
    ):
        # The layer's cos/sin: a caller without position ids, or frequencies that follow the
        # sequence's length (as in the generic forward, surgery.attention.forward).
        cos, sin = position_embeddings
        if not interleave:
            return attention.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        return sys.modules[binding.spec.module].apply_rotary_pos_emb_interleave(
            q_rot, k_rot, cos, sin
        )
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    inv_freq, scaling = rope_frequencies(self, binding)
    if inv_freq.device != q_rot.device:  # a device map put the rotary module on another GPU
        inv_freq = inv_freq.to(q_rot.device)
    # Called through the attention module, where the rest of surgery (and its tests) find it.
    return attention.apply_rope(
        q_rot,
        k_rot,
        position_ids,
        inv_freq,
        attention_scaling=scaling,
        layout="interleaved_to_half" if interleave else "half",
    )


def mla_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Mistral4Attention.forward`` (same arguments, same order), see the module docstring."""
    cache = cache_argument(cache, kwargs)
    binding: AttentionBinding = self.__dict__[BINDING_ATTR]
    spec = binding.spec
    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

    # The projections of hidden_states (the input norm's output) save it: rebuilt in the backward
    # when the norm registered it (surgery.forwards.recompute), as in the generic forward.
    plan = self.__dict__.get(RECOMPUTE_ATTR)
    with recompute.saved_tensor_scope(plan is not None and plan.norm_output):
        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    q_states = q_states.view(query_shape).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    # Single-head 4-D latents, as transformers hands them to the cache.
    k_pass = self.kv_a_layernorm(kv_pass).view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)

    q_rot, k_rot = _rope(self, binding, q_rot, k_rot, position_embeddings, position_ids)

    if cache is not None:  # the cache stores the compressed latents
        k_pass, k_rot = update_cache(cache, k_pass, k_rot, self.layer_idx, kwargs)
    query = torch.cat((q_pass, q_rot), dim=-1)
    if spec.position_query_scale:
        query = query * position_query_scale(self, spec, position_ids).to(query.dtype)
    key, value = self.expand_kv(k_pass, k_rot)

    dropout = self.attention_dropout if self.training else 0.0
    packed: PackedSequences | None = kwargs.pop(PACKED_KWARG, None)
    if kwargs.pop(CAUSAL_KWARG, False):  # no sliding window: causal, unmasked
        attention_mask = None
    kwargs.pop(DOCUMENTS_KWARG, None)
    if (
        packed is not None
        and query.dtype in (torch.float16, torch.bfloat16)
        and not dropout
        and self.qk_head_dim == self.v_head_dim <= 256
        and flash_head_size(query, value)
        and cache is None
    ):
        attn_output = varlen_attention(query, key, value, packed, self.scaling, None)
        return self.o_proj(attn_output.reshape(batch_size, seq_length, -1)), None

    attn_output, attn_weights, shared = attention_interface(
        self, binding, query, key, value, attention_mask,
        dropout=dropout, scaling=self.scaling, position_ids=position_ids, **kwargs,
    )  # fmt: skip
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    output = self.o_proj(attn_output)
    if shared is not None:
        output = zero_unattended_rows(output, shared.unattended, self.o_proj)
    return output, attn_weights
