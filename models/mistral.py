"""Mistral: Llama plus a sliding window read from the config. Ministral: Mistral with the window on
the layers its config's ``layer_types`` makes sliding (read from each attention module).
Ministral 3: Mistral (yarn RoPE) whose query is scaled after RoPE by a factor growing with its
position (llama-4 style, ``position_query_scale``). Mistral 4: multi-head latent attention
(``latent_attention``, ``surgery.mla``) with Ministral 3's query scale, and MoE layers (a shared
expert, no router aux loss) after its first dense ones."""

import dataclasses

from .mini import (
    MINI_VISION_TOWER,
    MiniConfig,
    MiniImages,
    MiniMultimodalConfig,
    MiniSize,
    alternating_layer_types,
    from_size,
)
from .spec import ArchitectureSpec, MultimodalWrapper

# (height, width) pixels, as Pixtral's processor keeps an image's aspect.
_PIXTRAL_SIZES = ((32, 32), (16, 32), (32, 16))

# Mistral 3 (Mistral Small 3.x, Ministral 3): a Pixtral vision tower around a Mistral or a
# Ministral 3 text model. Mini: 32 x 32 images in 8 x 8 patches, merged 2 x 2: four tokens each.
MISTRAL3_MULTIMODAL = MultimodalWrapper(
    model_type="mistral3",
    module="transformers.models.mistral3.modeling_mistral3",
    wrapper="Mistral3ForConditionalGeneration",
    mini_config=MiniMultimodalConfig(
        "Mistral3Config",
        "PixtralVisionConfig",
        {**MINI_VISION_TOWER, "head_dim": 8, "image_size": 32, "patch_size": 8},
        special_tokens=("image_token_index",),
        arguments={"spatial_merge_size": 2},
        images=MiniImages("pixels", {"tiny": _PIXTRAL_SIZES, "full": _PIXTRAL_SIZES}),
    ),
)

MISTRAL = ArchitectureSpec(
    model_type="mistral",
    module="transformers.models.mistral.modeling_mistral",
    causal_lm="MistralForCausalLM",
    attention="MistralAttention",
    mini_config=MiniConfig("MistralConfig", {"sliding_window": from_size("sliding_window")}),
    rms_norm="MistralRMSNorm",
    mlp="MistralMLP",
    attention_kwargs=(("sliding_window", "config.sliding_window"),),
    multimodal=(MISTRAL3_MULTIMODAL,),
)

MINISTRAL = ArchitectureSpec(
    model_type="ministral",
    module="transformers.models.ministral.modeling_ministral",
    causal_lm="MinistralForCausalLM",
    attention="MinistralAttention",
    mini_config=MiniConfig(
        "MinistralConfig",
        {"sliding_window": from_size("sliding_window"), "layer_types": alternating_layer_types},
    ),
    rms_norm="MinistralRMSNorm",
    mlp="MinistralMLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
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


# Mistral with yarn RoPE and the query scale; a text model of Mistral 3 too.
MINISTRAL3 = dataclasses.replace(
    MISTRAL,
    model_type="ministral3",
    module="transformers.models.ministral3.modeling_ministral3",
    causal_lm="Ministral3ForCausalLM",
    attention="Ministral3Attention",
    mini_config=MiniConfig(
        "Ministral3Config",
        {
            "sliding_window": from_size("sliding_window"),
            "rope_parameters": yarn_rope_with_query_scale,
        },
    ),
    rms_norm="Ministral3RMSNorm",
    mlp="Ministral3MLP",
    position_query_scale=True,
)


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

MISTRAL4 = ArchitectureSpec(
    model_type="mistral4",
    module="transformers.models.mistral4.modeling_mistral4",
    causal_lm="Mistral4ForCausalLM",
    attention="Mistral4Attention",
    mini_config=MiniConfig("Mistral4Config", _MINI_MISTRAL4),
    rms_norm="Mistral4RMSNorm",  # q_a_layernorm and kv_a_layernorm too
    mlp="Mistral4MLP",  # the dense layers' and the shared experts
    position_query_scale=True,
    latent_attention=True,
)


# Mixtral: Mistral with sparse mixture-of-experts MLPs (experts left to transformers) and the
# router's auxiliary loss; four experts, two per token, the aux loss weighted so that a mistake in
# it shows beside the cross entropy.
MIXTRAL = ArchitectureSpec(
    model_type="mixtral",
    module="transformers.models.mixtral.modeling_mixtral",
    causal_lm="MixtralForCausalLM",
    attention="MixtralAttention",
    mini_config=MiniConfig(
        "MixtralConfig",
        {
            "sliding_window": from_size("sliding_window"),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    rms_norm="MixtralRMSNorm",
    attention_kwargs=(("sliding_window", "config.sliding_window"),),
    router_aux_loss=True,
)
