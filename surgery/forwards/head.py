"""The lm_head of a patched model: its ``nn.Linear`` projections onto the vocabulary take the loss
arguments (``lm_head_forward``: given labels, the fused ``linear_cross_entropy`` instead of the
logits), called through the module so that its hooks (FSDP2's all-gather, accelerate's) run
around it and a tied head reads the shared weight.

Which Linears those are (``head_linears``: the head, PEFT's ``ModulesToSaveWrapper`` copies, the
base layer inside a LoRA layer), whether a call of the head reaches only them
(``head_takes_loss``: an adapter with parameters of its own makes the forward use its logits
instead, so the adapter is trained), and a head replaced after ``patch`` (fused on the first call
that needs it, ``fuse_replaced_head``).
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch
from torch import nn

from surgery.kernels import (
    linear_cross_entropy,
    linear_cross_entropy_statistics,
    linear_log_probs,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_log_probs,
)
from surgery.patching.foreign import tensor_parallel_forward
from surgery.patching.swap import ORIGINAL_ATTR, apply_swaps, is_swapped, plan_swap

__all__ = [
    "LM_HEAD_ATTR",
    "fuse_replaced_head",
    "fused_head",
    "head_linears",
    "head_logits",
    "head_takes_loss",
    "lm_head_forward",
    "rows_sharded",
    "warn_unfused",
]

LM_HEAD_ATTR = "_surgery_lm_head"
"""Instance attribute of a patched lm_head Linear (True)."""


def lm_head_forward(
    self: nn.Linear, input: torch.Tensor, labels: torch.Tensor | None = None, **loss
):
    """``nn.Linear.forward`` that, given ``labels``, returns the ``LossOutput`` of
    ``linear_cross_entropy`` of ``input @ self.weight.T (+ bias)`` instead of the product (given
    ``outputs`` too, the ``TokenLogProbs`` of ``linear_log_probs``; given ``statistics``, the
    loss and statistics of ``linear_cross_entropy_statistics``). Called through the module, so
    the weight is whatever the module holds during its forward (FSDP2 unshards it there)."""
    if labels is None:
        tensor_parallel = _tensor_parallel_head(self)
        if tensor_parallel is not None:  # transformers' forward: logits gathered as it gathers them
            return tensor_parallel(input)
        return type(self).forward(self, input)
    vocab_parallel = rows_sharded(self.weight)
    if "outputs" in loss or "statistics" in loss:  # TRL's fused head (surgery.integrations.trl)
        return _log_probs(self, input, labels, vocab_parallel=vocab_parallel, **loss)
    if vocab_parallel:
        return _vocab_parallel_loss(self, input, labels, **loss)
    return linear_cross_entropy(input, self.weight, labels, bias=self.bias, **loss)


def fused_head(lm: nn.Module):
    """What the patched forward calls for the loss (``head(hidden, labels=..., **options)``): the
    lm_head module, so that its hooks run (FSDP2's all-gather, accelerate's), except a head whose
    rows were sharded by hand with torch's ``parallelize_module`` (``ColwiseParallel``): its hooks
    only lay out the input and the logits, which the loss never makes, so its patched forward
    is called directly."""
    head = lm.lm_head
    if (
        type(head) is nn.Linear
        and rows_sharded(head.weight)
        and head._forward_hooks
        and _tensor_parallel_head(head) is None
        and LM_HEAD_ATTR in head.__dict__
    ):
        return functools.partial(lm_head_forward, head)
    return head


def rows_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a DTensor whose rows (the vocabulary) are sharded: tensor
    parallelism's column-wise head (FSDP2 has unsharded its own dimension inside the call)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return (
        dtensor is not None
        and isinstance(weight, dtensor.DTensor)
        and any(isinstance(p, dtensor.Shard) and p.dim == 0 for p in weight.placements)
    )


def _tensor_parallel_head(head: nn.Linear):
    """The forward transformers' tensor parallelism set on ``head`` before ``patch`` (it shards
    the rows, and gathers the logits), or None."""
    installed = head.__dict__.get(ORIGINAL_ATTR)
    previous = None if installed is None else installed.previous
    return previous if tensor_parallel_forward(previous) else None


def _vocab_parallel_loss(head: nn.Linear, input: torch.Tensor, labels: torch.Tensor, **loss):
    """The loss of a head whose rows are sharded (a DTensor, ``Shard(0)``):
    ``vocab_parallel_linear_cross_entropy`` on each rank's rows, the hidden states as every rank
    holds them."""
    return vocab_parallel_linear_cross_entropy(
        _whole(input), head.weight, labels, head.bias, **_vocab_parallel_options(loss)
    )


def _whole(input: torch.Tensor) -> torch.Tensor:
    """The hidden states as a plain tensor: a DTensor input (a layout hook made one) made whole."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(input, dtensor.DTensor):
        return input.full_tensor()
    return input


def _vocab_parallel_options(options: dict) -> dict:
    """The head's kernel settings the vocabulary-parallel head takes (it has no
    ``skip_ignored``: every row takes part in its products)."""
    return {k: v for k, v in options.items() if k != "skip_ignored"}


