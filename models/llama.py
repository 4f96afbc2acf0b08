"""Llama, the reference layout every other spec differs from, and Llama 4's text model.

Llama 4 (``Llama4ForCausalLM``, ``llama4_text``) interleaves RoPE layers, whose attention is
chunked and whose q and k get an L2 norm after RoPE, with global layers without RoPE, whose query
is scaled by a position-dependent temperature; RoPE rotates interleaved channel pairs (the complex
form). Its MoE blocks (a shared gated expert beside top-1 sigmoid-routed experts, no auxiliary
loss) run every token through every expert as two batched GEMMs, the routing weight applied to
the experts' input by the MoE block (``batched_experts``); the shared expert and the dense layers'
MLPs are plain gated.
"""

from .mini import MINI_VISION_TOWER, MiniConfig, MiniImages, MiniMultimodalConfig, from_size
from .spec import ArchitectureSpec, MultimodalWrapper, RMSNormStyle

LLAMA = ArchitectureSpec(
    model_type="llama",
    module="transformers.models.llama.modeling_llama",
    causal_lm="LlamaForCausalLM",
    attention="LlamaAttention",
    mini_config=MiniConfig(
        "LlamaConfig",
        # Llama 3's RoPE base, not transformers' default: frequencies must come from the model.
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}},
    ),
    rms_norm="LlamaRMSNorm",
    mlp="LlamaMLP",
)

# Llama 4's multimodal model holds the text causal LM itself (``language_model``, with lm_head).
# Mini: 16 x 16 images in 4 x 4 patches, pixel-shuffled by half: four tokens each.
LLAMA4_MULTIMODAL = MultimodalWrapper(
    model_type="llama4",
    module="transformers.models.llama4.modeling_llama4",
    wrapper="Llama4ForConditionalGeneration",
    language_model="language_model",
    mini_config=MiniMultimodalConfig(
        "Llama4Config",
        "Llama4VisionConfig",
        {
            **MINI_VISION_TOWER,
            "intermediate_size": 64,  # the pixel shuffle's output: 16 / 0.5**2
            "image_size": 16,
            "patch_size": 4,
            "vision_output_dim": 32,
            "projector_input_dim": 32,
            "projector_output_dim": 32,
        },
        special_tokens=("image_token_index", "boi_token_index", "eoi_token_index"),
        images=MiniImages("shuffled_tile", around=("boi_token_index", "eoi_token_index")),
    ),
)

# Llama4TextRMSNorm: (x.float() * rsqrt(mean(x^2) + eps)).type_as(x) * weight, Llama's casting.
LLAMA4_RMS_NORM = RMSNormStyle(eps_attr="eps", offset=0.0, casting="llama")

LLAMA4 = ArchitectureSpec(
    model_type="llama4_text",
    module="transformers.models.llama4.modeling_llama4",
    causal_lm="Llama4ForCausalLM",
    attention="Llama4TextAttention",
    mini_config=MiniConfig(
        "Llama4TextConfig",
        {
            # RoPE (chunked) and no-RoPE (global) layers in turn, the no-RoPE ones MoE, the RoPE
            # ones dense: every kind of layer in two. Chunks shorter than the sequences, and a
            # temperature that grows within them (the real models': floor_scale 8192, attn_scale
            # 0.1, chunks of 8192).
            "no_rope_layer_interval": 2,
            "attention_chunk_size": from_size("sliding_window"),
            "floor_scale": 2,
            "attn_scale": 0.5,
            "interleave_moe_layer_step": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size": from_size("head_dim"),  # the experts' and the shared expert's
            "intermediate_size_mlp": from_size("intermediate_size"),  # the dense layers'
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
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
