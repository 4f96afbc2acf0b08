"""Qwen2 and Qwen3: per-layer sliding windows; Qwen3 normalises q and k before RoPE. Their MoE
variants route each token to a few experts (router auxiliary loss; experts left to transformers);
Qwen2-MoE adds a shared gated expert, Qwen3-MoE keeps dense gated MLPs on ``mlp_only_layers``.

Qwen3-Next and Qwen3.5 (dense and MoE) are hybrids: most layers are linear attention
(GatedDeltaNet: a causal convolution and a gated delta-rule recurrence, left to transformers and
given the documents of a packed batch), every few a full attention layer whose ``q_proj`` also
yields an output gate, with RoPE on a slice of the head dim and zero-centred (Gemma-style) RMSNorms
everywhere but inside the linear attention. Their MoE blocks add a sigmoid-gated shared expert."""

from __future__ import annotations

import dataclasses

from .mini import (
    MiniConfig,
    MiniImages,
    MiniMultimodalConfig,
    MiniSize,
    from_size,
    text_hidden_size,
)
from .spec import GEMMA_RMS_NORM, ArchitectureSpec, MultimodalWrapper

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

QWEN3 = dataclasses.replace(
    QWEN2,
    model_type="qwen3",
    module="transformers.models.qwen3.modeling_qwen3",
    causal_lm="Qwen3ForCausalLM",
    attention="Qwen3Attention",
    mini_config=MiniConfig("Qwen3Config", _MINI_ARGUMENTS),
    rms_norm="Qwen3RMSNorm",
    mlp="Qwen3MLP",
    qk_norm=True,
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

QWEN2_MOE = dataclasses.replace(
    QWEN2,
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
    router_aux_loss=True,
)

QWEN3_MOE = dataclasses.replace(
    QWEN3,
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
# (t, h, w) patch grids as Qwen's processor gives them, between vision start and end tokens.
_MINI_QWEN_IMAGES = MiniImages(
    "patch_grid",
    {
        "tiny": ((1, 4, 4), (1, 4, 6), (1, 6, 4), (1, 2, 4)),
        "full": ((1, 8, 8), (1, 8, 12), (1, 12, 8), (1, 16, 16)),
    },
    around=("vision_start_token_id", "vision_end_token_id"),
    token_types="mm_token_type_ids",
)


def _qwen_multimodal(
    model_type: str,
    prefix: str,
    vision: dict,
    vision_attention: str | None = None,
    **mini,
) -> MultimodalWrapper:
    """Qwen's multimodal model ``<prefix>ForConditionalGeneration`` of
    ``transformers.models.<model_type>``: its config ``<prefix>Config`` around a vision config
    ``<prefix>VisionConfig`` of arguments ``vision``, with Qwen's vision tokens, its vision tower's
    attention ``vision_attention`` (default ``<prefix>VisionAttention``); ``mini``: the rest of its
    ``MiniMultimodalConfig``."""
    return MultimodalWrapper(
        model_type=model_type,
        module=f"transformers.models.{model_type}.modeling_{model_type}",
        wrapper=f"{prefix}ForConditionalGeneration",
        vision_attention=vision_attention or f"{prefix}VisionAttention",
        mini_config=MiniMultimodalConfig(
            f"{prefix}Config",
            f"{prefix}VisionConfig",
            vision,
            special_tokens=_QWEN_VISION_TOKENS,
            images=_MINI_QWEN_IMAGES,
            **mini,
        ),
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

QWEN3_5_MULTIMODAL = _qwen_multimodal(
    "qwen3_5", "Qwen3_5", _MINI_QWEN3_5_VISION, text_arguments=_MINI_QWEN3_5_ROPE
)
QWEN3_5_MOE_MULTIMODAL = _qwen_multimodal(
    "qwen3_5_moe", "Qwen3_5Moe", _MINI_QWEN3_5_VISION, text_arguments=_MINI_QWEN3_5_ROPE
)

# Qwen3.5's rotary module has multimodal (3-D) sections (interleaved); over text positions, which
# are the same in every section, it is plain RoPE.
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
    mrope=True,
    multimodal=(QWEN3_5_MULTIMODAL,),
)

QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    model_type="qwen3_5_moe_text",
    module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    causal_lm="Qwen3_5MoeForCausalLM",
    attention="Qwen3_5MoeAttention",
    mini_config=MiniConfig("Qwen3_5MoeTextConfig", _MINI_HYBRID_MOE),
    rms_norm="Qwen3_5MoeRMSNorm",
    mlp="Qwen3_5MoeMLP",  # the shared expert
    router_aux_loss=True,
    linear_attention="Qwen3_5MoeGatedDeltaNet",
    multimodal=(QWEN3_5_MOE_MULTIMODAL,),
)


# Text architectures that exist only as the language model of a multimodal model (Qwen2-VL,
# Qwen2.5-VL, Qwen3-VL and its MoE: no causal LM class of their own, ``causal_lm`` None): reached
# through their wrapper (``surgery.multimodal``), listed in ``MULTIMODAL_ONLY_SPECS``. Their text
# mini configs rotate four frequencies in [2, 1, 1] sections (see _MINI_QWEN3_5_ROPE).
_MINI_MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 1, 1]}
_MINI_QWEN2_VL_TEXT = {**_MINI_ARGUMENTS, "rope_parameters": _MINI_MROPE}

