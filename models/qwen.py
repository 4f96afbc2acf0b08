"""Qwen2 and Qwen3: per-layer sliding windows; Qwen3 normalises q and k before RoPE. Their MoE
variants route each token to a few experts (router auxiliary loss; experts left to transformers);
Qwen2-MoE adds a shared gated expert, Qwen3-MoE keeps dense gated MLPs on ``mlp_only_layers``."""

from .mini import MiniConfig, from_size
from .spec import ArchitectureSpec

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
