"""Mistral: Llama plus a sliding window read from the config."""

from .spec import ArchitectureSpec

MISTRAL = ArchitectureSpec(
    model_type="mistral",
    module="transformers.models.mistral.modeling_mistral",
    causal_lm="MistralForCausalLM",
    attention="MistralAttention",
    rms_norm="MistralRMSNorm",
    mlp="MistralMLP",
    attention_kwargs=(("sliding_window", "config.sliding_window"),),
)
