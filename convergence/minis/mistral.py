"""The mini configs of the Mistral family (``surgery.models.mistral``), by ``model_type``."""

from ..mini import (
    MINI_VISION_TOWER,
    MiniConfig,
    MiniMultimodalConfig,
    MiniSize,
    alternating_layer_types,
    from_size,
)


def yarn_rope_with_query_scale(size: MiniSize) -> dict:
    """Yarn RoPE as the Ministral 3 and Mistral 4 checkpoints ship it, over a short original
    context (half the sliding window, shorter than the test sequences) and with a large beta, so
    that the query scale ``1 + beta * log(1 + floor(position / original))`` changes every few
    positions; ``mscale`` differs from ``mscale_all_dim`` so that yarn's cos/sin scaling (and
    Mistral 4's softmax scale) bite."""
    original = max(1, size.sliding_window // 2)
    return {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": size.max_position_embeddings / original,
        "original_max_position_embeddings": original,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "llama_4_scaling_beta": 0.5,
    }


def half_head_dim(size: MiniSize) -> int:
    """Mistral 4's split of the query/key head: as many channels without RoPE as with."""
    return size.head_dim // 2


def twice_head_dim(size: MiniSize) -> int:
    return 2 * size.head_dim


def thrice_head_dim(size: MiniSize) -> int:
    return 3 * size.head_dim


# Multi-head latent attention with the shipped shape in small: key/value heads as many as query
# heads (transformers' MLA expands its latents to every head), q/k heads half without RoPE and half
# with, values as wide as q/k heads (flash's varlen kernel takes a packed batch then); both
# low-rank widths differ from the hidden size. The first layer dense, the second MoE: four
# experts, two per token, a shared expert.
_MINI_MISTRAL4 = {
    "num_key_value_heads": from_size("num_attention_heads"),
    "qk_nope_head_dim": half_head_dim,
    "qk_rope_head_dim": half_head_dim,
    "v_head_dim": from_size("head_dim"),
    "kv_lora_rank": twice_head_dim,
    "q_lora_rank": thrice_head_dim,
    "rope_parameters": yarn_rope_with_query_scale,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": from_size("head_dim"),
}

MINI_CONFIGS: dict[str, MiniConfig] = {
    "mistral": MiniConfig("MistralConfig", {"sliding_window": from_size("sliding_window")}),
    "ministral": MiniConfig(
        "MinistralConfig",
        {"sliding_window": from_size("sliding_window"), "layer_types": alternating_layer_types},
    ),
    "ministral3": MiniConfig(
        "Ministral3Config",
        {
            "sliding_window": from_size("sliding_window"),
            "rope_parameters": yarn_rope_with_query_scale,
        },
    ),
    "mistral4": MiniConfig("Mistral4Config", _MINI_MISTRAL4),
    # Four experts, two per token, the aux loss weighted so that a mistake in it shows beside the
    # cross entropy.
    "mixtral": MiniConfig(
        "MixtralConfig",
        {
            "sliding_window": from_size("sliding_window"),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
}

MINI_MULTIMODAL_CONFIGS: dict[str, MiniMultimodalConfig] = {
    # 32 x 32 images in 8 x 8 patches, merged 2 x 2: four tokens each.
    "mistral3": MiniMultimodalConfig(
        "Mistral3Config",
        "PixtralVisionConfig",
        {**MINI_VISION_TOWER, "head_dim": 8, "image_size": 32, "patch_size": 8},
        special_tokens=("image_token_index",),
        arguments={"spatial_merge_size": 2},
    ),
}
