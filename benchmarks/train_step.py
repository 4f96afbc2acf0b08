"""End-to-end training step: unpatched transformers vs ``surgery.patch`` vs Liger's patch, on
models built from configs with random weights (no downloads), bf16, AdamW.

    python benchmarks/train_step.py --out benchmarks/results                 # all models
    python benchmarks/train_step.py --models llama --out DIR                 # split across calls
    python benchmarks/train_step.py --models gemma2,qwen2 --out DIR
    python benchmarks/train_step.py --models llama --profile-only --out DIR  # profiler tables
    python benchmarks/train_step.py --smoke                                  # CPU, tiny, plumbing
    python benchmarks/train_step.py --models llama --compile both --out DIR  # eager and compiled
    python benchmarks/train_step.py --models llama --contenders surgery_compiled \
        --profile-only --profile-scenario packed --out DIR                   # profile, compiled
    python benchmarks/train_step.py --models qwen2_5_vl,gemma3 \
        --contenders unpatched,surgery,liger --scenarios padded2,packed2 \
        --quick --skip-max-seq --out DIR                                     # multimodal, GPU

Each (model, contender) runs in a fresh subprocess (``--worker``), with the same seed and so the
same initial weights and batches, so that memory starts clean and process-wide patches (Liger
rebinds names inside transformers modules) cannot leak into the next contender.

One step is: forward with labels, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``; AdamW (fused on CUDA), lr 1e-5.

Compiled contenders (``<contender>_compiled``, or ``--compile on|both``) are the same contender
followed by ``model.compile()`` (inductor, default options, as a user compiles the model); the
optimizer step stays eager. Compilation happens in the warm-up
steps (a new input structure or shape compiles again: the first step of each scenario is a
warm-up step); each scenario records the graphs compiled during its warm-up and during its timed
steps (which should be none), and the graph breaks seen. Compiled rows compare with
``unpatched_compiled`` (``x base``) and with the same contender uncompiled (``x eager``).

Scenarios, in this order (the ones most likely to run out of memory last):
- padded 2x4096: right padding (rows hold 100%, 87.5%, 75%, 62.5%, ... of the row), attention
  mask, labels -100 on padding;
- packed 2x4096: each row is several documents of 512-2048 tokens, ``position_ids`` restarting at
  every document, no attention mask, the first token of each document not predicted;
- padded 4x4096 and 8x4096: the same as padded 2x4096 with more rows;
- on request (``--scenarios``), the other input structures a user feeds (issue 33), text models
  only: ``plain`` (``input_ids`` and ``labels`` alone, every token labelled), ``ones`` (the same
  with an attention mask of ones), ``prompts`` (plain, the first quarter of each row's labels
  -100, as masked prompts), ``leftpadded`` (the padded rows' padding at the left),
  ``packedcu`` (packed, with the ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k`` keyword
  arguments a padding-free collator adds: ``DataCollatorWithFlattening``, TRL's);
- longest sequence at batch 1 (one document, no padding): 4096, 8192, ... 65536 until one does not
  fit; one step each.

The multimodal models (``qwen2_5_vl``, ``gemma3``: the ``...ForConditionalGeneration`` wrapper,
vision tower and projector included, patched as a whole) train on image chats
(``vlm_inputs``): every document is a conversation whose first user turn holds its images, laid
out as the processor lays them out (Qwen2.5-VL: 256 to 361 tokens per image from its patch
grid, ``image_grid_thw``, ``mm_token_type_ids``; Gemma 3: 256 tokens per 896 x 896 image,
``token_type_ids``), with the prompts and images labelled -100. Padded rows hold one conversation
with three images each; packed rows hold two to four conversations of one image each, with
Qwen's (4, batch, seq) position ids (the text row restarting per conversation, then each
conversation's own 3-D rotary positions; Gemma 3's rows take 2-D ones, its images attending
each other both ways through ``token_type_ids``, which the patched model masks per conversation).
The longest-sequence search uses one conversation with three images.

Figures: tokens/s = batch x seq (padding included; for the multimodal models the row's tokens,
image placeholders included, not the vision tower's patches) / median step time of the timed
steps after warm-up (the first scenario of a process takes ``FIRST_SCENARIO_WARMUP`` more warm-up
steps); peak GiB = ``torch.cuda.max_memory_allocated()`` over the scenario's steps (absolute:
weights, gradients, AdamW state and activations), after ``reset_peak_memory_stats()``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    GIB,
    RESULTS_DIR,
    environment,
    fmt,
    import_surgery,
    short_error,
    table,
    write_json,
)

# Shapes from the public configs (Llama-3.2-1B, Gemma-2-2B, Qwen2.5-1.5B); all tie the embeddings.
# Gemma-2 keeps 8 of its 26 layers, as BENCHMARKS.md's figures did, so that the unpatched run fits.
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "attn": "sdpa",
        "config": {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
    },
    "gemma2": {
        "model_type": "gemma2",
        "attn": "eager",
        "config": {
            "hidden_size": 2304,
            "num_hidden_layers": 8,
            "intermediate_size": 9216,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 256000,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
    },
    "qwen2": {
        "model_type": "qwen2",
        "attn": "sdpa",
        "config": {
            "hidden_size": 1536,
            "num_hidden_layers": 28,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
    },
    # A Qwen3-30B-A3B-shaped mixture of experts, 8 of its 48 layers: 64 experts, 8 per token,
    # expert width 768; the router's aux loss trained (as fine-tuning recipes keep it).
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "attn": "sdpa",
        "config": {
            "hidden_size": 2048,
            "num_hidden_layers": 8,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.001,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
    },
    # A Qwen3.5-shaped hybrid: three Gated DeltaNet layers to one gated full-attention layer (the
    # config's default pattern), 16 layers at hidden 2048, Qwen3.5's vocabulary.
    "qwen3_5": {
        "model_type": "qwen3_5_text",
        "attn": "sdpa",
        "config": {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 248320,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
    },
    # A Qwen3.5-MoE-shaped hybrid: the same layer pattern and attention, the MLP a mixture of
    # 64 experts (8 routed per token, 512 wide) with a shared expert, as Qwen3.5-35B-A3B lays it
    # out, at 12 layers of hidden 2048.
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe_text",
        "attn": "sdpa",
        "config": {
            "hidden_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "vocab_size": 248320,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
    },
    # Multimodal wrappers (``vlm_inputs`` builds their image-chat batches). The layer counts keep
    # the unpatched step at 2 x 4096 near 55 GiB by estimate: 6-8 bytes a parameter (bf16
    # weights, AdamW state in the weights' dtype, gradients), the layers' activations, the vision
    # tower's over some 7k (Qwen) / 25k (Gemma) patches, and the head's bf16 logits with their
    # fp32 copies (about 12.7 GiB at Qwen's vocabulary, 22 GiB at Gemma's).
    # Qwen2.5-VL-3B's text width with 16 of its 36 layers (1.90B parameters with the tower), its
    # vision tower with 16 of its 32 blocks (full attention in blocks 7 and 15, windows
    # elsewhere, as in the real tower's every eighth block).
    "qwen2_5_vl": {
        "model_type": "qwen2_5_vl",
        "attn": "sdpa",
        "multimodal": True,
        "config": {
            "text_config": {
                "hidden_size": 2048,
                "num_hidden_layers": 16,
                "intermediate_size": 11008,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [16, 24, 24],
                },
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 128000,
                "tie_word_embeddings": True,
            },
            "vision_config": {
                "depth": 16,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15],
                "out_hidden_size": 2048,
                "hidden_act": "silu",
                "tokens_per_second": 2,
            },
            "image_token_id": 151655,
            "video_token_id": 151656,
            "vision_start_token_id": 151652,
            "vision_end_token_id": 151653,
            "tie_word_embeddings": True,
        },
        "smoke_config": {
            "text_config": {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [2, 3, 3],  # adds up to the smoke head's 8 frequencies
                },
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            "vision_config": {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "patch_size": 4,
                "window_size": 16,  # windows of 2 x 2 merged patches
                "fullatt_block_indexes": [1],
                "out_hidden_size": 64,
            },
            "image_token_id": 999,
            "video_token_id": 998,
            "vision_start_token_id": 997,
            "vision_end_token_id": 996,
        },
    },
    # Gemma 3 4B's text width with 6 of its 34 layers (one period of its 5 local : 1 global
    # pattern; 1.37B parameters with the tower), its SigLIP tower (896 x 896 images, 14 x 14
    # patches pooled to 256 tokens) with 8 of its 27 layers.
    "gemma3": {
        "model_type": "gemma3",
        "attn": "sdpa",
        "multimodal": True,
        "config": {
            "text_config": {
                "hidden_size": 2560,
                "num_hidden_layers": 6,
                "intermediate_size": 10240,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "query_pre_attn_scalar": 256,
                "vocab_size": 262208,
                "sliding_window": 1024,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
            },
            "vision_config": {
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_hidden_layers": 8,
                "num_attention_heads": 16,
                "patch_size": 14,
                "image_size": 896,
                "vision_use_head": False,
                "hidden_act": "gelu_pytorch_tanh",
                "layer_norm_eps": 1e-6,
            },
            "mm_tokens_per_image": 256,
            "image_token_index": 262144,
            "boi_token_index": 255999,
            "eoi_token_index": 256000,
            "tie_word_embeddings": True,
        },
        "smoke_config": {
            "text_config": {
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "patch_size": 4,
                "image_size": 16,
            },
            "mm_tokens_per_image": 4,  # 4 x 4 patches pooled 2 x 2
            "image_token_index": 999,
            "boi_token_index": 998,
            "eoi_token_index": 997,
        },
    },
}
SMOKE_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}
SMOKE_GEMMA2 = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64}

CONTENDERS = ["unpatched", "surgery", "liger"]
# liger_rope_flce: Liger with only RoPE and the fused loss, the same kernels surgery swaps.
# surgery_masked: surgery with causal_right_padding=False (padded batches keep their mask).
# surgery_every_token: surgery with loss_skip_ignored=False (the loss's products over every token,
# no host read; before it was the default, this run was "surgery" against "surgery_skip_ignored").
# surgery_inductor_norm / _inductor_mlp: surgery leaving the RMSNorm / the gated MLP to
# transformers (and so to Inductor when compiled); surgery_no_recompute: no recompute of the MLP
# product and the norm output (compile studies, issue 18); surgery_eager_attention: Gemma 2's
# softcapped attention through the eager function (flex_attention=False).
# unpatched_grouped_mm: transformers with grouped_mm experts asked for (MoE models).
SURGERY_CONTENDERS = {
    "surgery": {},
    "surgery_masked": {"causal_right_padding": False},
    "surgery_every_token": {"loss_skip_ignored": False},
    "surgery_inductor_norm": {"rms_norm": False},
    "surgery_inductor_mlp": {"gated_mlp": False},
    "surgery_no_recompute": {"recompute_mlp_product": False, "recompute_norm_output": False},
    "surgery_eager_attention": {"flex_attention": False},
}
EXTRA_CONTENDERS = [
    "liger_rope_flce",
    *(name for name in SURGERY_CONTENDERS if name != "surgery"),
    "unpatched_grouped_mm",
]
# Any contender followed by model.compile().
COMPILED = "_compiled"
# Any contender in a process where flash-linear-attention does not import (hybrid models): with
# fla installed, transformers' Gated DeltaNet layers pick its kernels by themselves and surgery
# runs them through it (surgery.integrations.fla); without, both run the PyTorch path.
NO_FLA = "_no_fla"


def split_contender(name: str) -> tuple[str, bool]:
    """(the contender's patch, whether the model is compiled after it); ``NO_FLA`` taken off."""
    name = name.replace(NO_FLA, "")
    if name.endswith(COMPILED):
        return name[: -len(COMPILED)], True
    return name, False


def hide_fla() -> None:
    """Make ``import fla`` fail in this process, before transformers' modeling modules import."""
    sys.modules["fla"] = None  # type: ignore[assignment]


def known_contender(name: str) -> bool:
    return split_contender(name)[0] in CONTENDERS + EXTRA_CONTENDERS


def with_compile(contenders: list[str], mode: str) -> list[str]:
    """``--compile``: off keeps the list, on compiles every contender, both runs each contender
    eager and then compiled."""
    if mode == "off":
        return contenders
    out = []
    for c in contenders:
        base, compiled = split_contender(c)
        if mode == "both" and not compiled:
            out.append(base)
        out.append(base + COMPILED)
    return list(dict.fromkeys(out))


def baseline_of(contender: str) -> str:
    """The unpatched contender of the same mode (eager or compiled)."""
    return "unpatched" + (COMPILED if split_contender(contender)[1] else "")


SEQ = 4096
SCENARIOS = [("padded", 2), ("packed", 2), ("padded", 4), ("padded", 8)]
# Extra warm-up steps of a process's first scenario. With one, that scenario's timed steps ran up
# to 10% slow: H200, --quick, Qwen3-MoE compiled, the no-mask batch 124 / 118 ms first and 112 ms
# second; Llama 61.7k tok/s first and 64.1k second (results/train_step-structures-4bfae6c_log.txt).
FIRST_SCENARIO_WARMUP = 3
MAX_SEQS = [4096, 8192, 16384, 32768, 65536]
SMOKE_SEQ = 32
SMOKE_SCENARIOS = [("padded", 2), ("packed", 2)]
SMOKE_MAX_SEQS = [32, 64]
# The multimodal smoke rows hold three tiny images (4 to 8 tokens each) and some text.
SMOKE_VLM_SEQ = 64
SMOKE_VLM_MAX_SEQS = [64, 128]


def scenarios_to_run(asked: list[tuple[str, int]] | None, quick: bool) -> list[tuple[str, int]]:
    """The scenarios asked for, as asked (``--quick`` or not); else the default ones, without
    batch 4 under ``--quick``."""
    if asked is not None:
        return asked
    return [s for s in SCENARIOS if not (quick and s[1] == 4)]


KINDS = ("padded", "packed", "plain", "ones", "prompts", "leftpadded", "packedcu")
"""The input structures ``make_batch`` makes (the module docstring says what each holds); the
multimodal models take padded and packed only."""


def parse_scenarios(text: str) -> list[tuple[str, int]]:
    """``"padded2,packed1"`` -> ``[("padded", 2), ("packed", 1)]``: any batch of any ``KINDS``."""
    out = []
    for item in text.split(","):
        match = re.fullmatch(rf"({'|'.join(KINDS)})([1-9][0-9]*)", item.strip())
        if match is None:
            raise argparse.ArgumentTypeError(
                f"scenario {item!r} is not <kind><batch> with a kind of {KINDS}"
            )
        out.append((match.group(1), int(match.group(2))))
    return out


def positive_int(text: str) -> int:
    """A command-line count of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


class Unavailable(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# worker: one model, one contender, in its own process


def _emit(kind: str, payload: Any) -> None:
    print(f"@@{kind} {json.dumps(payload, default=str)}", flush=True)


def is_multimodal(name: str) -> bool:
    return bool(MODELS[name].get("multimodal"))


def model_config_kwargs(name: str, smoke: bool) -> dict[str, Any]:
    """The config arguments of ``name``; with ``smoke``, its tiny version (a multimodal model's
    text config shrunk as the text models are, then its own ``smoke_config`` on top, one level
    into the text and vision configs)."""
    spec = MODELS[name]
    kwargs = copy.deepcopy(spec["config"])
    if not smoke:
        return kwargs
    if not is_multimodal(name):
        kwargs.update(SMOKE_CONFIG)
        if name == "gemma2":
            kwargs.update(SMOKE_GEMMA2)
        return kwargs
    kwargs["text_config"].update(SMOKE_CONFIG)
    for key, value in copy.deepcopy(spec.get("smoke_config", {})).items():
        if isinstance(value, dict):
            kwargs[key].update(value)
        else:
            kwargs[key] = value
    return kwargs


def build_model(name: str, smoke: bool, device, dtype=None, layers: int | None = None):
    """``name``'s model with random weights from its config, in ``dtype`` (bf16 by default), in
    training mode; ``layers``: that many of its (text) layers instead."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = dtype or torch.bfloat16
    spec = MODELS[name]
    cfg_kwargs = model_config_kwargs(name, smoke)
    if layers is not None:
        cfg_kwargs.get("text_config", cfg_kwargs)["num_hidden_layers"] = layers
    cfg_kwargs["use_cache"] = False
    if "text_config" in cfg_kwargs:  # the language model reads its own config's use_cache
        cfg_kwargs["text_config"]["use_cache"] = False
    config = AutoConfig.for_model(spec["model_type"], **cfg_kwargs)
    auto = AutoModelForImageTextToText if is_multimodal(name) else AutoModelForCausalLM
    with device:
        try:
            model = auto.from_config(config, dtype=dtype, attn_implementation=spec["attn"])
        except TypeError:  # transformers before `dtype` replaced `torch_dtype`
            model = auto.from_config(config, torch_dtype=dtype, attn_implementation=spec["attn"])
    # No model.to(dtype): it would also cast the fp32 RoPE inv_freq buffer, which from_config /
    # from_pretrained with dtype=bf16 keep in fp32.
    model.train()
    return model


def fla_version() -> str | None:
    """The flash-linear-attention this process can import (None: none)."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return None
    from surgery.integrations.fla import _version

    return _version()


def apply_contender(model, contender: str) -> dict[str, Any]:
    """Patch ``model`` in place for ``contender``; returns which kernels are on."""
    if contender == "unpatched":
        return {}
    if contender == "unpatched_grouped_mm":
        # transformers with its grouped_mm experts asked for explicitly (its default where the
        # GPU and torch can dispatch it, else the eager loop).
        if not hasattr(model, "set_experts_implementation"):
            raise Unavailable("this transformers has no experts implementations")
        model.set_experts_implementation("grouped_mm")
        return {"experts_implementation": "grouped_mm"}
    if contender in SURGERY_CONTENDERS:
        surgery = import_surgery()
        if not hasattr(surgery, "patch"):
            raise Unavailable("surgery.patch does not exist yet")
        surgery.patch(model, **SURGERY_CONTENDERS[contender])
        opts = surgery.patch_options(model) if hasattr(surgery, "patch_options") else None
        if is_dataclass(opts):
            return {k: v for k, v in asdict(opts).items() if not callable(v)}
        return {"patched": True, "options": repr(opts)}
    if contender in ("liger", "liger_rope_flce"):
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except ImportError as e:
            raise Unavailable(f"liger-kernel not importable: {short_error(e)}") from e
        model_type = model.config.model_type
        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise Unavailable(f"Liger has no patch for {model_type}")
        # Liger's own defaults otherwise: its RoPE is off by default where Liger does not support
        # it (Qwen3.5's hybrid attention raises NotImplementedError when asked for).
        kwargs: dict[str, Any] = {"fused_linear_cross_entropy": True}
        if contender == "liger_rope_flce":
            kwargs.update(rope=True, rms_norm=False, swiglu=False, geglu=False)
        params = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
        on = {k: kwargs.get(k, p.default) for k, p in params.items() if isinstance(p.default, bool)}
        try:
            _apply_liger_kernel_to_instance(model=model, **kwargs)
        except ImportError as e:  # its patch imports classes this transformers no longer has
            raise Unavailable(f"Liger's {model_type} patch: {short_error(e)}") from e
        return on
    raise ValueError(f"unknown contender {contender!r}")


def make_batch(kind: str, batch: int, seq: int, vocab: int, device, seed: int):
    """Token ids and labels for one scenario; deterministic in ``seed`` (the same for every
    contender). Ids are uniform over the vocabulary, which only matters for the loss value."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    out: dict[str, Any] = {}
    if kind in ("padded", "leftpadded"):
        mask = torch.zeros(batch, seq, dtype=torch.long)
        for r in range(batch):
            length = seq - (r % 4) * seq // 8
            if kind == "padded":
                mask[r, :length] = 1
            else:
                mask[r, seq - length :] = 1
        ids = ids.masked_fill(mask == 0, 0)
        labels = labels.masked_fill(mask == 0, -100)
        out["attention_mask"] = mask
    elif kind == "ones":
        out["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    elif kind == "prompts":
        labels[:, : seq // 4] = -100
    elif kind in ("packed", "packedcu"):
        pos = torch.empty(batch, seq, dtype=torch.long)
        lo, hi = max(1, seq // 8), max(2, seq // 2)
        for r in range(batch):
            t = 0
            while t < seq:
                n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), seq - t)
                pos[r, t : t + n] = torch.arange(n)
                labels[r, t] = -100  # never predict a document's first token from the one before
                t += n
        out["position_ids"] = pos
        if kind == "packedcu":  # as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
            starts = torch.nonzero(pos.flatten() == 0).flatten()
            cu = torch.cat([starts, starts.new_tensor([batch * seq])]).to(torch.int32)
            longest = int(cu.diff().max())
            out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                       max_length_k=longest)  # fmt: skip
    elif kind not in ("single", "plain"):
        raise ValueError(kind)
    out["input_ids"] = ids
    out["labels"] = labels
    padded = kind in ("padded", "leftpadded")
    real_tokens = int(out["attention_mask"].sum()) if padded else batch * seq
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in out.items()}, real_tokens


