"""Loss reductions as per-token weights.

Every reduction except ``"none"`` is a weighted sum of per-token losses whose weights depend on the
labels and the sequence boundaries but never on the logits:

    loss = sum_i w_i * loss_i

so a kernel needs only ``w`` (or, for ``"none"``, the per-token upstream gradient) to produce exact
gradients. Everything here is plain tensor arithmetic on the device: no host synchronisation.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "REDUCTIONS",
    "check_labels",
    "drop_crossing_targets",
    "host_cu_seqlens",
    "label_error_flag",
    "prepare_targets",
    "sequence_starts",
    "token_weights",
]

REDUCTIONS = ("mean", "sum", "none", "sequence")

# One int32 flag per device: set (without a host sync) when a label outside [0, V) that is not
# ignore_index was seen on a GPU. Such labels are treated as ignored and never read out of bounds;
# `check_labels()` raises lazily, and SURGERY_DEBUG=1 checks eagerly (with a sync) on every call.
_LABEL_ERROR_FLAGS: dict[torch.device, torch.Tensor] = {}


def label_error_flag(device: torch.device) -> torch.Tensor:
    flag = _LABEL_ERROR_FLAGS.get(device)
    if flag is None:
        flag = torch.zeros((), dtype=torch.int32, device=device)
        _LABEL_ERROR_FLAGS[device] = flag
    return flag


def check_labels() -> None:
    """Raise if any GPU call since the last check saw a label outside [0, V) (this syncs)."""
    for device, flag in _LABEL_ERROR_FLAGS.items():
        if int(flag.item()):
            flag.zero_()
            raise ValueError(
                f"labels outside [0, vocab_size) that are not ignore_index were seen on {device}; "
                "they were treated as ignored. Set SURGERY_DEBUG=1 to find the call."
            )


def _trained_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """Mask of the labels that are targets: in [0, V) and not ``ignore_index`` (any int, inside
    [0, V) too, as in ``F.cross_entropy``). Reports labels outside [0, V) that are not
    ``ignore_index``."""
    if torch.compiler.is_compiling():
        return _trained_labels_op(labels, vocab_size, ignore_index)
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < vocab_size)
    bad = (~in_range) & (~ignored)
    if labels.device.type == "cpu" or os.environ.get("SURGERY_DEBUG", "0") not in ("", "0"):
        if bool(bad.any()):
            first = labels[bad][0].item()
            raise ValueError(
                f"label {first} is outside [0, {vocab_size}) and is not ignore_index "
                f"({ignore_index})"
            )
    elif labels.device.type != "meta":  # meta tensors hold no labels to check
        flag = label_error_flag(labels.device)
        flag.bitwise_or_(bad.any().to(torch.int32))
    return in_range & ~ignored


# Under torch.compile the check runs inside an op, at run time: tracing cannot hold the
# data-dependent raise, nor create the per-device flag (a flag created while tracing changes what
# the graph's guards saw, and the next call would compile again).
@torch.library.custom_op("surgery::trained_labels", mutates_args=())
def _trained_labels_op(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    return _trained_labels(labels, vocab_size, ignore_index)


@_trained_labels_op.register_fake
def _(labels, vocab_size, ignore_index):
    return torch.empty_like(labels, dtype=torch.bool)


def every_token_mask(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """int64 (batch, seq) ones: the attention mask a tokenizer gives a batch without padding, for
    a function that takes one where every token counts (a mixture of experts' load-balancing
    loss). Compiled, it is an op whose output Inductor reads as it reads a caller's own mask,
    never a constant it folds into the kernels that reduce it: Triton 3.6 cannot compile the
    kernel Inductor made of such a constant's count fused with the loss's own sums
    (``benchmarks/triton36_reduction_repro.py``; docs/compile.md)."""
    if torch.compiler.is_compiling():
        return _every_token_mask_op(batch, seq, device)
    return torch.ones(batch, seq, dtype=torch.long, device=device)


@torch.library.custom_op("surgery::every_token_mask", mutates_args=())
def _every_token_mask_op(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.ones(batch, seq, dtype=torch.long, device=device)


@_every_token_mask_op.register_fake
def _(batch, seq, device):
    return torch.empty(batch, seq, dtype=torch.long, device=device)


def sequence_starts(
    shape: tuple[int, ...],
    device: torch.device,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Flat (N,) bool mask of tokens that begin a sequence, or None when no boundary is known.

    ``shape`` is the labels' shape, (B, T) or (N,). With ``position_ids`` a sequence starts at the
    first token of each row and wherever the position does not continue (pos[t] != pos[t-1] + 1),
    so packed documents restarting at 0 and chunks starting at any offset both work. With
    ``cu_seqlens`` (cumulative lengths over the flattened tokens, starting at 0) each listed offset
    starts a sequence. Runs of ignore_index are never boundaries.
    """
    n = 1
    for s in shape:
        n *= s
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        starts = torch.zeros(n + 1, dtype=torch.bool, device=device)
        offsets = cu_seqlens[:-1].to(device=device, dtype=torch.long).clamp(0, n)
        starts.scatter_(0, offsets, True)
        starts = starts[:n]
        if len(shape) == 2:  # every row starts a sequence too
            starts = starts.view(shape).clone()
            starts[:, :1] = True  # (a row of no token has none)
            starts = starts.reshape(-1)
        elif n > 0:
            starts[0] = True
        return starts
    if position_ids is not None:
        pos = position_ids.to(device)
        if len(shape) == 1:
            if pos.dim() == 2 and pos.shape[0] == 1:
                pos = pos[0]
            if pos.shape != shape:
                raise ValueError(
                    f"position_ids of shape {tuple(position_ids.shape)} do not match labels "
                    f"of shape {tuple(shape)}"
                )
            pos = pos.view(1, -1)
        else:
            if pos.dim() == 1:
                pos = pos.view(1, -1)
            if pos.dim() != 2 or pos.shape[1] != shape[1] or pos.shape[0] not in (1, shape[0]):
                raise ValueError(
                    f"position_ids of shape {tuple(position_ids.shape)} do not match labels "
                    f"of shape {tuple(shape)} (expected (B, T) or (1, T))"
                )
            pos = pos.expand(shape[0], shape[1])
        starts = torch.ones(pos.shape, dtype=torch.bool, device=device)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        return starts.reshape(-1)
    if len(shape) == 2:
        starts = torch.zeros(shape, dtype=torch.bool, device=device)
        starts[:, :1] = True  # (a row of no token has none)
        return starts.reshape(-1)
    return None


