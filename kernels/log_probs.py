"""Per-token log-probabilities of ``hidden @ weight.T (+ bias)`` and statistics of the same
distribution, the logits one budgeted chunk at a time: what RL and distillation-free fine-tuning
losses read (TRL's fused head asks for exactly these; ``surgery.integrations.trl`` serves it from
here).

It is the fused linear cross entropy read per token (log p(target) = -ce, reduction "none"),
through the same autograd path (``LinearCrossEntropyFunction``): any upstream gradient on the
log-probabilities and on the entropy is exact (the backward turns the logits the forward kept
into their gradient, or, where one chunk cannot hold them, recomputes them one vocabulary slice
at a time); the other statistics are computed in the forward's sweep over each row and
cost nothing when not requested. The fp32 reference is ``reference.linear_log_probs_reference``.
"""

from __future__ import annotations

import torch

from .cross_entropy import (
    STATISTICS,
    batch_rows,
    check_options,
    prepare_loss_inputs,
    statistics_mask,
)
from .linear_cross_entropy import (
    LinearCrossEntropyFunction,
    UpstreamHint,
    chunk_budget,
    input_needs,
    prepare_head_inputs,
)
from .reference import TokenLogProbs

__all__ = [
    "OUTPUTS",
    "TokenLogProbs",
    "UpstreamHint",
    "check_log_probs_options",
    "linear_log_probs",
    "token_log_probs",
]

OUTPUTS = ("log_probs", *STATISTICS)
"""The names ``linear_log_probs`` can return (``TokenLogProbs``' fields)."""


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    outputs: tuple[str, ...] = ("log_probs",),
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    shift: bool = False,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
    low_memory: bool = False,
    skip_ignored: bool = False,
    upstream: UpstreamHint | None = None,
) -> TokenLogProbs:
    """Per-token ``TokenLogProbs`` of the distribution ``softmax(x)``, where
    ``x = cap * tanh(logit_scale * (hidden @ weight.T + bias) / cap) / temperature`` (``cap`` the
    ``softcap``, where given).

    Args:
        hidden, weight, labels, bias, ignore_index, shift, position_ids, cu_seqlens,
            chunk_bytes, skip_ignored: as ``linear_cross_entropy`` takes them (``shift``: the
            target of a token is the next label of its row and sequence).
        outputs: which fields to compute, among ``OUTPUTS``; ``log_probs`` always is. Each
            statistic costs a few operations per logit in the forward's sweep, none when off.
        temperature: > 0; logit_scale: any float (1: none).
        low_memory: smaller vocabulary slices in the backward (64 MiB of logits by default),
            and never the gradients in the forward (``upstream`` is then only informed).
        upstream: an ``UpstreamHint`` kept across the steps of a loop whose loss weighs every
            token's log-probability alike (a token mean: SFT): from the second step on, the
            forward computes the gradients at once (three matrix products, as
            ``linear_cross_entropy`` does, with no logits kept for the backward); each backward
            checks that the upstream gradient is still uniform over the tokens with a target (one
            host read) and recomputes if not. Exact either way; off under ``torch.compile``.
            None: never. A softcapped bf16 head on a GPU that runs the fused products, in one
            chunk, instead keeps its product's Q for the backward, whatever the upstream gradient
            (three products, no guess, no host read), unless the hint saw the last backward take
            a gradient through the entropy, or, without a hint, the entropy is an output: then
            the logits are kept (they serve that gradient too). Where the hint does not guess,
            other heads (bf16 or fp32, no bias, no z-loss) keep the logits' gradient for a unit
            coefficient per token under the same rule: the backward scales its rows (no pass
            over the logits, and no host read once the hint has seen a backward).

    Returns:
        ``TokenLogProbs``, fp32 (``is_top1`` bool, ``predicted`` int64), shaped like ``labels``,
        0 (-1 for ``predicted``) where a token has no target. ``log_probs`` and ``entropy`` take
        any upstream gradient exactly; a gradient through the entropy (an entropy bonus) is
        computed with the log-probabilities' in the same pass over the logits.
    """
    stats = check_log_probs_options(outputs, temperature, softcap)
    x, w, bias = prepare_head_inputs(hidden, weight, bias)
    targets, _ = prepare_loss_inputs(
        labels,
        x.shape[0],
        w.shape[0],
        x.device,
        ignore_index=ignore_index,
        reduction="none",
        num_items_in_batch=None,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
        rows=batch_rows(hidden),
    )
    needs = input_needs(x, w, bias)
    ce, _, *statistics = LinearCrossEntropyFunction.apply(
        x, w, bias, targets, None, float(softcap or 0.0), 0.0, 0.0,
        chunk_budget(chunk_bytes, low_memory), bool(low_memory), needs, bool(skip_ignored),
        (float(logit_scale), 1.0 / float(temperature)), stats,
        None if torch.compiler.is_compiling() else upstream,
    )  # fmt: skip
    return token_log_probs(ce, statistics, outputs, labels.shape)


def check_log_probs_options(outputs, temperature: float, softcap: float | None) -> int:
    """The options of ``linear_log_probs`` checked; the bit mask of the ``STATISTICS`` that
    ``outputs`` asks for (bit i for the i-th name)."""
    stats = statistics_mask(outputs, OUTPUTS, "outputs")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_options("none", 0.0, 0.0, softcap)
    return stats


def token_log_probs(ce: torch.Tensor, statistics, outputs, shape) -> TokenLogProbs:
    """The ``TokenLogProbs`` of the per-token losses ``ce`` (log p = -ce) and the autograd
    path's ``STATISTICS`` outputs, shaped like the labels (``shape``); None where not asked."""
    fields = {
        name: t.view(shape) if name in outputs else None
        for name, t in zip(STATISTICS, statistics, strict=True)
    }
    return TokenLogProbs(log_probs=(-ce).view(shape), **fields)
