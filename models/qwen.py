"""Qwen2 and Qwen3: per-layer sliding windows; Qwen3 normalises q and k before RoPE. Their MoE
variants route each token to a few experts (router auxiliary loss; experts left to transformers);
Qwen2-MoE adds a shared gated expert, Qwen3-MoE keeps dense gated MLPs on ``mlp_only_layers``.

Qwen3-Next and Qwen3.5 (dense and MoE) are hybrids: most layers are linear attention
(GatedDeltaNet: a causal convolution and a gated delta-rule recurrence, left to transformers and
given the documents of a packed batch), every few a full attention layer whose ``q_proj`` also
yields an output gate, with RoPE on a slice of the head dim and zero-centred (Gemma-style) RMSNorms
everywhere but inside the linear attention. Their MoE blocks add a sigmoid-gated shared expert."""

from __future__ import annotations

from .mini import MiniConfig, MiniSize, from_size
from .spec import GEMMA_RMS_NORM, ArchitectureSpec

# The layers from max_window_layers on slide: full and sliding layers in one model.
_MINI_ARGUMENTS = {
    "use_sliding_window": True,
    "sliding_window": from_size("sliding_window"),
    "max_window_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}

QWEN2 = ArchitectureSpec(
    model_type="qwen2",
    module="transformers.models.qwen2.modeling_qwen2",
    causal_lm="Qwen2ForCausalLM",
    attention="Qwen2Attention",
    mini_config=MiniConfig("Qwen2Config", _MINI_ARGUMENTS),
    rms_norm="Qwen2RMSNorm",
    mlp="Qwen2MLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
)

QWEN3 = ArchitectureSpec(
    model_type="qwen3",
    module="transformers.models.qwen3.modeling_qwen3",
    causal_lm="Qwen3ForCausalLM",
    attention="Qwen3Attention",
    mini_config=MiniConfig("Qwen3Config", _MINI_ARGUMENTS),
    rms_norm="Qwen3RMSNorm",
    mlp="Qwen3MLP",
    qk_norm=True,
    attention_kwargs=(("sliding_window", "sliding_window"),),
)

# Four experts, two per token; the router's auxiliary loss is part of every mini model's trained
# loss, weighted so that a mistake in it shows beside the cross entropy.
_MINI_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": from_size("head_dim"),
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}

QWEN2_MOE = ArchitectureSpec(
    model_type="qwen2_moe",
    module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    causal_lm="Qwen2MoeForCausalLM",
    attention="Qwen2MoeAttention",
    mini_config=MiniConfig(
        "Qwen2MoeConfig",
        {
            **_MINI_ARGUMENTS,
            **_MINI_MOE,
            "shared_expert_intermediate_size": from_size("intermediate_size"),
        },
    ),
    rms_norm="Qwen2MoeRMSNorm",
    mlp="Qwen2MoeMLP",  # the shared expert
    attention_kwargs=(("sliding_window", "sliding_window"),),
    router_aux_loss=True,
)

QWEN3_MOE = ArchitectureSpec(
    model_type="qwen3_moe",
    module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    causal_lm="Qwen3MoeForCausalLM",
    attention="Qwen3MoeAttention",
    # The second layer keeps a dense gated MLP: both kinds of layer in two.
    mini_config=MiniConfig(
        "Qwen3MoeConfig",
        {
            **_MINI_MOE,
            "use_sliding_window": True,  # every layer slides
            "sliding_window": from_size("sliding_window"),
            "mlp_only_layers": [1],
        },
    ),
    rms_norm="Qwen3MoeRMSNorm",
    mlp="Qwen3MoeMLP",
    qk_norm=True,
    attention_kwargs=(("sliding_window", "sliding_window"),),
    router_aux_loss=True,
)


def linear_then_full_attention(size: MiniSize) -> list[str]:
    """Linear-attention and full-attention layers in turn, linear first: even two layers have both
    kinds (the real models have three linear layers per full one)."""
    return [
        "linear_attention" if i % 2 == 0 else "full_attention"
        for i in range(size.num_hidden_layers)
    ]


# Grouped value heads in the linear attention (two value heads per key head, as in the real
# models), RoPE on half the head dim (a quarter in the real models: half keeps two frequencies).
_MINI_HYBRID = {
    "layer_types": linear_then_full_attention,
    "linear_num_key_heads": from_size("num_key_value_heads"),
    "linear_num_value_heads": from_size("num_attention_heads"),
    "linear_key_head_dim": from_size("head_dim"),
    "linear_value_head_dim": from_size("head_dim"),
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.5,
    },
}
_MINI_HYBRID_MOE = {
    **_MINI_MOE,
    **_MINI_HYBRID,
    "shared_expert_intermediate_size": from_size("intermediate_size"),
}

QWEN3_NEXT = ArchitectureSpec(
    model_type="qwen3_next",
    module="transformers.models.qwen3_next.modeling_qwen3_next",
    causal_lm="Qwen3NextForCausalLM",
    attention="Qwen3NextAttention",
    mini_config=MiniConfig("Qwen3NextConfig", _MINI_HYBRID_MOE),
    rms_norm="Qwen3NextRMSNorm",  # not Qwen3NextRMSNormGated (the linear attention's own)
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="Qwen3NextMLP",  # the shared expert (and the layers in mlp_only_layers)
    qk_norm=True,
    router_aux_loss=True,
    attention_output_gate=True,
    linear_attention="Qwen3NextGatedDeltaNet",
)

# Qwen3.5's rotary module has multimodal (3-D) sections; over text positions, which are the same
# in every section, it is plain RoPE from the decoder layers' text position ids.
QWEN3_5 = ArchitectureSpec(
    model_type="qwen3_5_text",
    module="transformers.models.qwen3_5.modeling_qwen3_5",
    causal_lm="Qwen3_5ForCausalLM",
    attention="Qwen3_5Attention",
    mini_config=MiniConfig("Qwen3_5TextConfig", _MINI_HYBRID),
    rms_norm="Qwen3_5RMSNorm",
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="Qwen3_5MLP",
    qk_norm=True,
    attention_output_gate=True,
    linear_attention="Qwen3_5GatedDeltaNet",
)

QWEN3_5_MOE = ArchitectureSpec(
    model_type="qwen3_5_moe_text",
    module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    causal_lm="Qwen3_5MoeForCausalLM",
    attention="Qwen3_5MoeAttention",
    mini_config=MiniConfig("Qwen3_5MoeTextConfig", _MINI_HYBRID_MOE),
    rms_norm="Qwen3_5MoeRMSNorm",
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="Qwen3_5MoeMLP",  # the shared expert
    qk_norm=True,
    router_aux_loss=True,
    attention_output_gate=True,
    linear_attention="Qwen3_5MoeGatedDeltaNet",
)
