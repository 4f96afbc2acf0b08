"""Mini-model configs: one per supported architecture, in two sizes.

``tiny`` is small enough to train for 32 steps on two CPU cores with the Triton kernels running
through the interpreter. ``full`` matches Liger-Kernel's mini models (4 layers, hidden 1024,
vocab 32000) and is what the GPU suite trains.

Every config keeps what makes its architecture different from llama, because that is what the
patch has to get right: qwen2's attention bias, qwen3's q/k norms, gemma's scaled embeddings,
(1 + w) norms and tied lm_head, gemma2's final-logit and attention softcaps and alternating sliding
windows, gemma3's per-layer-type RoPE bases and query pre-attention scalar, and mistral's sliding
window. Sliding windows are set shorter than the longest documents so that they actually clip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

__all__ = ["ARCHITECTURES", "SIZES", "Architecture", "Size", "build_model", "make_config"]


@dataclass(frozen=True)
class Size:
    """Shape of a mini model and of the batches it trains on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    docs_per_step: int
    min_doc_len: int
    max_doc_len: int


SIZES: dict[str, Size] = {
    # vocab 509 is odd on purpose: every vocab block ends in a masked tail. Few, short documents:
    # on CPU the Triton interpreter's cost grows with the number of token rows.
    "tiny": Size(
        vocab_size=509,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        docs_per_step=2,
        min_doc_len=6,
        max_doc_len=16,
    ),
    # Liger's mini models: 4 layers, hidden 1024, intermediate 2048, 8 heads over 2 KV heads, vocab
    # 32000 (not a multiple of any power-of-two vocab block, so the tail is exercised too).
    "full": Size(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        sliding_window=256,
        docs_per_step=8,
        min_doc_len=32,
        max_doc_len=512,
    ),
}


@dataclass(frozen=True)
class Architecture:
    """How to build one architecture's mini model."""

    config_class: str
    model_class: str
    # Extra config arguments; callables receive the Size and return the value.
    extra: dict[str, Any] = field(default_factory=dict)
    # gemma2 supports only eager attention (its attention softcap is not expressible in SDPA).
    attn_implementation: str = "sdpa"


def _alternating(size: Size) -> list[str]:
    """Sliding and full attention layers in turn, so that even two layers have both kinds."""
    return [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(size.num_hidden_layers)
    ]


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    "mistral": Architecture(
        "MistralConfig", "MistralForCausalLM", {"sliding_window": lambda s: s.sliding_window}
    ),
    "qwen2": Architecture("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen3": Architecture("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0}),
    "gemma": Architecture("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": Architecture(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "sliding_window": lambda s: s.sliding_window,
            "layer_types": _alternating,
            "query_pre_attn_scalar": lambda s: s.head_dim,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        attn_implementation="eager",
    ),
    "gemma3": Architecture(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "sliding_window": lambda s: s.sliding_window,
            "layer_types": _alternating,
            "query_pre_attn_scalar": lambda s: s.head_dim,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
}


def make_config(name: str, size: str | Size = "tiny") -> transformers.PretrainedConfig:
    """The config of ``name``'s mini model at ``size`` ("tiny" or "full")."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(ARCHITECTURES)}")
    s = SIZES[size] if isinstance(size, str) else size
    arch = ARCHITECTURES[name]
    kwargs: dict[str, Any] = {
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": 2 * s.max_doc_len * s.docs_per_step,
        # Without a cache the HF mask builder honours restarting position_ids (packed rows); with
        # one it lets packed documents attend to each other.
        "use_cache": False,
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    for key, value in arch.extra.items():
        kwargs[key] = value(s) if callable(value) else value
    if "rope_theta" in kwargs:  # transformers 5 keeps RoPE settings in rope_parameters
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    config = getattr(transformers, arch.config_class)(**kwargs)
    config._attn_implementation = arch.attn_implementation
    return config


def build_model(
    name: str,
    size: str | Size = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> transformers.PreTrainedModel:
    """A freshly initialised mini model; the same ``seed`` gives the same weights on any device."""
    config = make_config(name, size)
    model_class = getattr(transformers, ARCHITECTURES[name].model_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)  # initialised in fp32 on the CPU: identical everywhere
    return model.to(device=device, dtype=dtype)
