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

from .spec import GEMMA_RMS_NORM, ArchitectureSpec, MiniImages, MultimodalWrapper

QWEN2 = ArchitectureSpec(
    model_type="qwen2",
    module="transformers.models.qwen2.modeling_qwen2",
    causal_lm="Qwen2ForCausalLM",
    attention="Qwen2Attention",
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
    rms_norm="Qwen3RMSNorm",
    mlp="Qwen3MLP",
    qk_norm=True,
)

QWEN2_MOE = dataclasses.replace(
    QWEN2,
    model_type="qwen2_moe",
    module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    causal_lm="Qwen2MoeForCausalLM",
    attention="Qwen2MoeAttention",
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
    rms_norm="Qwen3MoeRMSNorm",
    mlp="Qwen3MoeMLP",
    router_aux_loss=True,
)

QWEN3_NEXT = ArchitectureSpec(
    model_type="qwen3_next",
    module="transformers.models.qwen3_next.modeling_qwen3_next",
    causal_lm="Qwen3NextForCausalLM",
    attention="Qwen3NextAttention",
    rms_norm="Qwen3NextRMSNorm",  # not Qwen3NextRMSNormGated (the linear attention's own)
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="Qwen3NextMLP",  # the shared expert (and the layers in mlp_only_layers)
    qk_norm=True,
    router_aux_loss=True,
    attention_output_gate=True,
    linear_attention="Qwen3NextGatedDeltaNet",
)

# (t, h, w) patch grids as Qwen's processor gives them, between vision start and end tokens.
_QWEN_IMAGES = MiniImages(
    "patch_grid",
    {
        "tiny": ((1, 4, 4), (1, 4, 6), (1, 6, 4), (1, 2, 4)),
        "full": ((1, 8, 8), (1, 8, 12), (1, 12, 8), (1, 16, 16)),
    },
    around=("vision_start_token_id", "vision_end_token_id"),
    token_types="mm_token_type_ids",
)


def _qwen_multimodal(
    model_type: str, prefix: str, vision_attention: str | None = None
) -> MultimodalWrapper:
    """Qwen's multimodal model ``<prefix>ForConditionalGeneration`` of
    ``transformers.models.<model_type>``, its images laid out by Qwen's processor, its vision
    tower's attention ``vision_attention`` (default ``<prefix>VisionAttention``)."""
    return MultimodalWrapper(
        model_type=model_type,
        module=f"transformers.models.{model_type}.modeling_{model_type}",
        wrapper=f"{prefix}ForConditionalGeneration",
        vision_attention=vision_attention or f"{prefix}VisionAttention",
        images=_QWEN_IMAGES,
    )


QWEN3_5_MULTIMODAL = _qwen_multimodal("qwen3_5", "Qwen3_5")
QWEN3_5_MOE_MULTIMODAL = _qwen_multimodal("qwen3_5_moe", "Qwen3_5Moe")

# Qwen3.5's rotary module has multimodal (3-D) sections (interleaved); over text positions, which
# are the same in every section, it is plain RoPE.
QWEN3_5 = ArchitectureSpec(
    model_type="qwen3_5_text",
    module="transformers.models.qwen3_5.modeling_qwen3_5",
    causal_lm="Qwen3_5ForCausalLM",
    attention="Qwen3_5Attention",
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
    rms_norm="Qwen3_5MoeRMSNorm",
    mlp="Qwen3_5MoeMLP",  # the shared expert
    router_aux_loss=True,
    linear_attention="Qwen3_5MoeGatedDeltaNet",
    multimodal=(QWEN3_5_MOE_MULTIMODAL,),
)


# Text architectures that exist only as the language model of a multimodal model (Qwen2-VL,
# Qwen2.5-VL, Qwen3-VL and its MoE: no causal LM class of their own, ``causal_lm`` None): reached
# through their wrapper (``surgery.forwards.multimodal``), listed in ``MULTIMODAL_ONLY_SPECS``.
QWEN2_VL_MULTIMODAL = _qwen_multimodal("qwen2_vl", "Qwen2VL", vision_attention="VisionAttention")

QWEN2_VL = ArchitectureSpec(
    model_type="qwen2_vl_text",
    module="transformers.models.qwen2_vl.modeling_qwen2_vl",
    causal_lm=None,
    attention="Qwen2VLAttention",
    rms_norm="Qwen2VLRMSNorm",
    mlp="Qwen2MLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
    mrope=True,
    multimodal=(QWEN2_VL_MULTIMODAL,),
)

QWEN2_5_VL_MULTIMODAL = _qwen_multimodal("qwen2_5_vl", "Qwen2_5_VL")

QWEN2_5_VL = dataclasses.replace(
    QWEN2_VL,
    model_type="qwen2_5_vl_text",
    module="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    attention="Qwen2_5_VLAttention",
    # The vision blocks' norms are of this class too: surgery patches the language model only.
    rms_norm="Qwen2_5_VLRMSNorm",
    multimodal=(QWEN2_5_VL_MULTIMODAL,),
)

QWEN3_VL_MULTIMODAL = _qwen_multimodal("qwen3_vl", "Qwen3VL")

QWEN3_VL = ArchitectureSpec(
    model_type="qwen3_vl_text",
    module="transformers.models.qwen3_vl.modeling_qwen3_vl",
    causal_lm=None,
    attention="Qwen3VLTextAttention",
    rms_norm="Qwen3VLTextRMSNorm",
    mlp="Qwen3VLTextMLP",
    qk_norm=True,
    mrope=True,
    multimodal=(QWEN3_VL_MULTIMODAL,),
)

QWEN3_VL_MOE_MULTIMODAL = _qwen_multimodal("qwen3_vl_moe", "Qwen3VLMoe")

QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL,
    model_type="qwen3_vl_moe_text",
    module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    attention="Qwen3VLMoeTextAttention",
    rms_norm="Qwen3VLMoeTextRMSNorm",
    mlp="Qwen3VLMoeTextMLP",  # the layers in mlp_only_layers
    router_aux_loss=True,
    multimodal=(QWEN3_VL_MOE_MULTIMODAL,),
)
