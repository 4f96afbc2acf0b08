"""Mini-model configs: one per supported architecture (``surgery.models.SPECS``) and per model the
suite proves the loss-only fallback on (``FALLBACK_SPECS``), in two sizes.

``tiny`` is small enough to train for 32 steps on two CPU cores with the Triton kernels running
through the interpreter. ``full`` matches Liger-Kernel's mini models (4 layers, hidden 1024,
vocab 32000) and is what the GPU suite trains.

What makes each architecture different from llama comes from its mini config (``minis``, by
``model_type``), because that is what the patch has to get right (sliding windows, softcaps, layer
types, RoPE parameters, q/k norms, tied heads); this file only adds the sizes. Sliding windows are
set shorter than the longest documents so that they actually clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

from surgery.models import SPECS, ArchitectureSpec

from .mini import MiniConfig, MiniSize, from_size
from .minis import mini_config

__all__ = [
    "ARCHITECTURES",
    "FALLBACK",
    "FALLBACK_MINI_CONFIGS",
    "SIZES",
    "Size",
    "architecture_mini_config",
    "build_model",
    "make_config",
]


@dataclass(frozen=True)
class Size(MiniSize):
    """Shape of a mini model (``MiniSize``) and of the batches it trains on."""

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
        max_position_embeddings=64,  # 2 * max_doc_len * docs_per_step
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
        max_position_embeddings=8192,  # 2 * max_doc_len * docs_per_step
        sliding_window=256,
        docs_per_step=8,
        min_doc_len=32,
        max_doc_len=512,
    ),
}


# Causal LMs outside the registry that the suite proves through ``patch(fallback="loss")`` (the
# fused loss alone; their attention, norms and MLPs stay transformers'). The spec only names the
# class: nothing else of it is used.
FALLBACK_SPECS: tuple[ArchitectureSpec, ...] = (
    ArchitectureSpec(
        model_type="phi3",
        module="transformers.models.phi3.modeling_phi3",
        causal_lm="Phi3ForCausalLM",
        attention="",
    ),
)
# Their mini configs, by model_type, where transformers' config class alone is not one (the
# registry's are in ``minis``).
FALLBACK_MINI_CONFIGS: dict[str, MiniConfig] = {
    "phi3": MiniConfig(
        "Phi3Config",
        {"original_max_position_embeddings": from_size("max_position_embeddings")},
    ),
}

# Every architecture the suite trains, by its short name (``--model``): gemma3 for gemma3_text.
ARCHITECTURES: dict[str, ArchitectureSpec] = {spec.name: spec for spec in SPECS + FALLBACK_SPECS}
FALLBACK = frozenset(spec.name for spec in FALLBACK_SPECS)


def architecture_mini_config(name: str) -> MiniConfig:
    """The mini config of ``ARCHITECTURES[name]``: a fallback model's in
    ``FALLBACK_MINI_CONFIGS``, else the registry's (``minis.mini_config``)."""
    spec = ARCHITECTURES[name]
    if spec.model_type in FALLBACK_MINI_CONFIGS:
        return FALLBACK_MINI_CONFIGS[spec.model_type]
    return mini_config(spec)


def make_config(
    name: str, size: str | Size = "tiny", overrides: dict[str, Any] | None = None
) -> transformers.PretrainedConfig:
    """The config of ``name``'s mini model at ``size`` ("tiny" or "full"), with ``overrides``
    (config attributes) set last."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(ARCHITECTURES)}")
    s = SIZES[size] if isinstance(size, str) else size
    mini = architecture_mini_config(name)
    # use_cache keeps the config's default (on, as in real checkpoints): with a cache the HF mask
    # builder lets packed documents attend to each other, so the patched forward's own guard
    # against that is what the packed sides test.
    config = mini.build(
        s,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = mini.attention("sdpa")
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def build_model(
    name: str,
    size: str | Size = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    overrides: dict[str, Any] | None = None,
) -> transformers.PreTrainedModel:
    """A freshly initialised mini model; the same ``seed`` gives the same weights on any device.
    ``overrides``: config attributes, as for ``make_config``."""
    config = make_config(name, size, overrides)
    model_class = ARCHITECTURES[name].causal_lm_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)  # initialised in fp32 on the CPU: identical everywhere
    condition_attention(model)
    return model.to(device=device, dtype=dtype)


def condition_attention(model: torch.nn.Module) -> None:
    """Attention logits of unit scale at initialisation, in the models that do not scale them
    (Gemma 4 and Gemma 3n: ``scaling = 1.0`` on RMS-normed q and k, whose norms' weights start
    at 1): their q and k norms' weights start at head_dim**-0.25 instead, so q·k has standard
    deviation 1 rather than sqrt(head_dim). The mathematics is the model's own; only the
    starting weights of two norms move.

    At transformers' initialisation the softmax is nearly one-hot (logits of standard deviation
    11 at head_dim 128) and amplifies rounding in q and k layer after layer: the full-size mini
    Gemma 4's fp32 gradients were 2.3e-4 from fp64 (Gemma 3n's 4e-5, the other models' about
    1e-6), the unpatched model's and the patched one's alike, so same-weights checks at fp32's
    limits compared two equally noisy runs. Conditioned: 1.2e-6 and 7.6e-7 (CPU, full width)."""
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "scaling", None) != 1.0 or not hasattr(module, "q_norm"):
                continue
            scale = module.head_dim**-0.25
            for norm in (module.q_norm, getattr(module, "k_norm", None)):  # shared-KV: no k_norm
                if norm is not None and getattr(norm, "weight", None) is not None:
                    norm.weight.mul_(scale)
