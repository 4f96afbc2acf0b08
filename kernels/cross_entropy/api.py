"""``cross_entropy`` and ``cross_entropy_statistics``, and the argument checks and loss inputs
(targets, per-token weights) that the linear cross entropy, the log-probabilities and the
vocabulary-parallel head share."""

from __future__ import annotations

import math

import torch

from ..reduction import REDUCTIONS, prepare_targets, sequence_starts, token_weights
from ..reference import LossOutput
from .launch import named_statistics, statistics_mask
from .ops import CrossEntropyFunction

__all__ = ["check_options", "cross_entropy", "cross_entropy_statistics", "prepare_loss_inputs"]


def check_options(reduction: str, label_smoothing: float, z_loss_scale: float, softcap) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss_scale < 0.0:
        raise ValueError(f"z_loss_scale must be >= 0, got {z_loss_scale}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")


def batch_rows(inputs: torch.Tensor) -> int:
    """The rows of (B, T, ...) hidden states or logits: B (every dim before the last two); 1 of
    (N, ...) ones."""
    return math.prod(inputs.shape[:-2]) if inputs.dim() > 2 else 1


def prepare_loss_inputs(
    labels: torch.Tensor,
    n_tokens: int,
    vocab_size: int,
    device: torch.device,
    *,
    ignore_index: int,
    reduction: str,
    num_items_in_batch,
    position_ids,
    cu_seqlens,
    shift: bool,
    rows: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Targets (column or -1) and per-token weights, shared by both loss entry points. ``rows``:
    how many rows the inputs hold (B of (B, T, ...) inputs, 1 of flat ones), for the shift."""
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.dim() not in (1, 2) or labels.numel() != n_tokens:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match {n_tokens} tokens "
            "(expected (N,) for (N, ...) inputs or (B, T) for (B, T, ...) inputs)"
        )
    if shift and rows > 1 and labels.dim() == 1:
        raise ValueError(
            f"flat labels of shape {tuple(labels.shape)} for inputs of {rows} rows: with "
            "shift=True pass them as (B, T), so that no row's last token learns the next row's "
            "first label"
        )
    if num_items_in_batch is not None and reduction not in ("mean", "sum"):
        raise ValueError(
            f'num_items_in_batch applies to reduction "mean" or "sum", not {reduction!r}'
        )
    # int64 whatever the labels' width: "no target" (-1) and any ignore_index must be
    # representable (in uint8, -1 is class 255).
    labels = labels.to(device=device, dtype=torch.int64)
    starts = sequence_starts(tuple(labels.shape), device, position_ids, cu_seqlens)
    if reduction == "sequence" and starts is None:
        raise ValueError(
            'reduction="sequence" needs sequence boundaries: pass position_ids or cu_seqlens, '
            "or labels of shape (B, T) where each row is one sequence"
        )
    targets, valid = prepare_targets(labels, vocab_size, ignore_index, shift, starts)
    targets = torch.where(valid, targets, torch.full_like(targets, -1)).contiguous()
    weights = token_weights(valid, reduction, starts, num_items_in_batch)
    return targets, weights


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    inplace_backward: bool = False,
) -> LossOutput:
    """Cross entropy over existing logits, in one read of the logits forward and one read plus
    one write backward, computed in fp32 inside the kernel whatever the logits' dtype.

    Args:
        logits: (N, V) or (B, T, V); fp32, bf16 or fp16; unit stride along V.
        labels: (N,) or (B, T) integer class indices; ``ignore_index`` marks tokens without a
            target. A label outside [0, V) that is not ``ignore_index`` raises (CPU, or GPU with
            SURGERY_DEBUG=1) or is treated as ignored and flagged for ``check_labels()`` (GPU).
        ignore_index: any int, as in ``F.cross_entropy``; a class in [0, V) too, whose tokens
            are then not trained.
        reduction: "mean" over tokens with a target; "sum"; "none" (per token, shape of labels,
            0 where ignored); "sequence": each sequence's mean over its tokens with a target, then
            the mean over sequences that have any.
        num_items_in_batch: HF gradient-accumulation normaliser: the sum divided by it.
        position_ids / cu_seqlens: sequence boundaries (a new sequence starts where the position
            does not continue, or at each cu_seqlens offset). Without them a row of (B, T) labels
            is one sequence. Runs of ignore_index are never boundaries.
        z_loss_scale: adds s * logsumexp^2 per token to ``loss``; ``z_loss`` returns that term.
        label_smoothing: as ``F.cross_entropy`` defines it.
        softcap: Gemma 2/3 final-logit softcap, cap * tanh(logits / cap), applied in the kernel.
        shift: next-token targets (labels[t + 1] of the same row and sequence) without copying
            the logits. (B, T, V) logits of more than one row need (B, T) labels (flat ones
            raise).
        inplace_backward: write the gradient into ``logits``' own buffer during backward (saves
            one logits-sized allocation). Only when nothing else reads those logits afterwards.

    Returns:
        ``LossOutput(loss, z_loss)`` in fp32.
    """
    loss, _ = cross_entropy_statistics(
        logits, labels, ignore_index=ignore_index, reduction=reduction,
        num_items_in_batch=num_items_in_batch, position_ids=position_ids, cu_seqlens=cu_seqlens,
        z_loss_scale=z_loss_scale, label_smoothing=label_smoothing, softcap=softcap, shift=shift,
        inplace_backward=inplace_backward,
    )  # fmt: skip
    return loss


def cross_entropy_statistics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    statistics: tuple[str, ...] = (),
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    inplace_backward: bool = False,
) -> tuple[LossOutput, dict[str, torch.Tensor]]:
    """``cross_entropy``'s loss (every argument as it takes them) and, from the same read of the
    logits, per-token ``statistics`` of ``softmax`` of the logits the loss sees (after the
    softcap): names among ``STATISTICS`` (``entropy``, ``log_sum_sq_probs``, ``mean_logits``,
    ``is_top1``, ``predicted``: the first maximum's column, as argmax takes it), shaped like
    ``labels``, fp32 (``is_top1`` bool, ``predicted`` int64), 0 (-1 for ``predicted``) where a
    token has no target, detached. Each costs a few operations per logit, none when not asked;
    the loss and its gradient are ``cross_entropy``'s exactly (the same autograd path).
    """
    stats = statistics_mask(statistics)
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    V = logits.shape[-1]
    check_options(reduction, label_smoothing, z_loss_scale, softcap)
    logits2d = logits.reshape(-1, V)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    targets, weights = prepare_loss_inputs(
        labels,
        logits2d.shape[0],
        V,
        logits.device,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
        rows=batch_rows(logits),
    )
    loss, z, *values = CrossEntropyFunction.apply(
        logits2d,
        targets,
        weights,
        float(softcap or 0.0),
        float(label_smoothing),
        float(z_loss_scale),
        bool(inplace_backward),
        stats,
    )
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return LossOutput(loss, z), named_statistics(values, statistics, labels.shape)