def make_inputs(name: str, model, kind: str, batch: int, seq: int, device, seed: int, smoke: bool):
    """One scenario's inputs for model ``name``: (the model's keyword arguments on ``device``,
    the tokens that are not padding, a record of what a multimodal batch holds (empty for text)).
    Text models: ``make_batch``; multimodal ones: ``vlm_inputs.make_vlm_batch``."""
    if not is_multimodal(name):
        data, real = make_batch(kind, batch, seq, model.config.vocab_size, device, seed)
        return data, real, {}
    import vlm_inputs

    if kind not in ("padded", "packed", "single"):
        raise ValueError(f"the multimodal models take padded and packed batches, not {kind}")
    data, real, info = vlm_inputs.make_vlm_batch(model, kind, batch, seq, seed, smoke=smoke)
    return {k: v.to(device) for k, v in data.items()}, real, info


def worker(job: dict[str, Any]) -> None:
    smoke = job["smoke"]
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    result: dict[str, Any] = {"model": job["model"], "contender": job["contender"]}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def clean():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def compile_stats() -> tuple[int, int]:
        """(graphs compiled, graph breaks) so far in this process (0, 0 when nothing compiles)."""
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    if NO_FLA in job["contender"]:
        hide_fla()
    result["fla"] = fla_version()
    try:
        torch.manual_seed(job["seed"])
        t0 = time.perf_counter()
        model = build_model(job["model"], smoke, device)
        result["params"] = sum(p.numel() for p in model.parameters())
        result["build_s"] = round(time.perf_counter() - t0, 1)
        base, compiled = split_contender(job["contender"])
        result["kernels_on"] = apply_contender(model, base)
        if compiled:
            model.compile(backend=job.get("compile_backend", "inductor"))
            result["compiled"] = {"backend": job.get("compile_backend", "inductor")}
    except Unavailable as e:
        _emit("RESULT", {**result, "status": "unavailable", "error": str(e)})
        return
    except Exception as e:
        _emit("RESULT", {**result, "status": "error", "error": short_error(e)})
        raise
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

    def step(batch) -> float:
        out = model(**batch)
        loss = out.loss
        del out  # the unpatched output holds the logits; do not keep them into the next step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    multimodal = is_multimodal(job["model"])
    seq = (SMOKE_VLM_SEQ if multimodal else SMOKE_SEQ) if smoke else SEQ
    warmup, timed = job["warmup"], job["steps"]
    first = True

    def inputs(kind: str, batch: int, seq: int, seed: int):
        return make_inputs(job["model"], model, kind, batch, seq, device, seed, smoke)

    if job.get("profile"):
        profile_step(model, step, inputs, seq, job)
        _emit("RESULT", {**result, "status": "ok"})
        return

    scenarios = []
    for kind, batch in SMOKE_SCENARIOS if smoke else job["scenarios"]:
        name = f"{kind} {batch}x{seq}"
        rec: dict[str, Any] = {"scenario": name, "kind": kind, "batch": batch, "seq": seq}
        try:
            data, real, held = inputs(kind, batch, seq, job["seed"] + batch)
            rec.update(held)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            losses = []
            graphs0, breaks0 = compile_stats()
            t_warm = time.perf_counter()
            for _ in range(warmup + (FIRST_SCENARIO_WARMUP if first else 0)):
                losses.append(step(data))
            sync()
            warm_s = time.perf_counter() - t_warm
            first = False
            graphs1, breaks1 = compile_stats()
            times = []
            for _ in range(timed):
                sync()
                t = time.perf_counter()
                losses.append(step(data))
                sync()
                times.append(time.perf_counter() - t)
            med = sorted(times)[len(times) // 2]
            graphs2, breaks2 = compile_stats()
            if graphs2:  # something compiles in this process
                rec["compile"] = {
                    "warmup_s": round(warm_s, 1),
                    "graphs_in_warmup": graphs1 - graphs0,
                    "graphs_in_timed_steps": graphs2 - graphs1,
                    "graph_breaks_in_warmup": breaks1 - breaks0,
                    "graphs_so_far": graphs2,
                    "graph_breaks_so_far": breaks2,
                }
            rec.update(
                status="ok",
                step_ms=med * 1e3,
                step_ms_all=[round(s * 1e3, 2) for s in times],
                tokens_per_s=batch * seq / med,
                real_tokens_per_s=real / med,
                loss_first=losses[0],
                loss_last=losses[-1],
            )
            if cuda:
                rec["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            del data
        except torch.OutOfMemoryError as e:
            rec.update(status="oom", error=short_error(e, 160))
        except Exception as e:
            rec.update(status="error", error=short_error(e))
        opt.zero_grad(set_to_none=True)
        clean()
        scenarios.append(rec)
        _emit("SCENARIO", rec)
    result["scenarios"] = scenarios

    fits, first_oom = [], None
    max_seqs = (SMOKE_VLM_MAX_SEQS if multimodal else SMOKE_MAX_SEQS) if smoke else MAX_SEQS
    for L in [] if job.get("skip_max_seq") else max_seqs:
        rec = {"seq": L}
        try:
            data, _, _ = inputs("single", 1, L, job["seed"] + L)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            rec["loss"] = step(data)
            sync()
            rec["step_s"] = time.perf_counter() - t  # one step; includes any first-shape JIT
            if cuda:
                rec["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            rec["status"] = "ok"
            fits.append(rec)
            del data
        except torch.OutOfMemoryError as e:
            rec.update(status="oom", error=short_error(e, 160))
            first_oom = rec
        except Exception as e:
            rec.update(status="error", error=short_error(e))
            first_oom = rec
        opt.zero_grad(set_to_none=True)
        clean()
        _emit("MAXSEQ", rec)
        if first_oom is not None:
            break
    result["max_seq"] = {
        "fits": fits,
        "stopped_at": first_oom,
        "longest": fits[-1]["seq"] if fits else None,
    }
    if compiled:
        from torch._dynamo.utils import counters

        result["compiled"]["graph_break_reasons"] = {
            reason.splitlines()[0][:200]: n for reason, n in counters["graph_break"].items()
        }
    result["status"] = "ok"
    _emit("RESULT", result)


# Kernel classes of a profiled step, by name: the first class whose words a kernel's name holds
# (attention first: cuDNN's and flash-attention's kernels carry "sm90_" or "cutlass" too; cuDNN's
# attention backward has two helpers, the rows' dO . O and dQ's conversion to 16 bits).
KERNEL_CLASSES = (
    ("collectives (NCCL)", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "dot_do_o", "convert_dq")),
    (
        "matrix products",
        ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "triton_tem_"),
    ),
    ("optimizer", ("multi_tensor", "adam")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill", "cat_", "catarray")),
    ("PyTorch elementwise and reductions", ("at::native", "elementwise", "reduce_kernel")),
)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(intervals: list[tuple[float, float]], union: list[tuple[float, float]]) -> float:
    """The time of ``intervals`` (each counted whole) that falls inside the disjoint ``union``."""
    import bisect

    starts = [s for s, _ in union]
    total = 0.0
    for start, end in intervals:
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(union) and union[i][0] < end:
            total += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
            i += 1
    return total


def kernel_time_by_class(prof) -> str:
    """A table of the profiled kernels' GPU time by ``KERNEL_CLASSES`` (the rest: Triton kernels,
    ours, Liger's or inductor's, and anything unnamed there, listed by name), against the span
    from the first kernel's start to the last one's end: what is not a matrix product, how long
    the GPU sat idle between kernels, and how much of the products ran while a collective did
    (which shares the GPU's SMs with them: FSDP's and tensor parallelism's overlap). Ranges that
    code marks on the GPU's timeline (``record_function``, FSDP's ``FSDP::all_gather``) are not
    kernels and do not count."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    by_class, rest, of_class = defaultdict(float), defaultdict(float), defaultdict(list)
    for ev in prof.events():
        if ev.device_type != DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
            continue
        start, end = ev.time_range.start, ev.time_range.end
        name = ev.name.lower()
        cls = next((c for c, words in KERNEL_CLASSES if any(w in name for w in words)), None)
        if cls is None:
            rest[ev.name[:70]] += end - start
            cls = "other (Triton kernels and the rest)"
        by_class[cls] += end - start
        of_class[cls].append((start, end))
    if not of_class:
        return "no GPU kernels recorded\n"
    union = _union([interval for intervals in of_class.values() for interval in intervals])
    busy = sum(end - start for start, end in union)
    span = union[-1][1] - union[0][0]  # disjoint and sorted: the last one ends last
    idle = span - busy
    lines = [
        f"GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms,"
        f" idle {idle / 1e3:.2f} ms ({100 * idle / span:.1f}%)",
        f"{'class':<40} {'ms':>9} {'% span':>7}",
    ]
    for cls, us in sorted(by_class.items(), key=lambda kv: -kv[1]):
        lines.append(f"{cls:<40} {us / 1e3:9.2f} {100 * us / span:7.1f}")
    products, collectives = "matrix products", "collectives (NCCL)"
    if by_class[products] and by_class[collectives]:
        beside = _overlap(of_class[products], _union(of_class[collectives]))
        lines.append(
            f"\nmatrix products while a collective ran: {beside / 1e3:.2f} ms of"
            f" {by_class[products] / 1e3:.2f} ({100 * beside / by_class[products]:.1f}%)"
        )
    lines.append("\nthe rest, by kernel name:")
    for name, us in sorted(rest.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"  {name:<70} {us / 1e3:8.2f} ms")
    return "\n".join(lines) + "\n"


# Matrix-product ops of a profiled step and where their two operands sit among the inputs (a
# compiled step's products that inductor wrote as Triton templates are in the class table only).
PRODUCT_OPS = {
    "aten::mm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::addmm_": (1, 2),
    "aten::_addmm_activation": (1, 2),
    "aten::bmm": (0, 1),
    "aten::baddbmm": (1, 2),
    "aten::_grouped_mm": (0, 1),  # (tokens, K) x (experts, K, N): each token meets one expert
    "aten::_scaled_mm": (0, 1),
}


def products_by_shape(prof, rows: int = 25) -> str:
    """A table of the step's matrix products by op and operand shapes: calls, GPU time and the
    rate they ran at (2 M N K flops per product, B times that for a batched one). A call that
    launched no kernel is counted apart ("no kernel") and not rated: a checkpointed layer's
    recomputation stops inside the product that saves the layer's last tensors (autograd saves
    a product's inputs before running it), and counted, such calls made a rate above the GPU's
    peak."""
    groups: dict[tuple, list] = {}
    for ev in prof.events():
        where = PRODUCT_OPS.get(ev.name)
        shapes = getattr(ev, "input_shapes", None) or []
        if where is None or len(shapes) <= max(where):
            continue
        parent = getattr(ev, "cpu_parent", None)
        if parent is not None and parent.name in PRODUCT_OPS:
            continue  # inside a product counted whole (a grouped GEMM's per-group fallback)
        a, b = shapes[where[0]], shapes[where[1]]
        if len(a) < 2 or len(b) < 2:
            continue
        group = groups.setdefault((ev.name, tuple(a), tuple(b)), [0.0, 0, 0])
        if ev.device_time_total:
            group[0] += ev.device_time_total
            group[1] += 1
        else:
            group[2] += 1
    found = []
    for (key, a, b), (us, count, none) in groups.items():
        if count:
            batch = a[0] if len(a) == 3 else 1
            flops = 2 * batch * a[-2] * a[-1] * b[-1] * count
            found.append((us, key, a, b, count, none, flops))
    found.sort(key=lambda r: -r[0])
    total_us = sum(r[0] for r in found)
    total_flops = sum(r[6] for r in found)
    skipped = sum(none for _, _, none in groups.values())
    lines = [
        f"{len(found)} shapes, {total_us / 1e3:.2f} ms, {total_flops / 1e12:.2f} TFLOP"
        f" at {total_flops / max(total_us, 1e-9) / 1e6:.0f} TFLOP/s;"
        f" {skipped} calls launched no kernel",
        f"{'op':<12} {'operands':<34} {'calls':>5} {'ms':>8} {'TFLOP/s':>8} {'no kernel':>9}",
    ]
    for us, key, a, b, count, none, flops in found[:rows]:
        operands = f"{list(a)} x {list(b)}"
        lines.append(
            f"{key[6:]:<12} {operands:<34} {count:5d} {us / 1e3:8.2f} {flops / us / 1e6:8.0f}"
            f" {none:9d}"
        )
    return "\n".join(lines) + "\n"


def profile_step(model, step, inputs, seq, job) -> None:
    """torch.profiler tables of one training step (``profile_batch`` x seq, 2 unless set;
    ``profile_scenario``: padded or packed) after warm-up (which compiles a compiled contender);
    ``inputs(kind, batch, seq, seed)`` makes the batch; ``step_kind``: what the step runs besides
    forward and backward, for the header (AdamW unless set)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    kind = job.get("profile_scenario", "padded")
    batch = job.get("profile_batch", 2)
    data, _, _ = inputs(kind, batch, seq, job["seed"] + 2)
    device = next(model.parameters()).device
    for _ in range(max(2, job["warmup"])):
        step(data)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        step(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    sections = []
    if device.type == "cuda":
        sections.append("== GPU time by kernel class\n" + kernel_time_by_class(prof))
        sections.append("== matrix products by shape\n" + products_by_shape(prof))
    for title, keys in [
        ("top ops by GPU time", ["device_time_total", "cuda_time_total", "cpu_time_total"]),
        (
            "top ops by memory allocated (self)",
            ["self_device_memory_usage", "self_cuda_memory_usage", "self_cpu_memory_usage"],
        ),
        ("top ops by host time (self): where the GPU may wait", ["self_cpu_time_total"]),
    ]:
        for key in keys:
            try:
                sections.append(f"== {title} (sort_by={key})\n" + events.table(key, row_limit=30))
                break
            except (AttributeError, KeyError, ValueError, RuntimeError):
                continue
    shape = "" if batch == 2 else f"_{batch}x{seq}"  # batch 2: the names earlier results have
    out = Path(job["out"]) / f"profile_{job['model']}_{job['contender']}_{kind}{shape}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"one training step, {job['model']} ({job['contender']}), {kind} {batch}x{seq}, bf16,"
        f" {job.get('step_kind', 'AdamW')}; after {max(2, job['warmup'])} warm-up steps\n\n"
    )
    out.write_text(header + "\n\n".join(sections) + "\n")
    print(f"wrote {out}", flush=True)
    if device.type == "cuda":
        # What is alive at the step's peak of memory, and where it was allocated.
        from memory_peak import peak_table, record_step

        trace, before = record_step(lambda: step(data), device)
        memory = out.with_name(f"memory_{job['model']}_{job['contender']}_{kind}{shape}.txt")
        memory.write_text(header + peak_table(trace, before))
        print(f"wrote {memory}", flush=True)
    if job.get("profile_trace"):
        # The step's timeline (chrome://tracing, Perfetto), gzipped: where the GPU waits.
        import gzip
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            trace = out.with_suffix(".trace.json.gz")
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                dst.write(src.read())
        print(f"wrote {trace}", flush=True)


# --------------------------------------------------------------------------------------------------
# parent: one subprocess per (model, contender)


def run_worker(job: dict[str, Any], timeout_s: float, label: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    result: dict[str, Any] | None = None
    partial: dict[str, Any] = {"scenarios": [], "max_seq_tries": []}
    tail: list[str] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            timed_out = True
            proc.kill()
            break
        if line is None:
            break
        line = line.rstrip("\n")
        if line.startswith("@@RESULT "):
            result = json.loads(line[len("@@RESULT ") :])
        elif line.startswith("@@SCENARIO "):
            rec = json.loads(line[len("@@SCENARIO ") :])
            partial["scenarios"].append(rec)
            print(f"  [{label}] {scenario_line(rec)}", flush=True)
        elif line.startswith("@@MAXSEQ "):
            rec = json.loads(line[len("@@MAXSEQ ") :])
            partial["max_seq_tries"].append(rec)
            print(f"  [{label}] batch 1 x {rec['seq']}: {maxseq_line(rec)}", flush=True)
        else:
            if line.startswith("wrote "):
                print(f"  [{label}] {line}", flush=True)
            tail.append(line)
            del tail[:-40]
    proc.wait(timeout=30)
    if result is None:
        result = {
            "model": job["model"],
            "contender": job["contender"],
            "status": "timeout" if timed_out else "error",
            "error": (f"worker passed {timeout_s:.0f} s" if timed_out else "worker died")
            + f" (exit {proc.returncode})",
            "scenarios": partial["scenarios"],
            "max_seq": {"fits": [r for r in partial["max_seq_tries"] if r.get("status") == "ok"]},
        }
    if result.get("status") != "ok":
        result["log_tail"] = tail[-15:]
    return result


def scenario_line(rec: dict[str, Any]) -> str:
    if rec.get("status") != "ok":
        return f"{rec['scenario']}: {rec.get('status')} {rec.get('error', '')}"
    return (
        f"{rec['scenario']}: {rec['tokens_per_s'] / 1e3:.1f}k tok/s"
        f" (step {rec['step_ms']:.0f} ms), peak {fmt(rec.get('peak_gib'), '.1f')} GiB,"
        f" loss {rec['loss_first']:.3f}"
    )


def maxseq_line(rec: dict[str, Any]) -> str:
    if rec.get("status") != "ok":
        return f"{rec.get('status')} {rec.get('error', '')}"
    return f"fits, peak {fmt(rec.get('peak_gib'), '.1f')} GiB, step {rec['step_s']:.2f} s"


def _ratio(x, y) -> str:
    return fmt(x / y if x and y else None, ".2f")


def render_tables(results: list[dict[str, Any]]) -> str:
    """Per scenario: tokens/s and peak memory, as ratios to the unpatched contender of the same
    mode (``x base``: eager rows to ``unpatched``, compiled rows to ``unpatched_compiled``) and,
    for compiled rows, to the same contender uncompiled (``x eager``); compiled rows also show the
    graphs compiled during the timed steps (should be 0) and the graph breaks."""
    by: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in results:
        for s in r.get("scenarios", []) or []:
            if s.get("status") == "ok":
                by[(r["model"], r["contender"], s["scenario"])] = s
    rows = []
    for r in results:
        if r.get("status") not in ("ok", None) and not r.get("scenarios"):
            rows.append([r["model"], "-", r["contender"]] + ["-"] * 8 + [r.get("error")])
            continue
        base_name, compiled = split_contender(r["contender"])
        for s in r.get("scenarios", []):
            key = (r["model"], s["scenario"])
            b = by.get((*key[:1], baseline_of(r["contender"]), key[1]), {})
            e = by.get((key[0], base_name, key[1]), {}) if compiled else {}
            ok = s.get("status") == "ok"
            tps = s.get("tokens_per_s") if ok else None
            peak = s.get("peak_gib") if ok else None
            c = s.get("compile") or {}
            rows.append(
                [
                    r["model"],
                    s["scenario"],
                    r["contender"],
                    fmt(tps / 1e3 if tps else None, ".1f"),
                    _ratio(tps, b.get("tokens_per_s")),
                    _ratio(tps, e.get("tokens_per_s")) if compiled else "-",
                    fmt(peak, ".1f"),
                    _ratio(peak, b.get("peak_gib")),
                    _ratio(peak, e.get("peak_gib")) if compiled else "-",
                    fmt(s.get("loss_first"), ".4f"),
                    (
                        f"{c.get('graphs_in_timed_steps')} / {c.get('graph_breaks_so_far')}"
                        if compiled and c
                        else "-"
                    ),
                    "ok" if ok else f"{s.get('status')}",
                ]
            )
    t1 = table(
        [
            "model",
            "scenario",
            "contender",
            "k tok/s",
            "x base",
            "x eager",
            "peak GiB",
            "x base",
            "x eager",
            "loss step 1",
            "recompiles / breaks",
            "status",
        ],
        rows,
    )
    rows2 = []
    for r in results:
        ms = r.get("max_seq") or {}
        fits = ms.get("fits") or []
        last = fits[-1] if fits else {}
        stop = ms.get("stopped_at") or {}
        rows2.append(
            [
                r["model"],
                r["contender"],
                fmt(last.get("seq")),
                fmt(last.get("peak_gib"), ".1f"),
                fmt(last.get("step_s"), ".2f"),
                f"{stop.get('seq')}: {stop.get('status')}" if stop else "-",
            ]
        )
    t2 = table(
        ["model", "contender", "longest seq (batch 1)", "its peak GiB", "its step s", "stopped at"],
        rows2,
    )
    return t1 + "\n\n" + t2


def plot(results: list[dict[str, Any]], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {short_error(e)}"
    contenders = list(dict.fromkeys(r["contender"] for r in results))
    groups = list(
        dict.fromkeys(
            (r["model"], s["scenario"]) for r in results for s in r.get("scenarios", []) or []
        )
    )
    if not groups:
        return "no plot: nothing measured"
    models = list(dict.fromkeys(r["model"] for r in results))
    # The longest-sequence panel only where that search ran (not with --skip-max-seq).
    searched = any((r.get("max_seq") or {}).get("longest") for r in results)
    rows = 3 if searched else 2
    fig, axes = plt.subplots(rows, 1, figsize=(max(8, 1.3 * len(groups)), 4 * rows))
    width = 0.8 / max(1, len(contenders))
    for i, c in enumerate(contenders):
        xs, tps, peak = [], [], []
        for g, (m, sc) in enumerate(groups):
            for r in results:
                if r["model"] != m or r["contender"] != c:
                    continue
                for s in r.get("scenarios", []) or []:
                    if s["scenario"] == sc and s.get("status") == "ok":
                        xs.append(g + (i - (len(contenders) - 1) / 2) * width)
                        tps.append(s["tokens_per_s"] / 1e3)
                        peak.append(s.get("peak_gib") or float("nan"))
        axes[0].bar(xs, tps, width, label=c, color=f"C{i}")
        axes[1].bar(xs, peak, width, label=c, color=f"C{i}")
    for ax, ylabel in [(axes[0], "k tokens/s"), (axes[1], "peak GiB (absolute)")]:
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{s}" for m, s in groups], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("Training step: throughput and peak memory (bf16, AdamW)")
    for i, c in enumerate(contenders if searched else []):
        xs, vals = [], []
        for g, m in enumerate(models):
            for r in results:
                if r["model"] == m and r["contender"] == c:
                    longest = (r.get("max_seq") or {}).get("longest")
                    if longest:
                        xs.append(g + (i - (len(contenders) - 1) / 2) * width)
                        vals.append(longest)
        axes[2].bar(xs, vals, width, label=c, color=f"C{i}")
    if searched:
        axes[2].set_yscale("log", base=2)
        axes[2].set_xticks(range(len(models)))
        axes[2].set_xticklabels(models)
        axes[2].set_ylabel("longest seq that fits, batch 1")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def merge(paths: list[Path], out_dir: Path) -> int:
    """One train_step.json, png and table from the files of split runs (e.g. one GPU call per
    model); each part keeps its own environment record under ``parts``."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    merged: dict[str, Any] = {
        "benchmark": "train_step",
        "merged_from": [str(p) for p in paths],
        "parts": [
            {k: d.get(k) for k in ("environment", "settings", "total_seconds")} for d in docs
        ],
        "definitions": docs[0].get("definitions"),
        "models": {k: v for d in docs for k, v in (d.get("models") or {}).items()},
        "results": [r for d in docs for r in d.get("results", [])],
    }
    profiles = [d["profile"] for d in docs if d.get("profile")]
    if profiles:
        merged["profile"] = profiles
    gpus = {(d.get("environment") or {}).get("gpu") for d in docs}
    if len(gpus) > 1:
        print(f"warning: the parts ran on different GPUs {gpus}; ratios across parts mislead")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "train_step.json", merged)
    note = plot(merged["results"], out_dir / "train_step.png")
    if note:
        print(note)
    print(f"wrote {out_dir / 'train_step.json'}\n")
    print(render_tables(merged["results"]))
    return 0


def worker_timeout(args, contender: str) -> float:
    compiled = split_contender(contender)[1]
    return args.compiled_worker_timeout_s if compiled else args.worker_timeout_s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"result folder (default {RESULTS_DIR})")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list from {list(MODELS)}")
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma list from {CONTENDERS + EXTRA_CONTENDERS}, each optionally with the suffix"
        f" {COMPILED} (the contender, then model.compile())",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 warm-up + 2 timed steps; the default scenarios without batch 4",
    )
    p.add_argument(
        "--scenarios",
        type=parse_scenarios,
        default=None,
        help="comma list of the scenarios to run, each padded<batch> or packed<batch>, e.g."
        " padded2,packed2 or padded1,packed1 (default: padded2,packed2,padded4,padded8; with"
        " --quick without padded4)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="warm-up steps per scenario (the first: + FIRST_SCENARIO_WARMUP)",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per scenario")
    p.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="off",
        help="compile the contenders with model.compile(): on (compiled only) or both (each eager,"
        " then compiled); or name <contender>_compiled in --contenders",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--skip-max-seq",
        action="store_true",
        help="skip the longest-sequence search (each new length compiles again when compiled)",
    )
    p.add_argument("--profile", action="store_true", help="also write profiler tables")
    p.add_argument("--profile-only", action="store_true", help="only the profiler tables")
    p.add_argument(
        "--profile-contender",
        default="surgery",
        help="comma list of contenders to profile (e.g. surgery,surgery_compiled)",
    )
    p.add_argument("--profile-scenario", choices=list(KINDS), default="padded")
    p.add_argument(
        "--profile-batch", type=positive_int, default=2, help="rows of the profiled batch"
    )
    p.add_argument(
        "--profile-trace", action="store_true", help="with the tables, the gzipped chrome trace"
    )
    p.add_argument("--worker-timeout-s", type=float, default=240.0)
    p.add_argument(
        "--compiled-worker-timeout-s",
        type=float,
        default=540.0,
        help="timeout of a compiled contender's worker (compilation included)",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=480.0,
        help="start no new worker after this many seconds (results so far are kept)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check with tiny configs")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="combine train_step*.json files of split runs into --out/train_step.json (+ png)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    if args.merge:
        return merge(args.merge, args.out or RESULTS_DIR)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "train_step: no CUDA device. This benchmark measures GPU training steps; run it on the "
            "GPU machine, or use --smoke for a CPU plumbing check with tiny configs.",
            file=sys.stderr,
        )
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    contenders = with_compile(contenders, args.compile)
    profiled = [c.strip() for c in args.profile_contender.split(",") if c.strip()]
    bad = [m for m in models if m not in MODELS] + [
        c for c in contenders + profiled if not known_contender(c)
    ]
    if bad:
        print(f"unknown model(s)/contender(s): {bad}", file=sys.stderr)
        return 2
    out_dir = args.out or (Path("/tmp/surgery-bench-smoke") if args.smoke else RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    args.scenarios = scenarios_to_run(args.scenarios, args.quick)
    base_job = {
        "smoke": args.smoke,
        "quick": args.quick,
        "warmup": warmup,
        "steps": steps,
        "seed": args.seed,
        "out": str(out_dir),
        "compile_backend": args.compile_backend,
        "skip_max_seq": args.skip_max_seq,
        "scenarios": [list(scenario) for scenario in args.scenarios],
    }
    print(
        f"train_step: models {models}, contenders {contenders}, {warmup}+1 warm-up and {steps}"
        f" timed steps per scenario; about 40-60 s per (model, contender) on an H100",
        flush=True,
    )
    doc: dict[str, Any] = {
        "benchmark": "train_step",
        "environment": environment(),
        "settings": {**base_job, "models": models, "contenders": contenders},
        "models": {m: MODELS[m] for m in models},
        "definitions": {
            "step": "forward with labels, loss.backward(), AdamW step (fused on CUDA),"
            " zero_grad(set_to_none=True); bf16 weights, random init from the config, seed fixed",
            "tokens_per_s": "batch x seq (padding included) / median time of the timed steps",
            "real_tokens_per_s": "tokens that are not padding / median step time (text models:"
            " the tokens with a label)",
            "multimodal_tokens": "qwen2_5_vl, gemma3: tokens_per_s counts the rows' tokens"
            " (text, markers and image placeholder tokens, padding included), never the vision"
            " tower's patches; each scenario records its conversations, images, image_tokens,"
            " vision_patches and label_tokens (prompts and images are labelled -100)",
            "peak_gib": "torch.cuda.max_memory_allocated() over the scenario's steps after"
            " reset_peak_memory_stats(): absolute, weights + grads + AdamW state + activations",
            "max_seq": "batch 1, one document, no padding; one step per length, ascending,"
            " stopping at the first that runs out of memory",
            "scenarios": __doc__,
        },
        "results": [],
    }
    # A subset of the models gets its own file name, so split runs can sit side by side (--merge).
    stem = "train_step" if models == list(MODELS) else "train_step-" + "-".join(models)
    json_path = out_dir / f"{stem}.json"
    t_start = time.perf_counter()
    if not args.profile_only:
        for m in models:
            for c in contenders:
                label = f"{m}/{c}"
                if time.perf_counter() - t_start > args.time_budget_s:
                    res = {"model": m, "contender": c, "status": "skipped", "error": "time budget"}
                    print(f"[{label}] skipped: time budget", flush=True)
                else:
                    t0 = time.perf_counter()
                    print(f"[{label}] starting", flush=True)
                    res = run_worker(
                        {**base_job, "model": m, "contender": c}, worker_timeout(args, c), label
                    )
                    res["wall_s"] = round(time.perf_counter() - t0, 1)
                    longest = (res.get("max_seq") or {}).get("longest")
                    print(
                        f"[{label}] {res.get('status')} in {res['wall_s']:.0f} s;"
                        f" kernels {res.get('kernels_on')}; longest seq at batch 1: {longest}"
                        + (f"; {res.get('error')}" if res.get("error") else ""),
                        flush=True,
                    )
                doc["results"].append(res)
                doc["total_seconds"] = round(time.perf_counter() - t_start, 1)
                write_json(json_path, doc)
    if args.profile or args.profile_only:
        m = models[0]
        doc["profile"] = []
        for c in profiled:
            label = f"{m}/{c} profile ({args.profile_scenario})"
            print(f"[{label}] starting", flush=True)
            job = {**base_job, "model": m, "contender": c, "profile": True,
                   "profile_scenario": args.profile_scenario,
                   "profile_batch": args.profile_batch,
                   "profile_trace": args.profile_trace}  # fmt: skip
            res = run_worker(job, worker_timeout(args, c), label)
            doc["profile"].append({k: v for k, v in res.items() if k != "scenarios"})
            write_json(json_path, doc)
    if doc["results"]:
        note = plot(doc["results"], out_dir / f"{stem}.png")
        if note:
            print(note)
    doc["total_seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(json_path, doc)
    print(f"\nwrote {json_path} ({doc['total_seconds']:.0f} s)\n")
    if doc["results"]:
        print(render_tables(doc["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