QWEN2_VL_MULTIMODAL = _qwen_multimodal(
    "qwen2_vl",
    "Qwen2VL",
    {**_MINI_QWEN_PATCHES, "embed_dim": 16, "hidden_size": text_hidden_size, "mlp_ratio": 2},
    vision_attention="VisionAttention",
)

QWEN2_VL = ArchitectureSpec(
    model_type="qwen2_vl_text",
    module="transformers.models.qwen2_vl.modeling_qwen2_vl",
    causal_lm=None,
    attention="Qwen2VLAttention",
    mini_config=MiniConfig("Qwen2VLTextConfig", _MINI_QWEN2_VL_TEXT),
    rms_norm="Qwen2VLRMSNorm",
    mlp="Qwen2MLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
    mrope=True,
    multimodal=(QWEN2_VL_MULTIMODAL,),
)

QWEN2_5_VL_MULTIMODAL = _qwen_multimodal(
    "qwen2_5_vl",
    "Qwen2_5_VL",
    {
        **_MINI_QWEN_VISION,
        "window_size": 8,  # 2 x 2 patches after merging: windows inside a 4 x 4 image
        "fullatt_block_indexes": [],
    },
)

QWEN2_5_VL = dataclasses.replace(
    QWEN2_VL,
    model_type="qwen2_5_vl_text",
    module="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    attention="Qwen2_5_VLAttention",
    mini_config=MiniConfig("Qwen2_5_VLTextConfig", _MINI_QWEN2_VL_TEXT),
    # The vision blocks' norms are of this class too: surgery patches the language model only.
    rms_norm="Qwen2_5_VLRMSNorm",
    multimodal=(QWEN2_5_VL_MULTIMODAL,),
)

QWEN3_VL_MULTIMODAL = _qwen_multimodal("qwen3_vl", "Qwen3VL", _MINI_QWEN3_VL_VISION)

QWEN3_VL = ArchitectureSpec(
    model_type="qwen3_vl_text",
    module="transformers.models.qwen3_vl.modeling_qwen3_vl",
    causal_lm=None,
    attention="Qwen3VLTextAttention",
    mini_config=MiniConfig("Qwen3VLTextConfig", {"rope_parameters": _MINI_MROPE}),
    rms_norm="Qwen3VLTextRMSNorm",
    mlp="Qwen3VLTextMLP",
    qk_norm=True,
    mrope=True,
    multimodal=(QWEN3_VL_MULTIMODAL,),
)

QWEN3_VL_MOE_MULTIMODAL = _qwen_multimodal("qwen3_vl_moe", "Qwen3VLMoe", _MINI_QWEN3_VL_VISION)

QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL,
    model_type="qwen3_vl_moe_text",
    module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    attention="Qwen3VLMoeTextAttention",
    mini_config=MiniConfig(
        "Qwen3VLMoeTextConfig",
        {**_MINI_MOE, "mlp_only_layers": [1], "rope_parameters": _MINI_MROPE},
    ),
    rms_norm="Qwen3VLMoeTextRMSNorm",
    mlp="Qwen3VLMoeTextMLP",  # the layers in mlp_only_layers
    router_aux_loss=True,
    multimodal=(QWEN3_VL_MOE_MULTIMODAL,),
)
