"""Gemma, Gemma2, Gemma3 (text): RMSNorm scaled by (1 + weight) in fp32, GeGLU MLPs, tied lm_head;
Gemma2/3 cap the final logits; Gemma2 also caps the attention logits; Gemma3 normalises q and k and
has separate local and global RoPE frequencies."""

from .spec import GEMMA_RMS_NORM, ArchitectureSpec

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
)
