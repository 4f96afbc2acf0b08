"""The mini configs of the Gemma family (``surgery.models.gemma``), by ``model_type``. Gemma has
no entry: transformers' ``GemmaConfig`` at the mini size is its mini config (``mini_config``)."""

import dataclasses

from ..mini import (
    MINI_VISION_TOWER,
    MiniConfig,
    MiniMultimodalConfig,
    MiniSize,
    alternating_layer_types,
    from_size,
)

# Local and global RoPE frequencies that differ in base and in type (linear scaling). Global base
# 5e5, not 1e6: with 1e6 the convergence run of Gemma3 at seed 0 lands where AdamW amplifies
# noise-level gradients, and transformers' own eager and sdpa runs drift apart beyond the fp32
# budget.
_MINI_LOCAL_GLOBAL_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "rope_theta": 500_000.0, "factor": 4.0},
}


def kv_sharing_layers(size: MiniSize) -> int:
    """Three layers at least: one of each attention type that stores its keys and values, then one
    that reuses them (``num_kv_shared_layers=1``)."""
    return max(size.num_hidden_layers, 3)


def kv_sharing_layer_types(size: MiniSize) -> list[str]:
    """Sliding and full attention in turn over ``kv_sharing_layers``: with three, the last layer
    (sliding) reuses the first one's keys and values."""
    return alternating_layer_types(
        dataclasses.replace(size, num_hidden_layers=kv_sharing_layers(size))
    )


def kv_sharing_layer_types_last_full(size: MiniSize) -> list[str]:
    """The same with the last layer full (Gemma 4 forces it): with three, it reuses the second
    one's keys and values."""
    return [*kv_sharing_layer_types(size)[:-1], "full_attention"]


def twice_head_dim(size: MiniSize) -> int:
    """Gemma 4's ``global_head_dim``: the full-attention layers' own head dim."""
    return 2 * size.head_dim


def no_activation_sparsity(size: MiniSize) -> list[float]:
    """Gemma 3n's per-layer activation sparsity, zero everywhere: every MLP plain gated (one with
    sparsity keeps its own forward; tests/models/test_gemma_kv_sharing.py covers that)."""
    return [0.0] * kv_sharing_layers(size)


MINI_CONFIGS: dict[str, MiniConfig] = {
    "gemma2": MiniConfig(
        "Gemma2Config",
        {
            "sliding_window": from_size("sliding_window"),
            "layer_types": alternating_layer_types,
            "query_pre_attn_scalar": from_size("head_dim"),
            # Caps small enough to bend a tiny model's logits beyond the fp32 tolerance.
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
        attn_implementation="eager",
    ),
    "gemma3_text": MiniConfig(
        "Gemma3TextConfig",
        {
            "sliding_window": from_size("sliding_window"),
            "layer_types": alternating_layer_types,
            "query_pre_attn_scalar": from_size("head_dim"),
            # Off in Gemma3's own config, on here so that the spec's logit_softcap is exercised:
            # 3.0 bends a tiny model's logits well beyond the fp32 tolerance (5.0 barely does).
            "final_logit_softcapping": 3.0,
            "rope_parameters": _MINI_LOCAL_GLOBAL_ROPE,
        },
    ),
    "gemma3n_text": MiniConfig(
        "Gemma3nTextConfig",
        {
            "num_hidden_layers": kv_sharing_layers,
            "layer_types": kv_sharing_layer_types,
            "num_kv_shared_layers": 1,
            "sliding_window": from_size("sliding_window"),
            "activation_sparsity_pattern": no_activation_sparsity,
            # The per-layer embedding table is (vocab_size_per_layer_input, layers * width): kept
            # as small as the model.
            "vocab_size_per_layer_input": from_size("vocab_size"),
            "hidden_size_per_layer_input": from_size("head_dim"),
            "laurel_rank": from_size("head_dim"),
            "final_logit_softcapping": 3.0,
            "rope_parameters": _MINI_LOCAL_GLOBAL_ROPE,
        },
    ),
    # Every kind of dense layer of the Gemma 4 family in one mini model: the full-attention layers
    # have a head dim of their own, keys that are also the values (attention_k_eq_v) with fewer
    # heads, and proportional RoPE over a quarter of it; the last layer reuses the keys and values
    # of the full-attention layer before it (its MLP twice as wide); per-layer input embeddings.
    # The mixture of experts beside the MLPs (26B-A4B; no auxiliary loss, experts and router left
    # to transformers) is tested with GEMMA4_MOE_ARGUMENTS in tests/models/test_gemma_kv_sharing.py:
    # a mini router's near-tied experts flip under half precision, so the autocast comparisons of
    # the registry's tests would measure the flips, not the kernels.
    "gemma4_text": MiniConfig(
        "Gemma4TextConfig",
        {
            "num_hidden_layers": kv_sharing_layers,
            "layer_types": kv_sharing_layer_types_last_full,
            "num_kv_shared_layers": 1,
            "use_double_wide_mlp": True,
            "sliding_window": from_size("sliding_window"),
            "global_head_dim": twice_head_dim,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "vocab_size_per_layer_input": from_size("vocab_size"),
            "hidden_size_per_layer_input": from_size("head_dim"),
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 500_000.0,
                },
            },
        },
    ),
}

# Gemma 4's mixture of experts, on top of its mini config: four experts, two per token.
GEMMA4_MOE_ARGUMENTS = {
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": from_size("head_dim"),
}

MINI_MULTIMODAL_CONFIGS: dict[str, MiniMultimodalConfig] = {
    # 16 x 16 images in 4 x 4 patches, pooled to four tokens each.
    "gemma3": MiniMultimodalConfig(
        "Gemma3Config",
        "SiglipVisionConfig",
        {**MINI_VISION_TOWER, "image_size": 16, "patch_size": 4},
        special_tokens=("image_token_index", "boi_token_index", "eoi_token_index"),
        arguments={"mm_tokens_per_image": 4},
    ),
    # No audio tower; 4 x 4 patches of 4 x 4 pixels, pooled 2 x 2: four tokens per image.
    "gemma4": MiniMultimodalConfig(
        "Gemma4Config",
        "Gemma4VisionConfig",
        {
            **MINI_VISION_TOWER,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "patch_size": 4,
            "pooling_kernel_size": 2,
            "position_embedding_size": 64,
        },
        special_tokens=(
            "image_token_id",
            "boi_token_id",
            "eoi_token_id",
            "video_token_id",
            "audio_token_id",
            "boa_token_id",
            "eoa_token_index",
        ),
    ),
}