def _log_probs(
    head: nn.Linear,
    input: torch.Tensor,
    labels: torch.Tensor,
    cast_fp32: bool = False,
    vocab_parallel: bool = False,
    **options,
):
    """``linear_log_probs`` of the head (``vocab_parallel``: of a head whose rows are sharded,
    ``vocab_parallel_linear_log_probs``), or given ``statistics`` the loss and statistics of
    ``linear_cross_entropy_statistics``; ``cast_fp32``: of the head run in fp32 outside
    autocast (hidden states, weight and bias cast, differentiably, on entry)."""
    weight, bias = head.weight, head.bias
    per_token = linear_log_probs
    if "statistics" in options:
        if vocab_parallel:
            raise NotImplementedError(
                "surgery: the SFT loss with surgery's options (surgery.integrations.trl_sft) is "
                "not available for a head whose vocabulary is sharded (tensor parallelism): use "
                "trl.SFTTrainer, whose per-token head surgery serves under tensor parallelism"
            )
        per_token = linear_cross_entropy_statistics
    elif vocab_parallel:
        input, options = _whole(input), _vocab_parallel_options(options)
        options.pop("upstream", None)  # no speculation: the logits are kept or recomputed
        per_token = vocab_parallel_linear_log_probs
    if not cast_fp32:
        return per_token(input, weight, labels, bias=bias, **options)
    input, weight, bias = (t if t is None else t.float() for t in (input, weight, bias))
    with torch.autocast(input.device.type, enabled=False):
        return per_token(input, weight, labels, bias=bias, **options)


def _is_plain_linear(module: nn.Module) -> bool:
    """``nn.Linear`` itself, not a subclass (a quantised layer, whose weight the fused loss cannot
    read), or the class FSDP2's ``fully_shard`` swaps in for it, ``FSDPLinear(FSDPModule,
    nn.Linear)``: a head sharded before ``patch`` is still fused."""
    cls = type(module)
    if cls is nn.Linear:
        return True
    if cls.__bases__[-1:] != (nn.Linear,):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return cls.__bases__ == (FSDPModule, nn.Linear)


def head_linears(lm: nn.Module) -> list[nn.Linear]:
    """The vocabulary projections under ``lm.lm_head``: the head itself (sharded by FSDP2 or not),
    or the copies inside a PEFT ``ModulesToSaveWrapper``, or the base layer inside a LoRA layer
    (whose own A/B projections have other shapes and are left alone). A multimodal wrapper's head
    projects onto its text config's vocabulary."""
    config = lm.config.get_text_config()
    return [
        m
        for m in lm.lm_head.modules()
        if _is_plain_linear(m)
        and m.out_features == config.vocab_size
        and m.in_features == config.hidden_size
    ]


def head_takes_loss(head: nn.Module) -> bool:
    """Whether ``head(hidden, labels=...)`` reaches only patched lm_head Linears: every module
    under ``head`` that owns parameters is one (PEFT's ``ModulesToSaveWrapper`` dispatches to
    such copies).
    A LoRA (or any other adapter) layer on the head owns other parameters: then the loss is computed
    from the logits the wrapped head returns, so the adapter is trained, never dropped."""
    for module in head.modules():
        if module._parameters and LM_HEAD_ATTR not in module.__dict__:
            return False
    return True


def head_logits(lm: nn.Module, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits of ``lm``'s head, capped as the model caps them (``softcap``, or None)."""
    logits = lm.lm_head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def fuse_replaced_head(lm: nn.Module) -> bool:
    """Fuse a head that was replaced after ``patch`` (``resize_token_embeddings`` and
    ``set_output_embeddings`` put a new ``nn.Linear`` there) the way ``patch`` fuses one: its
    forward is swapped for ``lm_head_forward``, undone by ``unpatch``. Not when anything else
    under the head owns parameters (an adapter: its logits are used, see ``head_takes_loss``), nor
    under ``torch.compile`` (no swapping inside a traced forward). True when the head now takes
    the loss."""
    if torch.compiler.is_compiling():
        return False
    new = [m for m in head_linears(lm) if not is_swapped(m)]
    if not new:
        return False
    for module in lm.lm_head.modules():
        if module._parameters and LM_HEAD_ATTR not in module.__dict__ and module not in new:
            return False
    swaps = [plan_swap(m, lm_head_forward, {LM_HEAD_ATTR: True}, "lm_head") for m in new]
    apply_swaps([swap for swap in swaps if swap is not None])
    return head_takes_loss(lm.lm_head)


def warn_unfused(head: nn.Module) -> None:
    # Python's default warning filter shows it once per process.
    if torch.compiler.is_compiling():
        cause = (
            "was replaced after surgery.patch (resize_token_embeddings?) and cannot be fused "
            "inside torch.compile; call surgery.patch(model) again before compiling"
        )
    else:
        cause = (
            f"is a {type(head).__name__} holding parameters of its own (e.g. a LoRA adapter); "
            "leave lm_head out of the adapter's target_modules (use modules_to_save=['lm_head'] "
            "to train it)"
        )
    warnings.warn(
        f"surgery: lm_head {cause}. The loss is computed from its logits (correct, but not fused).",
        stacklevel=3,
    )
