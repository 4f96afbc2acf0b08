"""Llama: the reference layout every other spec differs from."""

from .mini import MiniConfig
from .spec import ArchitectureSpec

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
