"""Llama: the reference layout every other spec differs from."""

from .spec import ArchitectureSpec

LLAMA = ArchitectureSpec(
    model_type="llama",
    module="transformers.models.llama.modeling_llama",
    causal_lm="LlamaForCausalLM",
    attention="LlamaAttention",
    rms_norm="LlamaRMSNorm",
    mlp="LlamaMLP",
)
