"""Mistral: Llama plus a sliding window read from the config."""

from .mini import MiniConfig, from_size
from .spec import ArchitectureSpec

MISTRAL = ArchitectureSpec(
    model_type="mistral",
    module="transformers.models.mistral.modeling_mistral",
    causal_lm="MistralForCausalLM",
    attention="MistralAttention",
    mini_config=MiniConfig("MistralConfig", {"sliding_window": from_size("sliding_window")}),
    rms_norm="MistralRMSNorm",
    mlp="MistralMLP",
    attention_kwargs=(("sliding_window", "config.sliding_window"),),
)
