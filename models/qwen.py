"""Qwen2 and Qwen3: per-layer sliding windows; Qwen3 normalises q and k before RoPE."""

from .mini import MiniConfig, from_size
from .spec import ArchitectureSpec

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

QWEN3 = ArchitectureSpec(
    model_type="qwen3",
    module="transformers.models.qwen3.modeling_qwen3",
    causal_lm="Qwen3ForCausalLM",
    attention="Qwen3Attention",
    mini_config=MiniConfig("Qwen3Config", _MINI_ARGUMENTS),
    rms_norm="Qwen3RMSNorm",
    mlp="Qwen3MLP",
    qk_norm=True,
    attention_kwargs=(("sliding_window", "sliding_window"),),
)
