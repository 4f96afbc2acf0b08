"""The reference side's loss: HF logits in, the patch's loss definition out, in plain fp32 PyTorch.

Deliberately written from the definition and not shared with ``surgery.kernels``, so that the
convergence suite compares two independent derivations. Labels follow the HF convention: the
logits at token t predict the label at t + 1 of the same row (``shift_labels``, when given, are
the targets of each position already).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["REDUCTIONS", "causal_lm_loss", "sequence_starts"]

REDUCTIONS = ("mean", "sequence")


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: where a packed document starts, i.e. where a position does not count up by
    one from the previous one (and at every row's first token)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    reduction: str = "mean",
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, z_loss)`` of (B, T, V) ``logits`` against (B, T) unshifted ``labels`` (or the
    targets ``shift_labels``, which take precedence, as in transformers).

    Per token with a target: ``ce = cross_entropy`` (with label smoothing) and
    ``z = z_loss_scale * logsumexp(logits)^2``; ``loss`` reduces ``ce + z`` and ``z_loss`` reduces
    ``z`` alone, both with ``reduction``:

    - ``"mean"``: the sum over tokens with a target divided by their number (HF's token mean).
    - ``"sequence"``: each sequence's mean over its own tokens with a target, then the mean over
      sequences that have any. A sequence is a row, or with ``position_ids`` a run of positions
      that count up by one (a packed document).

    With ``position_ids``, a document's last token has no target: the next token belongs to the
    next document, whatever its label says.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    n_rows, row_len, vocab = logits.shape
    if shift_labels is None:
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if position_ids is not None:
        pos = position_ids.expand(n_rows, row_len)
        starts = sequence_starts(pos)
        next_starts = F.pad(starts[:, 1:], (0, 1), value=True)
        shift_labels = shift_labels.masked_fill(next_starts, ignore_index)
    targets = shift_labels.reshape(-1)
    x = logits.float().reshape(-1, vocab)
    ce = F.cross_entropy(
        x, targets, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = targets != ignore_index
    z = torch.where(valid, z_loss_scale * torch.logsumexp(x, dim=-1).square(), 0.0)
    total = ce + z
    if reduction == "mean":
        n = valid.sum().clamp_min(1)
        return total.sum() / n, z.sum() / n

    if position_ids is None:
        seq = torch.arange(n_rows, device=logits.device).repeat_interleave(row_len)
    else:
        seq = starts.reshape(-1).long().cumsum(0) - 1
    n_seqs = int(seq[-1]) + 1
    count = torch.zeros(n_seqs, device=x.device).index_add_(0, seq, valid.float())
    has_tokens = count > 0
    weight = torch.where(has_tokens, 1.0 / count.clamp_min(1), 0.0) / has_tokens.sum().clamp_min(1)
    per_seq_total = torch.zeros(n_seqs, device=x.device).index_add_(0, seq, total)
    per_seq_z = torch.zeros(n_seqs, device=x.device).index_add_(0, seq, z)
    return (per_seq_total * weight).sum(), (per_seq_z * weight).sum()
