"""Plain-PyTorch fp32 references for the loss kernels.

Written for clarity, not speed: full logits in fp32, per-token losses from ``F.cross_entropy``, and
sequence boundaries found with an explicit Python loop. Independent of ``reduction.py`` on purpose,
so that tests compare two different derivations of the same definition.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "LossOutput",
    "TokenLogProbs",
    "cross_entropy_reference",
    "linear_cross_entropy_reference",
    "linear_log_probs_reference",
]


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


class TokenLogProbs(NamedTuple):
    """Per-token outputs of ``linear_log_probs``, each shaped like the labels and 0 (False, -1 for
    ``predicted``) where a token has no target; a statistic not requested is None.

    ``log_probs``: log p(target) (differentiable). ``entropy``: -sum_v p_v log p_v
    (differentiable). ``log_sum_sq_probs``: log sum_v p_v^2. ``mean_logits``: the mean over the
    vocabulary of the logits the distribution is the softmax of (scaled, capped, divided by the
    temperature). ``is_top1``: the target is the first maximum of those logits, as argmax picks
    it. ``predicted``: that first maximum's column (int64), the token the model predicts. The last
    four have no gradient."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    predicted: torch.Tensor | None = None


def linear_log_probs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    shift: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TokenLogProbs:
    """Every ``TokenLogProbs`` field from the full logits in ``dtype`` (fp32 or fp64):
    ``log_softmax`` of ``cap * tanh(logit_scale * logits / cap) / temperature``. ``shift``: the
    target of token t is label t + 1 of its row (none for a row's last token)."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    x = logits * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    x = x / temperature
    lab = labels if labels.dim() == 2 else labels.view(1, -1)
    if shift:
        lab = torch.cat([lab[:, 1:], torch.full_like(lab[:, :1], ignore_index)], dim=1)
    tgt = lab.reshape(-1)
    x = x.reshape(tgt.numel(), -1)
    valid = tgt != ignore_index
    logp = torch.log_softmax(x, dim=-1)
    picked = logp.gather(1, torch.where(valid, tgt, 0)[:, None])[:, 0]
    zero = torch.zeros((), dtype=dtype, device=x.device)

    def masked(t: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, t, zero).view(labels.shape)

    return TokenLogProbs(
        log_probs=masked(picked),
        entropy=masked(-(logp.exp() * logp).sum(-1)),
        log_sum_sq_probs=masked(torch.logsumexp(2.0 * logp, dim=-1)),
        mean_logits=masked(x.mean(-1)),
        is_top1=(valid & (x.argmax(-1) == tgt)).view(labels.shape),
        predicted=torch.where(valid, x.argmax(-1), -1).view(labels.shape),
    )
