"""Gemma, Gemma2, Gemma3 (text): RMSNorm scaled by (1 + weight) in fp32, GeGLU MLPs, tied lm_head;
Gemma2/3 cap the final logits; Gemma2 also caps the attention logits; Gemma3 normalises q and k and
has separate local and global RoPE frequencies."""

from .mini import MiniConfig, alternating_layer_types, from_size
from .spec import GEMMA_RMS_NORM, ArchitectureSpec

GEMMA = ArchitectureSpec(
    model_type="gemma",
    module="transformers.models.gemma.modeling_gemma",
    causal_lm="GemmaForCausalLM",
    attention="GemmaAttention",
    mini_config=MiniConfig("GemmaConfig"),
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
    mini_config=MiniConfig(
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
    mini_config=MiniConfig(
        "Gemma3TextConfig",
        {
            "sliding_window": from_size("sliding_window"),
            "layer_types": alternating_layer_types,
            "query_pre_attn_scalar": from_size("head_dim"),
            # Off in Gemma3's own config, on here so that the spec's logit_softcap is exercised:
            # 3.0 bends a tiny model's logits well beyond the fp32 tolerance (5.0 barely does).
            "final_logit_softcapping": 3.0,
            # Local and global frequencies differ in base and in type (linear scaling). Global base
            # 5e5, not 1e6: with 1e6 the convergence run at seed 0 lands where AdamW amplifies
            # noise-level gradients, and transformers' own eager and sdpa runs drift apart beyond
            # the fp32 budget.
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 500_000.0, "factor": 4.0},
            },
        },
    ),
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
