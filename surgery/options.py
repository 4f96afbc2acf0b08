"""What ``surgery.patch`` can be asked to do: ``OPTIONS``, the one table of its keyword options.

Each ``Option`` names its default, the values it takes (``Kind``), its section of
``docs/options.md`` and whether the loss-only fallback keeps it (``loss_only``); its ``summary`` is
the contract, the first paragraph of its entry in ``docs/options.md`` (which adds what it costs,
measured). From the table come ``PatchOptions`` (one frozen field per option, in the table's order,
checked and normalised when made), ``loss_only_options`` (the fallback's subset) and
``patch``'s keyword arguments (``tests/surgery/test_options.py`` holds ``patch``'s signature, the
docs' headings and first paragraphs to the table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LOSS_REDUCTIONS",
    "OPTION",
    "OPTIONS",
    "SECTIONS",
    "Kind",
    "Option",
    "PatchOptions",
    "loss_only_options",
]

LOSS_REDUCTIONS = ("mean", "sequence")

SECTIONS = (
    "The loss",
    "The kernels",
    "Memory: activations rebuilt in the backward",
    "Attention and batch layout",
)
"""The sections of ``docs/options.md``, in order."""


@dataclass(frozen=True)
class Kind:
    """The values an option takes: ``check(name, value)`` returns the value to keep (an int
    given for a float made a float) or raises ``TypeError`` / ``ValueError`` naming the option."""

    annotation: Any
    check: Callable[[str, Any], Any]


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _reduction(name: str, value: Any) -> str:
    if value not in LOSS_REDUCTIONS:
        raise ValueError(f"{name} must be one of {LOSS_REDUCTIONS}, got {value!r}")
    return value


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def _nonnegative(name: str, value: Any) -> float:
    value = _real(name, value)
    if not value >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _fraction(name: str, value: Any) -> float:
    value = _real(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def _positive_int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _name_or_none(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {value!r}")
    return value


BOOL = Kind(bool, _bool)
REDUCTION = Kind(Literal["mean", "sequence"], _reduction)
NONNEGATIVE = Kind(float, _nonnegative)
FRACTION = Kind(float, _fraction)
BYTES = Kind(int | None, _positive_int_or_none)
NAME = Kind(str | None, _name_or_none)


@dataclass(frozen=True)
class Option:
    """One keyword option of ``surgery.patch``."""

    name: str
    default: Any
    kind: Kind
    section: str
    """Its section of ``docs/options.md`` (one of ``SECTIONS``)."""
    loss_only: bool
    """Kept by the loss-only fallback (``fallback="loss"``); otherwise turned off there, as it
    acts on modules the fallback leaves alone (a bool option: False)."""
    summary: str
    """The contract: what the option does, in a sentence or two (no measurements)."""


_LOSS, _KERNELS, _MEMORY, _LAYOUT = SECTIONS

OPTIONS: tuple[Option, ...] = (
    Option("rope", True, BOOL, _KERNELS, False,
           "Apply RoPE with `apply_rope` from the position ids (swaps the attention forward)."),
    Option("fused_linear_cross_entropy", True, BOOL, _LOSS, True,
           "In training with labels, feed hidden states straight into `linear_cross_entropy` "
           "through the lm_head module; the logits exist one chunk at a time, within "
           "`loss_chunk_bytes`' plan (docs/training.md)."),
    Option("loss_reduction", "mean", REDUCTION, _LOSS, True,
           '`"mean"` (transformers\' token mean, honouring `num_items_in_batch`) or `"sequence"` '
           "(mean over each sequence's tokens, then over sequences: packing-aware)."),
    Option("z_loss_scale", 0.0, NONNEGATIVE, _LOSS, True,
           "Weight of `logsumexp(logits)**2` added to the loss (reported in `z_loss`)."),
    Option("label_smoothing", 0.0, FRACTION, _LOSS, True,
           "As in `torch.nn.functional.cross_entropy`."),
    Option("return_logits", False, BOOL, _LOSS, True,
           "Also return logits in training (then the loss is computed from them)."),
    Option("rms_norm", True, BOOL, _KERNELS, False,
           "Every RMSNorm (q/k norms included) through the fused `rms_norm` kernel, with the "
           "architecture's cast points (swaps the norm forwards)."),
    Option("gated_mlp", True, BOOL, _KERNELS, False,
           "The MLP's `act(gate) * up` through the fused `gated_activation` kernel (swaps the MLP "
           "forwards; left alone for an activation without a kernel)."),
    Option("embedding_backward", True, BOOL, _KERNELS, False,
           "The text model's input embedding (a plain `nn.Embedding`, without `max_norm` or sparse "
           "gradients) computes its weight gradient in one op, `surgery::embedding_backward`: "
           "PyTorch's own eager kernel, so the gradient is bit for bit the unpatched eager one, "
           "and a compiled model keeps that kernel instead of Inductor's decomposition, which "
           "holds an fp32 copy of the whole table at the end of the backward "
           "(`surgery.kernels.embedding`)."),
    Option("recompute_mlp_product", True, BOOL, _MEMORY, False,
           "With `gated_mlp`, the product `act(gate) * up` is not kept for `down_proj`'s weight "
           "gradient; the backward rebuilds it, bit for bit, from gate and up (kept anyway): one "
           "(tokens x intermediate) tensor less per layer."),
    Option("recompute_norm_output", True, BOOL, _MEMORY, False,
           "With `rms_norm`, an RMSNorm's output is not kept for the projections after it (q/k/v, "
           "gate/up; needs `rope` and `gated_mlp` respectively, whose forwards run those "
           "projections); the backward rebuilds it from the norm's input and weight (kept anyway) "
           "with the forward's kernel: two (tokens x hidden) tensors less per layer."),
    Option("loss_low_memory", False, BOOL, _LOSS, True,
           "The fused loss keeps no logits chunk and no gradient from the forward to the "
           "backward; the backward recomputes the logits in vocabulary slices (a fourth matrix "
           "product) — `linear_cross_entropy(low_memory=True)`."),
    Option("loss_chunk_bytes", None, BYTES, _LOSS, True,
           "The fused loss's chunk budget (`linear_cross_entropy(chunk_bytes=)`; None: its "
           "default)."),
    Option("loss_skip_ignored", True, BOOL, _LOSS, True,
           "The fused loss's matrix products run over the tokens with a label only "
           "(`linear_cross_entropy(skip_ignored=True)`): exact; an SFT batch whose prompts and "
           "images are masked costs that much less of the loss's three products and of its logits "
           "buffer, for one host read of the count per call (which waits for the forward to finish "
           "on the GPU; none while a CUDA graph is captured)."),
    Option("share_attention_mask", True, BOOL, _LAYOUT, False,
           "With `rope` (whose attention forward runs the attention) and "
           '`attn_implementation="sdpa"`, a boolean 4-D mask is turned into an additive one once '
           "per forward and that one tensor goes to every layer."),
    Option("causal_right_padding", True, BOOL, _LAYOUT, False,
           "In a fused-loss training step on sdpa, a right-padded batch whose padding positions "
           "are all ignored (label `ignore_index`) runs without its attention mask, as a plain "
           "causal batch: sdpa then takes its flash kernel (causal blocks skipped, no key/value "
           "repeat for GQA) instead of a masked kernel over the full square."),
    Option("padding_free", True, BOOL, _LAYOUT, False,
           "With `causal_right_padding` and `rope`, such a right-padded batch runs its real tokens "
           "only: the causal-LM forward hands the base model the real tokens as one row, and each "
           "attention layer runs sdpa's causal kernel on each row's real tokens alone, one call a "
           "row. A left-padded batch runs each row rolled (real tokens first) without a mask."),
    Option("eager_attention_recompute", True, BOOL, _MEMORY, False,
           'With `rope` and `attn_implementation="eager"` (Gemma 2\'s default), the fp32 '
           "attention probabilities are not kept for the backward, which recomputes them from the "
           "kept half-precision tanh output (or scores) with transformers' own ops: gradients bit "
           "for bit transformers', 4 bytes per attention score and layer less (2 without a "
           "softcap) for one softmax pass more in the backward; see `surgery.attention.forward`."),
    Option("varlen_attention", True, BOOL, _LAYOUT, False,
           'With `rope` and `attn_implementation="sdpa"` on a CUDA GPU with flash attention '
           "(sm80+, torch 2.11+), a packed batch in a training or loss call (position ids "
           "restarting inside a row, no attention mask, no KV cache) runs its attention through "
           "`torch.nn.attention.varlen.varlen_attn` over the documents instead of sdpa with "
           "transformers' (batch, 1, seq, seq) block-diagonal mask: the same attention (each "
           "document sees only itself, causally, within any sliding window), but only the blocks "
           "inside documents are computed."),
    Option("flex_attention", True, BOOL, _LAYOUT, False,
           'With `rope` and `attn_implementation="eager"` on a CUDA GPU, an attention with a '
           "logit softcap (Gemma 2's) whose keys are its own queries' (training, a loss call, a "
           "prefill; not a decoding step) and whose weights no one asked for runs through torch's "
           "flex attention (transformers' `flex_attention_forward`, the softcap its score "
           "modifier) over a block mask made once per forward from the eager mask: the same "
           "attention without the (batch, heads, seq, seq) scores in memory, and the blocks the "
           "mask leaves out skipped."),
    Option("experts_implementation", "auto", NAME, _KERNELS, True,
           "Mixture-of-experts models whose experts dispatch through transformers' experts "
           "implementations (`use_experts_implementation`), which one runs; `unpatch` puts the "
           "previous one back."),
    Option("tensor_parallel_projections", True, BOOL, _KERNELS, False,
           "Projections that transformers' tensor parallelism (`tp_plan`) or torch's "
           "`parallelize_module` shards column- or row-wise run on their local shards, with the "
           "all-reduces their layouts need issued by surgery, instead of through DTensor "
           "(`surgery.forwards.tensor_parallel`)."),
)  # fmt: skip
"""Every keyword option of ``surgery.patch``, in the order of its signature."""

OPTION = {option.name: option for option in OPTIONS}
"""``OPTIONS`` by name."""


def _check(self) -> None:
    for option in OPTIONS:
        value = option.kind.check(option.name, getattr(self, option.name))
        object.__setattr__(self, option.name, value)


PatchOptions = dataclasses.make_dataclass(
    "PatchOptions",
    [
        (option.name, option.kind.annotation, dataclasses.field(default=option.default))
        for option in OPTIONS
    ],
    frozen=True,
    namespace={
        "__post_init__": _check,
        "__doc__": "Options of one patch, one field per ``OPTIONS`` entry (its name, default and "
        "checks); read by the patched forwards at call time. Raises ``TypeError`` or "
        "``ValueError`` naming an option given a value it does not take.",
    },
)
PatchOptions.__module__ = __name__  # make_dataclass's ``module`` argument is Python 3.12's


def loss_only_options(options: PatchOptions) -> PatchOptions:
    """``options`` with every option the loss-only fallback does not keep (``Option.loss_only``)
    turned off: RoPE, RMSNorm, MLP and embedding kernels (and their recomputation), the
    attention options, and ``causal_right_padding`` and ``padding_free`` (dropping a mask is
    exact only under causal attention everywhere, which the fallback's probe does not prove)."""
    return dataclasses.replace(
        options, **{option.name: False for option in OPTIONS if not option.loss_only}
    )