def host_cu_seqlens(position_ids: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """On the host (one device-to-host copy of the position ids): int64 ``(documents + 1,)``
    offsets over the flattened (batch, seq) tokens where each document starts, then the token
    count; documents as ``sequence_starts`` finds them. ``position_ids`` may be (batch, seq),
    (1, seq) or (seq,): one row shared by every row."""
    positions = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
    starts = sequence_starts(shape, torch.device("cpu"), position_ids=positions.cpu())
    first = torch.nonzero(starts).flatten()
    return torch.cat([first, first.new_tensor([starts.numel()])])


def prepare_targets(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    shift: bool,
    starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat targets and the mask of tokens that carry a loss.

    With ``shift`` the target of token t is label t+1 of the same row and the same sequence: the
    last token of a row, and the last token of a packed sequence, have no target. Only the (small)
    label tensor is copied, never hidden states or logits.
    """
    if shift:
        rows = labels if labels.dim() == 2 else labels.view(1, -1)
        shifted = torch.full_like(rows, ignore_index)
        shifted[:, :-1] = rows[:, 1:]
        flat = _before_starts_ignored(shifted, starts, ignore_index).reshape(-1)
    else:
        flat = labels.reshape(-1)
    valid = _trained_labels(flat, vocab_size, ignore_index)
    # Tokens without a target read column 0 (never out of bounds) and get weight 0.
    targets = torch.where(valid, flat, torch.zeros_like(flat))
    return targets, valid


def drop_crossing_targets(
    targets: torch.Tensor,
    ignore_index: int,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Next-token targets given as they are (transformers' ``shift_labels``: token t's target is
    token t + 1's label), (B, T) or (N,), with ``ignore_index`` wherever token t + 1 of the same
    row starts a sequence (``sequence_starts``): a packed sequence's last token never predicts the
    next sequence's first, as ``prepare_targets`` has it when it shifts the labels itself. A row's
    last target is kept (under context parallelism, the next shard's first token). Without known
    boundaries ``targets`` itself; else a copy (the caller's tensor is never written)."""
    starts = sequence_starts(tuple(targets.shape), targets.device, position_ids, cu_seqlens)
    return _before_starts_ignored(targets, starts, ignore_index)


def _before_starts_ignored(targets: torch.Tensor, starts: torch.Tensor | None, ignore_index: int):
    """``targets`` ((B, T) or (N,): one row) with ``ignore_index`` at each token whose successor
    in its row begins a sequence (``starts``, flat, as ``sequence_starts`` gives them); a row's
    last token keeps its own. ``targets`` itself where ``starts`` is None, else a copy."""
    if starts is None:
        return targets
    starts = starts.view(targets.shape if targets.dim() == 2 else (1, -1))
    crossing = torch.zeros_like(starts)
    crossing[:, :-1] = starts[:, 1:]
    return targets.masked_fill(crossing.view(targets.shape), ignore_index)


def token_weights(
    valid: torch.Tensor,
    reduction: str,
    starts: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Per-token fp32 weights w with loss = sum_i w_i * loss_i; None for ``"none"``.

    - "mean": 1 / (number of tokens with a target), or 1 / num_items_in_batch when given (HF's
      gradient-accumulation normaliser: the sum divided by it).
    - "sum": 1 (divided by num_items_in_batch when given).
    - "sequence": 1 / (tokens with a target in the token's sequence) / (sequences with any).
    An all-ignored batch gets all-zero weights: loss 0 and zero gradients, never NaN.
    """
    if reduction == "none":
        return None
    v = valid.to(torch.float32)
    if reduction in ("mean", "sum"):
        if isinstance(num_items_in_batch, torch.Tensor):
            return v / num_items_in_batch.to(v.device, torch.float32).clamp_min(1.0)
        if num_items_in_batch is not None:  # a Python number: no host-to-device copy
            return v / max(float(num_items_in_batch), 1.0)
        if reduction == "sum":
            return v
        return v / v.sum().clamp_min(1.0)
    if reduction == "sequence":
        if starts is None:
            raise ValueError(
                'reduction="sequence" needs sequence boundaries: pass position_ids or cu_seqlens, '
                "or labels of shape (B, T) where each row is one sequence"
            )
        if num_items_in_batch is not None:
            raise ValueError(
                'num_items_in_batch counts tokens and does not apply to reduction="sequence", '
                "which averages over sequences"
            )
        seq = torch.cumsum(starts.to(torch.long), 0) - 1
        per_seq = torch.zeros_like(v).scatter_add_(0, seq, v)
        n_seqs = (per_seq > 0).sum().to(torch.float32).clamp_min(1.0)
        return v / per_seq[seq].clamp_min(1.0) / n_seqs
    raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
