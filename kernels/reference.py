"""Plain-PyTorch fp32 references for the loss kernels.

Written for clarity, not speed: full logits in fp32, per-token losses from ``F.cross_entropy``, and
sequence boundaries found with an explicit Python loop. Independent of ``reduction.py`` on purpose,
so that tests compare two different derivations of the same definition.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["LossOutput", "cross_entropy_reference", "linear_cross_entropy_reference"]


class LossOutput(NamedTuple):
    """``loss``: what is trained (cross entropy plus the z-loss term when z_loss_scale > 0).
    ``z_loss``: the z-loss term inside ``loss``, with the same reduction, for logging."""

    loss: torch.Tensor
    z_loss: torch.Tensor


def _segments(n_rows: int, row_len: int, position_ids, cu_seqlens) -> list[list[int]]:
    """Token indices (flattened) of each sequence, by walking the boundaries one token at a time."""
    segs: list[list[int]] = []
    if cu_seqlens is not None:
        cuts = [int(c) for c in cu_seqlens.tolist()]
        starts = set(cuts[:-1]) | {r * row_len for r in range(n_rows)}
        cur: list[int] = []
        for i in range(n_rows * row_len):
            if i in starts and cur:
                segs.append(cur)
                cur = []
            cur.append(i)
        if cur:
            segs.append(cur)
        return segs
    for r in range(n_rows):
        prev = None
        cur = []
        for t in range(row_len):
            if position_ids is not None:
                p = position_ids[r if position_ids.shape[0] > 1 else 0, t].item()
                if prev is not None and p != prev + 1 and cur:
                    segs.append(cur)
                    cur = []
                prev = p
            cur.append(r * row_len + t)
        if cur:
            segs.append(cur)
    return segs


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
) -> LossOutput:
    """The definition every loss kernel must match, computed in fp32 on full logits."""
    x = logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    V = x.shape[-1]
    lab = labels if labels.dim() == 2 else labels.view(1, -1)
    n_rows, row_len = lab.shape
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids.view(1, -1)
    segs = None
    if position_ids is not None or cu_seqlens is not None or labels.dim() == 2:
        segs = _segments(n_rows, row_len, position_ids, cu_seqlens)
    tgt = lab.reshape(-1).clone()
    if shift:
        new = torch.full_like(tgt, ignore_index)
        last_of_seq = set()
        for s in segs if segs is not None else [list(range(tgt.numel()))]:
            last_of_seq.add(s[-1])
        for i in range(tgt.numel()):
            if (i + 1) % row_len != 0 and i not in last_of_seq:
                new[i] = tgt[i + 1]
        tgt = new
    x = x.reshape(-1, V)
    ce = F.cross_entropy(
        x, tgt, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.logsumexp(x, dim=-1)
    valid = tgt != ignore_index
    z = torch.where(valid, z_loss_scale * lse.square(), torch.zeros_like(lse))
    total = ce + z
    if reduction == "none":
        shape = labels.shape
        return LossOutput(total.view(shape), z.view(shape))
    if reduction in ("mean", "sum"):
        if num_items_in_batch is not None:
            d = float(num_items_in_batch)
        elif reduction == "sum":
            d = 1.0
        else:
            d = max(float(valid.sum()), 1.0)
        return LossOutput(total.sum() / d, z.sum() / d)
    if reduction == "sequence":
        per_seq_total, per_seq_z = [], []
        for s in segs:
            idx = torch.tensor(s, device=x.device)
            n = valid[idx].sum()
            if n > 0:
                per_seq_total.append(total[idx].sum() / n)
                per_seq_z.append(z[idx].sum() / n)
        if not per_seq_total:
            zero = total.sum() * 0.0
            return LossOutput(zero, zero)
        return LossOutput(torch.stack(per_seq_total).mean(), torch.stack(per_seq_z).mean())
    raise ValueError(f"unknown reduction {reduction!r}")


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    **kwargs,
) -> LossOutput:
    """``cross_entropy_reference`` of ``hidden @ weight.T + bias``, all in fp32."""
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    return cross_entropy_reference(logits, labels, **kwargs)
