"""The mini configs of the Qwen family (``surgery.models.qwen``), by ``model_type``."""

from __future__ import annotations

from ..mini import MiniConfig, MiniMultimodalConfig, MiniSize, from_size, text_hidden_size

# The layers from max_window_layers on slide: full and sliding layers in one model.
_MINI_ARGUMENTS = {
    "use_sliding_window": True,
    "sliding_window": from_size("sliding_window"),
    "max_window_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}

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

# The text models that exist only inside a multimodal model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
# its MoE) rotate four frequencies in [2, 1, 1] sections (see _MINI_QWEN3_5_ROPE).
_MINI_MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 1, 1]}
_MINI_QWEN2_VL_TEXT = {**_MINI_ARGUMENTS, "rope_parameters": _MINI_MROPE}

MINI_CONFIGS: dict[str, MiniConfig] = {
    "qwen2": MiniConfig("Qwen2Config", _MINI_ARGUMENTS),
    "qwen3": MiniConfig("Qwen3Config", _MINI_ARGUMENTS),
    "qwen2_moe": MiniConfig(
        "Qwen2MoeConfig",
        {
            **_MINI_ARGUMENTS,
            **_MINI_MOE,
            "shared_expert_intermediate_size": from_size("intermediate_size"),
        },
    ),
    # The second layer keeps a dense gated MLP: both kinds of layer in two.
    "qwen3_moe": MiniConfig(
        "Qwen3MoeConfig",
        {
            **_MINI_MOE,
            "use_sliding_window": True,  # every layer slides
            "sliding_window": from_size("sliding_window"),
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_next": MiniConfig("Qwen3NextConfig", _MINI_HYBRID_MOE),
    "qwen3_5_text": MiniConfig("Qwen3_5TextConfig", _MINI_HYBRID),
    "qwen3_5_moe_text": MiniConfig("Qwen3_5MoeTextConfig", _MINI_HYBRID_MOE),
    "qwen2_vl_text": MiniConfig("Qwen2VLTextConfig", _MINI_QWEN2_VL_TEXT),
    "qwen2_5_vl_text": MiniConfig("Qwen2_5_VLTextConfig", _MINI_QWEN2_VL_TEXT),
    "qwen3_vl_text": MiniConfig("Qwen3VLTextConfig", {"rope_parameters": _MINI_MROPE}),
    "qwen3_vl_moe_text": MiniConfig(
        "Qwen3VLMoeTextConfig",
        {**_MINI_MOE, "mlp_only_layers": [1], "rope_parameters": _MINI_MROPE},
    ),
}

# Qwen's vision towers in small: one block, patches of 4 x 4 pixels over 2 frames, merged 2 x 2:
# a 1 x 4 x 4 grid of patches is four tokens. Qwen2-VL's tower names its width ``embed_dim`` and
# its output width ``hidden_size``; the later ones name them as other towers do.
_MINI_QWEN_PATCHES = {
    "depth": 1,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}
_MINI_QWEN_VISION = {
    **_MINI_QWEN_PATCHES,
    "hidden_size": 16,
    "intermediate_size": 32,
    "out_hidden_size": text_hidden_size,
}
# Qwen3-VL's and Qwen3.5's towers learn position embeddings; Qwen3-VL's also feeds its first text
# layers (deepstack, left to transformers).
_MINI_QWEN3_5_VISION = {**_MINI_QWEN_VISION, "num_position_embeddings": 16}
_MINI_QWEN3_VL_VISION = {**_MINI_QWEN3_5_VISION, "deepstack_visual_indexes": [0]}
_QWEN_VISION_TOKENS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def _qwen_mini(prefix: str, vision: dict, **mini) -> MiniMultimodalConfig:
    """The mini config of Qwen's multimodal model ``<prefix>ForConditionalGeneration``: its config
    ``<prefix>Config`` around a vision config ``<prefix>VisionConfig`` of arguments ``vision``,
    with Qwen's vision tokens; ``mini``: the rest of its ``MiniMultimodalConfig``."""
    return MiniMultimodalConfig(
        f"{prefix}Config",
        f"{prefix}VisionConfig",
        vision,
        special_tokens=_QWEN_VISION_TOKENS,
        **mini,
    )


# Four rotary frequencies over the mini head (the real models rotate a slice: the text mini
# config tests that), two temporal, one height, one width: the contiguous and interleaved layouts
# of the sections differ ([t, t, h, w] against [t, h, w, t]).
_MINI_QWEN3_5_ROPE = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 1.0,
        "mrope_section": [2, 1, 1],
    }
}

MINI_MULTIMODAL_CONFIGS: dict[str, MiniMultimodalConfig] = {
    "qwen3_5": _qwen_mini("Qwen3_5", _MINI_QWEN3_5_VISION, text_arguments=_MINI_QWEN3_5_ROPE),
    "qwen3_5_moe": _qwen_mini(
        "Qwen3_5Moe", _MINI_QWEN3_5_VISION, text_arguments=_MINI_QWEN3_5_ROPE
    ),
    "qwen2_vl": _qwen_mini(
        "Qwen2VL",
        {**_MINI_QWEN_PATCHES, "embed_dim": 16, "hidden_size": text_hidden_size, "mlp_ratio": 2},
    ),
    "qwen2_5_vl": _qwen_mini(
        "Qwen2_5_VL",
        {
            **_MINI_QWEN_VISION,
            "window_size": 8,  # 2 x 2 patches after merging: windows inside a 4 x 4 image
            "fullatt_block_indexes": [],
        },
    ),
    "qwen3_vl": _qwen_mini("Qwen3VL", _MINI_QWEN3_VL_VISION),
    "qwen3_vl_moe": _qwen_mini("Qwen3VLMoe", _MINI_QWEN3_VL_VISION),
}
