"""Mistral: Llama plus a sliding window read from the config. Ministral: Mistral with the window on
the layers its config's ``layer_types`` makes sliding (read from each attention module).
Ministral 3: Mistral (yarn RoPE) whose query is scaled after RoPE by a factor growing with its
position (llama-4 style, ``position_query_scale``). Mistral 4: multi-head latent attention
(``latent_attention``, ``surgery.attention.mla``) with Ministral 3's query scale, and MoE layers (a
shared expert, no router aux loss) after its first dense ones."""

import dataclasses

from .spec import ArchitectureSpec, MiniImages, MultimodalWrapper

# (height, width) pixels, as Pixtral's processor keeps an image's aspect.
_PIXTRAL_SIZES = ((32, 32), (16, 32), (32, 16))

# Mistral 3 (Mistral Small 3.x, Ministral 3): a Pixtral vision tower around a Mistral or a
# Ministral 3 text model.
MISTRAL3_MULTIMODAL = MultimodalWrapper(
    model_type="mistral3",
    module="transformers.models.mistral3.modeling_mistral3",
    wrapper="Mistral3ForConditionalGeneration",
    images=MiniImages("pixels", {"tiny": _PIXTRAL_SIZES, "full": _PIXTRAL_SIZES}),
)

MISTRAL = ArchitectureSpec(
    model_type="mistral",
    module="transformers.models.mistral.modeling_mistral",
    causal_lm="MistralForCausalLM",
    attention="MistralAttention",
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
    rms_norm="MinistralRMSNorm",
    mlp="MinistralMLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
)

# Mistral with yarn RoPE and the query scale; a text model of Mistral 3 too.
MINISTRAL3 = dataclasses.replace(
    MISTRAL,
    model_type="ministral3",
    module="transformers.models.ministral3.modeling_ministral3",
    causal_lm="Ministral3ForCausalLM",
    attention="Ministral3Attention",
    rms_norm="Ministral3RMSNorm",
    mlp="Ministral3MLP",
    position_query_scale=True,
)

MISTRAL4 = ArchitectureSpec(
    model_type="mistral4",
    module="transformers.models.mistral4.modeling_mistral4",
    causal_lm="Mistral4ForCausalLM",
    attention="Mistral4Attention",
    rms_norm="Mistral4RMSNorm",  # q_a_layernorm and kv_a_layernorm too
    mlp="Mistral4MLP",  # the dense layers' and the shared experts
    position_query_scale=True,
    latent_attention=True,
)

# Mixtral: Mistral with sparse mixture-of-experts MLPs (experts left to transformers) and the
# router's auxiliary loss.
MIXTRAL = ArchitectureSpec(
    model_type="mixtral",
    module="transformers.models.mixtral.modeling_mixtral",
    causal_lm="MixtralForCausalLM",
    attention="MixtralAttention",
    rms_norm="MixtralRMSNorm",
    attention_kwargs=(("sliding_window", "config.sliding_window"),),
    router_aux_loss=True,
)
