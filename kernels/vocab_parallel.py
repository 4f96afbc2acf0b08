"""Vocabulary-parallel fused linear cross entropy: the loss of a head whose rows are sharded over
the ranks of a process group (tensor parallelism), without any rank holding the full logits or
gathering the head.

Each rank holds rows ``[start, start + V_r)`` of the ``V`` rows of the head (and of its bias) and
the hidden states of every token (replicated, as a column-parallel head's input is) or, with
``sequence_parallel``, of its own part of the sequence (all-gathered here first, and the hidden
gradient reduce-scattered back). Forward, in token chunks as ``linear_cross_entropy``'s kernels run
them, each rank computes its slice's logsumexp, the target logit where the target is one of its
rows, and (label smoothing) the sum of its slice's logits; two all-reduces of those per-token
scalars (a max, then one sum of three rows) give every rank the whole vocabulary's logsumexp,
target logit and sum, and so the same per-token losses, reduced as on one GPU. Backward: each rank
recomputes its slice's logits a vocabulary slice at a time from the global logsumexp
(``lce_bwd_recompute``), which gives its rows' weight and bias gradients whole and its part of the
hidden gradient, summed over the ranks by one all-reduce (or reduce-scatter). Four matrix products,
as the recompute schedule on one GPU.

Every reduction, ``num_items_in_batch``, z-loss, label smoothing, softcap, ``ignore_index``,
``shift`` and the sequence boundaries behave as in ``linear_cross_entropy``: the per-token losses
are the one-GPU ones, reduced by the same code. Eager only (the collectives are not traced by
``torch.compile``).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from .cross_entropy import (
    STATISTICS,
    check_options,
    prepare_loss_inputs,
    reduce_losses,
    upstream_coefficients,
)
from .linear_cross_entropy import (
    DEFAULT_CHUNK_BYTES,
    input_needs,
    lce_bwd_recompute,
    lce_fwd,
    prepare_head_inputs,
)
from .reference import LossOutput

__all__ = ["vocab_parallel_linear_cross_entropy", "vocab_shard"]

_MEAN_LOGITS = 1 << STATISTICS.index("mean_logits")


def vocab_shard(weight: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(start, total)``: the first row of the whole head that this rank's ``weight`` holds, and
    the whole head's rows, when each rank of ``group`` holds a contiguous slice of rows in rank
    order (transformers' column-wise and DTensor's ``Shard(0)`` head). One all-gather of the
    ranks' row counts and a host read: pass ``vocab_start`` where the layout is known."""
    world = dist.get_world_size(group)
    counts = torch.empty(world, dtype=torch.int64, device=weight.device)
    mine = torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device)
    dist.all_gather_into_tensor(counts, mine, group=group)
    counts = counts.tolist()
    rank = dist.get_rank(group)
    return sum(counts[:rank]), sum(counts)


def _local_head(weight, bias, group, vocab_start, vocab_size):
    """A DTensor head (``Shard(0)`` on one mesh dimension, replicated on the others) as its local
    rows, with its group, start and size; anything else as given."""
    # A DTensor exists only once its module is imported: no import cost for anyone else.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(weight, dtensor.DTensor):
        return weight, bias, group, vocab_start, vocab_size
    mesh, placements = weight.device_mesh, weight.placements
    sharded = [i for i, p in enumerate(placements) if isinstance(p, dtensor.Shard)]
    if (
        len(sharded) != 1
        or placements[sharded[0]].dim != 0
        or any(not isinstance(p, dtensor.Replicate) for i, p in enumerate(placements)
               if i != sharded[0])
    ):  # fmt: skip
        raise ValueError(
            "vocab_parallel_linear_cross_entropy needs the head's rows sharded on one mesh "
            f"dimension (Shard(0)) and replicated on the others, got placements {placements}"
        )
    dim = sharded[0]
    total = weight.shape[0]
    chunk = math.ceil(total / mesh.size(dim))  # DTensor shards as torch.chunk does
    start = min(mesh.get_local_rank(dim) * chunk, total)
    if bias is not None and isinstance(bias, dtensor.DTensor):
        bias = bias.to_local()
    return weight.to_local(), bias, mesh.get_group(dim), start, total


