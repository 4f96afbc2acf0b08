"""Qwen2 and Qwen3: per-layer sliding windows; Qwen3 normalises q and k before RoPE."""

from .spec import ArchitectureSpec

QWEN2 = ArchitectureSpec(
    model_type="qwen2",
    module="transformers.models.qwen2.modeling_qwen2",
    causal_lm="Qwen2ForCausalLM",
    attention="Qwen2Attention",
    rms_norm="Qwen2RMSNorm",
    mlp="Qwen2MLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
)

QWEN3 = ArchitectureSpec(
    model_type="qwen3",
    module="transformers.models.qwen3.modeling_qwen3",
    causal_lm="Qwen3ForCausalLM",
    attention="Qwen3Attention",
    rms_norm="Qwen3RMSNorm",
    mlp="Qwen3MLP",
    qk_norm=True,
    attention_kwargs=(("sliding_window", "sliding_window"),),
)
