"""Gemma, Gemma2, Gemma3 (text): RMSNorm scaled by (1 + weight) in fp32, GeGLU MLPs, tied lm_head;
Gemma2/3 cap the final logits; Gemma2 also caps the attention logits; Gemma3 normalises q and k and
has separate local and global RoPE frequencies.

Gemma 3n and Gemma 4 (text) scale their RMSNorm by the weight itself (in fp32), normalise the values
too (a norm without a scale), and let their last layers reuse the keys and values of earlier ones
(KV sharing). What is theirs alone stays with transformers: per-layer input embeddings, Gemma 3n's
AltUp and Laurel blocks and its MLPs with activation sparsity, Gemma 4's experts and router."""

import dataclasses

from .spec import GEMMA_RMS_NORM, ArchitectureSpec, MiniImages, MultimodalWrapper, RMSNormStyle

# Gemma 3: a SigLIP tower; the images' tokens attend to each other in both directions
# (``token_type_ids``). Its wrapper does not apply the text config's final softcap.
GEMMA3_MULTIMODAL = MultimodalWrapper(
    model_type="gemma3",
    module="transformers.models.gemma3.modeling_gemma3",
    wrapper="Gemma3ForConditionalGeneration",
    bidirectional_tokens="token_type_ids",
    images=MiniImages("square", around=("boi_token_index", "eoi_token_index")),
)

# (height, width) patch grids of Gemma 4's images.
_GEMMA4_GRIDS = ((4, 4), (2, 4), (4, 2))

# Gemma 4: its own vision tower (patches with 2-D positions, pooled) and an audio tower; image
# tokens attend both ways where the text config's use_bidirectional_attention is "vision"
# (``mm_token_type_ids``).
GEMMA4_MULTIMODAL = MultimodalWrapper(
    model_type="gemma4",
    module="transformers.models.gemma4.modeling_gemma4",
    wrapper="Gemma4ForConditionalGeneration",
    logit_softcap=True,
    bidirectional_tokens="mm_token_type_ids",
    bidirectional_when=("use_bidirectional_attention", "vision"),
    # Its processor pads each image to one patch budget.
    images=MiniImages(
        "positioned_patches",
        {"tiny": _GEMMA4_GRIDS, "full": _GEMMA4_GRIDS},
        around=("boi_token_id", "eoi_token_id"),
        patch_budget=16,
    ),
)

GEMMA = ArchitectureSpec(
    model_type="gemma",
    module="transformers.models.gemma.modeling_gemma",
    causal_lm="GemmaForCausalLM",
    attention="GemmaAttention",
    rms_norm="GemmaRMSNorm",
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="GemmaMLP",
    tied_lm_head=True,
)

GEMMA2 = ArchitectureSpec(
    model_type="gemma2",
    module="transformers.models.gemma2.modeling_gemma2",
    causal_lm="Gemma2ForCausalLM",
    attention="Gemma2Attention",
    rms_norm="Gemma2RMSNorm",
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="Gemma2MLP",
    mlp_activation_attr="hidden_activation",
    attention_kwargs=(("sliding_window", "sliding_window"), ("softcap", "attn_logit_softcapping")),
    logit_softcap="final_logit_softcapping",
    tied_lm_head=True,
)

GEMMA3 = ArchitectureSpec(
    model_type="gemma3_text",
    module="transformers.models.gemma3.modeling_gemma3",
    causal_lm="Gemma3ForCausalLM",
    attention="Gemma3Attention",
    rms_norm="Gemma3RMSNorm",
    rms_norm_style=GEMMA_RMS_NORM,
    mlp="Gemma3MLP",
    mlp_activation_attr="hidden_activation",
    rope_per_layer_type=True,
    qk_norm=True,
    attention_kwargs=(("sliding_window", "sliding_window"),),
    logit_softcap="final_logit_softcapping",
    tied_lm_head=True,
    multimodal=(GEMMA3_MULTIMODAL,),
)

# Gemma 3n and Gemma 4: ``(normed * weight.float()).type_as(x)``, the weight starting at one.
GEMMA3N_RMS_NORM = RMSNormStyle(eps_attr="eps", offset=0.0, casting="gemma")

# Gemma 3 with the weight-scaled norms, normalised values and KV sharing; its MLPs' activation
# sparsity is read per layer.
GEMMA3N = dataclasses.replace(
    GEMMA3,
    model_type="gemma3n_text",
    module="transformers.models.gemma3n.modeling_gemma3n",
    causal_lm="Gemma3nForCausalLM",
    attention="Gemma3nTextAttention",
    rms_norm="Gemma3nRMSNorm",
    rms_norm_style=GEMMA3N_RMS_NORM,
    mlp="Gemma3nTextMLP",
    mlp_sparsity_attr="activation_sparsity",
    v_norm=True,
    kv_sharing=True,
    multimodal=(),
)

# Gemma 3 with the weight-scaled norms, normalised values and KV sharing, as Gemma 3n.
GEMMA4 = dataclasses.replace(
    GEMMA3,
    model_type="gemma4_text",
    module="transformers.models.gemma4.modeling_gemma4",
    causal_lm="Gemma4ForCausalLM",
    attention="Gemma4TextAttention",
    rms_norm="Gemma4RMSNorm",
    rms_norm_style=GEMMA3N_RMS_NORM,
    mlp="Gemma4TextMLP",
    v_norm=True,
    kv_sharing=True,
    multimodal=(GEMMA4_MULTIMODAL,),
)
