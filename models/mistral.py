"""Mistral: Llama plus a sliding window read from the config. Ministral: Mistral with the window on
the layers its config's ``layer_types`` makes sliding (read from each attention module)."""

from .mini import MiniConfig, alternating_layer_types, from_size
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

MINISTRAL = ArchitectureSpec(
    model_type="ministral",
    module="transformers.models.ministral.modeling_ministral",
    causal_lm="MinistralForCausalLM",
    attention="MinistralAttention",
    mini_config=MiniConfig(
        "MinistralConfig",
        {"sliding_window": from_size("sliding_window"), "layer_types": alternating_layer_types},
    ),
    rms_norm="MinistralRMSNorm",
    mlp="MinistralMLP",
    attention_kwargs=(("sliding_window", "sliding_window"),),
)
