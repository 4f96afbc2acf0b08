"""Llama, the reference layout every other spec differs from, and Llama 4's text model.

Llama 4 (``Llama4ForCausalLM``, ``llama4_text``) interleaves RoPE layers, whose attention is
chunked and whose q and k get an L2 norm after RoPE, with global layers without RoPE, whose query
is scaled by a position-dependent temperature; RoPE rotates interleaved channel pairs (the complex
form). Its MoE blocks (a shared gated expert beside top-1 sigmoid-routed experts, no auxiliary
loss) run every token through every expert as two batched GEMMs, the routing weight applied to
the experts' input by the MoE block (``batched_experts``); the shared expert and the dense layers'
MLPs are plain gated.
"""

from .spec import ArchitectureSpec, MiniImages, MultimodalWrapper, RMSNormStyle

LLAMA = ArchitectureSpec(
    model_type="llama",
    module="transformers.models.llama.modeling_llama",
    causal_lm="LlamaForCausalLM",
    attention="LlamaAttention",
    rms_norm="LlamaRMSNorm",
    mlp="LlamaMLP",
)

# Llama 4's multimodal model holds the text causal LM itself (``language_model``, with lm_head).
LLAMA4_MULTIMODAL = MultimodalWrapper(
    model_type="llama4",
    module="transformers.models.llama4.modeling_llama4",
    wrapper="Llama4ForConditionalGeneration",
    language_model="language_model",
    images=MiniImages("shuffled_tile", around=("boi_token_index", "eoi_token_index")),
)

# Llama4TextRMSNorm: (x.float() * rsqrt(mean(x^2) + eps)).type_as(x) * weight, Llama's casting.
LLAMA4_RMS_NORM = RMSNormStyle(eps_attr="eps", offset=0.0, casting="llama")

LLAMA4 = ArchitectureSpec(
    model_type="llama4_text",
    module="transformers.models.llama4.modeling_llama4",
    causal_lm="Llama4ForCausalLM",
    attention="Llama4TextAttention",
    rms_norm="Llama4TextRMSNorm",
    rms_norm_style=LLAMA4_RMS_NORM,
    mlp="Llama4TextMLP",  # the dense layers' MLP and the MoE blocks' shared expert
    batched_experts="Llama4TextExperts",
    rope_layout="interleaved",
    rope_layer_attr="use_rope",
    post_rope_qk_norm="qk_norm",
    attention_temperature=True,
    chunked_attention=True,
    positions_to_attention=True,
    eager_softmax_fp32=False,
    multimodal=(LLAMA4_MULTIMODAL,),
)