class _GatherSequence(torch.autograd.Function):
    """All-gather of the ranks' parts of the sequence along ``dim`` (rank order); backward, each
    rank's part of the summed gradient (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim = ctx.group, ctx.dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [p.contiguous() for p in grad.chunk(world, dim)]
        mine = torch.empty_like(parts[rank])
        dist.reduce_scatter(mine, parts, group=group)
        return mine, None, None


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _slice_statistics(x, w, bias, targets, start, softcap, eps, chunk_bytes):
    """This rank's per-token logsumexp, target logit (0 where the target is another rank's) and,
    with label smoothing, sum of logits, over its rows ``[start, start + V_r)``."""
    n, v = x.shape[0], w.shape[0]
    if v == 0:  # more ranks than rows: this rank holds none
        return x.new_full((n,), float("-inf"), dtype=torch.float32), *(
            x.new_zeros(n, dtype=torch.float32) for _ in range(2)
        )
    mine = (targets >= start) & (targets < start + v)
    # A token whose target is another rank's reads this slice's first column as a stand-in (the
    # kernel then computes its logsumexp and sum too); tokens without a target keep -1.
    local = torch.where(mine, targets - start, torch.where(targets >= 0, 0, -1))
    ce, _, lse, _, _, _, _, _, mean, _ = lce_fwd(
        x, w, bias, local.contiguous(), None, softcap, 0.0, 0.0, chunk_bytes, False, False, False,
        False, 1.0, 1.0, _MEAN_LOGITS if eps else 0,
    )  # fmt: skip
    target_logit = torch.where(mine, lse - ce, 0.0)
    total = mean * v if eps else torch.zeros_like(lse)
    return lse, target_logit, total


class VocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """The autograd path of the vocabulary-parallel head (module docstring). ``reduce_dx``: the
    hidden gradient is all-reduced here (replicated hidden states); False where the caller's
    gather reduce-scatters it (sequence parallel)."""

    @staticmethod
    def forward(ctx, x, w, bias, targets, weights, group, start, vocab, softcap, eps, z_scale,
                chunk_bytes, needs, reduce_dx):  # fmt: skip
        lse_r, target_logit, total = _slice_statistics(
            x, w, bias, targets, start, softcap, eps, chunk_bytes
        )
        peak = lse_r.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([torch.exp(lse_r - peak), target_logit, total])
        dist.all_reduce(sums, group=group)
        lse = peak + torch.log(sums[0])
        valid = targets >= 0
        ce = lse - (1.0 - eps) * sums[1]
        if eps:
            ce = ce - (eps / vocab) * sums[2]
        ce = torch.where(valid, ce, 0.0)
        zl = torch.where(valid, z_scale * lse * lse, 0.0)
        ctx.save_for_backward(x, w, bias, targets, weights, lse)
        ctx.opts = (group, start, vocab, softcap, eps, z_scale, chunk_bytes, needs, reduce_dx)
        ctx.set_materialize_grads(False)
        return reduce_losses(ce, zl, weights)

    @staticmethod
    def backward(ctx, g_loss, g_z):
        x, w, bias, targets, weights, lse = ctx.saved_tensors
        group, start, vocab, softcap, eps, z_scale, chunk_bytes, needs, reduce_dx = ctx.opts
        need_dx, need_dw, need_db = needs
        none = (None,) * 11
        if g_loss is None and g_z is None:
            return None, None, None, *none
        a, b = upstream_coefficients(weights, g_loss, g_z, x.shape[0], x.device)
        dx, dw, db = lce_bwd_recompute(
            x, w, bias, targets, lse, a, b, softcap, eps, z_scale, chunk_bytes, need_dx, need_dw,
            need_db, False, 1.0, 1.0, None, None, start, vocab,
        )  # fmt: skip
        if need_dx and reduce_dx:
            dist.all_reduce(dx, group=group)
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                *none)  # fmt: skip


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    chunk_bytes: int | None = None,
) -> LossOutput:
    """``linear_cross_entropy`` of a head whose rows are sharded over ``group`` (module
    docstring); every rank of ``group`` calls it, and every rank gets the same loss.

    Args:
        hidden: (N, D) or (B, T, D), the same on every rank; with ``sequence_parallel``, this
            rank's part of the sequence (the ranks' parts in rank order, along T for (B, T, D),
            along N for (N, D)), and ``labels`` and ``position_ids`` its part too.
        weight: this rank's rows of the (V, D) head: rows ``[vocab_start, vocab_start + V_r)``.
            A DTensor sharded on its rows (``Shard(0)`` on one mesh dimension, ``Replicate`` on
            the others: ``parallelize_module``'s ``ColwiseParallel``) gives its own group, start
            and size; its gradient is the DTensor's.
        bias: this rank's rows of the (V,) bias, or None.
        group: the ranks the head is sharded over (default: the world).
        vocab_start, vocab_size: the first row this rank holds and the whole head's rows. Without
            them, one all-gather of the ranks' row counts finds them (rank order, contiguous).
        sequence_parallel: see ``hidden``; the hidden gradient is reduce-scattered back.
        Everything else: as ``linear_cross_entropy`` (labels index the whole vocabulary; a label
        outside [0, V) that is not ``ignore_index`` raises on CPU tensors).

    Returns:
        ``LossOutput(loss, z_loss)``, fp32, the same on every rank: scalars, or per token for
        reduction "none" (the gathered sequence's tokens with ``sequence_parallel``).
    """
    weight, bias, group, vocab_start, vocab_size = _local_head(
        weight, bias, group, vocab_start, vocab_size
    )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "vocab_parallel_linear_cross_entropy needs torch.distributed initialised (every rank "
            "of the head's group calls it)"
        )
    world = dist.get_world_size(group)
    if sequence_parallel and world > 1:
        dim = hidden.dim() - 2
        hidden = _GatherSequence.apply(hidden, group, dim)
        labels = _gather(labels, group, labels.dim() - 1)
        if position_ids is not None:
            position_ids = _gather(position_ids, group, position_ids.dim() - 1)
    x, w, bias = prepare_head_inputs(hidden, weight, bias)
    check_options(reduction, label_smoothing, z_loss_scale, softcap)
    if vocab_start is None or vocab_size is None:
        start, total = vocab_shard(w, group)
        vocab_start = start if vocab_start is None else vocab_start
        vocab_size = total if vocab_size is None else vocab_size
    if not 0 <= vocab_start <= vocab_size - w.shape[0]:
        raise ValueError(
            f"this rank's {w.shape[0]} head rows from row {vocab_start} do not fit a head of "
            f"{vocab_size} rows"
        )
    targets, weights = prepare_loss_inputs(
        labels,
        x.shape[0],
        vocab_size,
        x.device,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
    )
    loss, z = VocabParallelLinearCrossEntropyFunction.apply(
        x, w, bias, targets, weights, group, int(vocab_start), int(vocab_size),
        float(softcap or 0.0), float(label_smoothing), float(z_loss_scale),
        int(DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes),
        input_needs(x, w, bias), not (sequence_parallel and world > 1),
    )  # fmt: skip
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return LossOutput(loss, z)
