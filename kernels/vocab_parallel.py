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
turns its slice's logits into their gradient from the global logsumexp, which gives its rows'
weight and bias gradients whole and its part of the hidden gradient, summed over the ranks by one
all-reduce (or reduce-scatter). As on one GPU, a rank keeps its slice's logits from the forward to
the backward where the eager schedule's plan takes them in one chunk and no other call's kept
logits wait (``lce_fwd``'s ``keep``: three matrix products, ``lce_bwd_kept``); otherwise, and
with ``low_memory``, it recomputes them a vocabulary slice at a time (``lce_bwd_recompute``:
four). Every rank plans with the whole vocabulary, so that the ranks of one call make the same
plan (a slice's own would differ between uneven shards); a rank whose device still holds another
call's kept logits declines alone, and its first maximum for ``is_top1`` is then taken as the
recompute schedule takes it, beside the others' kept ones (a difference at a tie only).

Every reduction, ``num_items_in_batch``, z-loss, label smoothing, softcap, ``ignore_index``,
``shift`` and the sequence boundaries behave as in ``linear_cross_entropy``: the per-token losses
are the one-GPU ones, reduced by the same code. Eager only (the collectives are not traced by
``torch.compile``).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from .cross_entropy import (
    STATISTIC_FILL,
    STATISTICS,
    batch_rows,
    check_options,
    prepare_loss_inputs,
    reduce_losses,
    upstream_coefficients,
)
from .cross_entropy.launch import _transformed_torch
from .linear_cross_entropy import (
    chunk_budget,
    input_needs,
    lce_bwd_kept,
    lce_bwd_recompute,
    lce_fwd,
    prepare_head_inputs,
)
from .linear_cross_entropy.ops import _logits, plan_token_chunk
from .linear_cross_entropy.products import options_apply, target_logits, tensors_apply
from .log_probs import check_log_probs_options, token_log_probs
from .reference import LossOutput, TokenLogProbs

__all__ = [
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_log_probs",
    "vocab_shard",
]


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


class _Layout(NamedTuple):
    """Where this rank's rows sit: its ``group``, its first row ``start`` of a head of ``vocab``
    rows; ``reduce_dx``: the hidden gradient is all-reduced here (replicated hidden states), not
    by the caller's gather (sequence parallel)."""

    group: dist.ProcessGroup | None
    start: int
    vocab: int
    reduce_dx: bool


def _row_max(x, w, bias, softcap, transform, chunk_bytes) -> torch.Tensor:
    """Each token's largest transformed logit over this rank's rows (an extra product, for
    ``is_top1`` and ``predicted`` only)."""
    n, v = x.shape[0], w.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    rows = max(1, chunk_bytes // max(1, 4 * v))
    for n0 in range(0, n, rows):
        logits = _logits(x[n0 : n0 + rows], w, bias).float()
        out[n0 : n0 + rows] = _transformed_torch(logits, softcap, *transform).amax(-1)
    return out


def _slice_statistics(
    x, w, bias, targets, start, softcap, eps, transform, chunk_bytes, want, needs, keep
):  # fmt: skip
    """This rank's per-token statistics over its rows ``[start, start + V_r)``: ``lse``, ``ce``
    = lse - x_t where the target is this rank's (``mine``; else 0: the kernel's own, relative to
    the slice's maximum, so that a confident token's keeps its digits) and those in ``want``
    (``total``: sum of logits; ``entropy``, ``log_sum_sq_probs``: of the slice's own softmax;
    ``is_top1``: the target is the slice's first maximum; ``predicted``: the slice's first
    maximum, as a column of the whole vocabulary; ``max``: the slice's largest logit); ``kept``:
    the slice's logits kept for the backward (where ``keep`` asks for them and ``lce_fwd`` takes
    them; else empty; ``needs``: the gradients that backward makes); ``fused``: a bool, whether
    the slice's products were the fused ones (``lce_bwd_recompute``'s ``fused_lse``): not with
    label smoothing ``eps``, as on one GPU (their gradient has no smoothing term, and the
    backward's recomputed logits must be those of the log-sum-exp)."""
    n, v = x.shape[0], w.shape[0]
    zeros = functools.partial(torch.zeros, n, dtype=torch.float32, device=x.device)
    if v == 0:  # more ranks than rows: this rank holds none
        out = {k: zeros() for k in ("ce", "total", "entropy", "log_sum_sq_probs")}
        out["mine"] = zeros(dtype=torch.bool)
        out["is_top1"] = zeros(dtype=torch.bool)
        out["predicted"] = zeros(dtype=torch.int64)
        out["kept"] = x.new_empty(0)
        return {**out, "lse": zeros() - math.inf, "max": zeros() - math.inf, "fused": False}
    mine = (targets >= start) & (targets < start + v)
    # A token whose target is another rank's reads this slice's first column as a stand-in (the
    # kernel then computes its statistics too); tokens without a target keep -1.
    local = torch.where(mine, targets - start, torch.where(targets >= 0, 0, -1))
    names = {"total": "mean_logits", "entropy": "entropy", "log_sum_sq_probs": "log_sum_sq_probs",
             "is_top1": "is_top1", "predicted": "predicted"}  # fmt: skip
    stats = sum(1 << STATISTICS.index(names[k]) for k in want if k in names)
    if "max" in want:  # the slice's maximum at its first maximum's column, below
        stats |= 1 << STATISTICS.index("predicted")
    # with no weights lce_fwd makes no gradient; its own plan, of this slice, holds wherever the
    # caller's of the whole vocabulary does; the slice's loss is its cross entropy alone (the
    # smoothing's and the z-loss's terms are the whole vocabulary's, added by the caller), the
    # products those the whole loss's options allow
    fuse = options_apply(v, bias, softcap, eps, 0.0, *transform, False)
    ce, _, lse, _, _, _, kept, _, _, *statistics = lce_fwd(
        x, w, bias, local.contiguous(), None, softcap, 0.0, 0.0, chunk_bytes, *needs, False,
        *transform, stats, False, keep, False, fuse,
    )  # fmt: skip
    # whether lce_fwd took the fused products (for the backward: lce_bwd_recompute's fused_lse)
    fused = fuse and not kept.numel()
    by_name = dict(zip(STATISTICS, statistics, strict=True))
    out = {"lse": lse, "ce": torch.where(mine, ce, 0.0), "mine": mine, "fused": fused, "kept": kept}
    for key in want:
        if key == "total":
            out[key] = by_name["mean_logits"] * v
        elif key == "max" and kept.numel():  # the kept logit at the first maximum's column
            first = by_name["predicted"].clamp(min=0)[:, None]
            out[key] = _transformed_torch(kept.gather(1, first).float(), softcap, *transform)[:, 0]
        elif key == "max" and fused and tensors_apply(x, w):
            # The logit at the slice's first maximum, from its own fp32 dot product on every
            # rank alike: the ranks' maxima compare as the fused products' logits do (fp32), not
            # as an unfused product's bf16 ones would.
            out[key] = target_logits(x, w, by_name["predicted"], softcap, transform)[0]
        elif key == "max":
            out[key] = _row_max(x, w, bias, softcap, transform, chunk_bytes)
        elif key == "is_top1":
            out[key] = by_name["is_top1"] & mine
        elif key == "predicted":
            out[key] = by_name["predicted"] + start
        else:
            out[key] = by_name[key]
    return out


def _whole_vocabulary(part: dict, layout: _Layout, want) -> dict:
    """The whole vocabulary's statistics from every rank's ``part`` (``_slice_statistics``), the
    same on every rank: a max and a sum all-reduce of per-token scalars (two more for ``is_top1``
    and ``predicted``, together). With ``e_r = exp(lse_r - peak)`` and ``S = sum_r e_r``:
    ``lse = peak + log S``; the cross entropy lse - x_t is ``log S + (ce_r + peak - lse_r)`` from
    the target's rank r (exactly its own where it holds the peak: no difference of two numbers of
    the logits' size); the entropy is ``sum_r w_r (h_r + lse - lse_r)`` with
    ``w_r = e_r / S``, summed without cancellation as ``(sum_r e_r h_r + sum_r e_r (peak - lse_r))
    / S + log S``; ``log sum_j p_j^2 = log sum_r e_r^2 exp(q_r) - 2 log S``."""
    group = layout.group
    peaks = torch.stack([part["lse"], part.get("max", part["lse"])])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    peak = peaks[0]
    e = torch.exp(part["lse"] - peak)
    rows = {"s": e, "ce": torch.where(part["mine"], part["ce"] + (peak - part["lse"]), 0.0)}
    if "total" in want:
        rows["total"] = part["total"]
    if "entropy" in want:  # a rank without rows: lse -inf, e = 0 (and no inf - inf)
        rows["entropy"] = torch.where(e > 0, e * (part["entropy"] + peak - part["lse"]), 0.0)
    if "log_sum_sq_probs" in want:
        rows["sum_sq"] = e * e * torch.exp(part["log_sum_sq_probs"])
    sums = torch.stack(list(rows.values()))
    dist.all_reduce(sums, group=group)
    total = dict(zip(rows, sums, strict=True))
    log_s = torch.log(total["s"])
    out = {"lse": peak + log_s, "ce": log_s + total["ce"], "total": total.get("total")}
    if "entropy" in want:
        out["entropy"] = total["entropy"] / total["s"] + log_s
    if "log_sum_sq_probs" in want:
        out["log_sum_sq_probs"] = torch.log(total["sum_sq"]) - 2.0 * log_s
    if "is_top1" in want or "predicted" in want:
        # The first maximum lies in the first rank holding the largest logit, at that rank's
        # first maximum: the target is it when it is the target there.
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        holds = part["max"] == peaks[1]
        first = torch.where(holds, rank, world).to(torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        chosen = holds & (first == rank)
        found = {}
        if "is_top1" in want:
            found["is_top1"] = (part["is_top1"] & chosen).to(torch.int64)
        if "predicted" in want:
            found["predicted"] = torch.where(chosen, part["predicted"], 0)
        summed = torch.stack(list(found.values()))  # one rank gives each token's, the rest 0
        dist.all_reduce(summed, group=group)
        found = dict(zip(found, summed, strict=True))
        if "is_top1" in found:
            out["is_top1"] = found["is_top1"] > 0
        if "predicted" in found:
            out["predicted"] = found["predicted"]
    return out


class VocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """The one autograd path of the vocabulary-parallel head (module docstring), for
    ``vocab_parallel_linear_cross_entropy`` and ``vocab_parallel_linear_log_probs``. Outputs: the
    reduced (or per-token) loss and z-loss, then one tensor per name of ``STATISTICS`` (empty
    where not requested; only the entropy has a gradient). ``transform``: (logit scale,
    1 / temperature)."""

    @staticmethod
    def forward(ctx, x, w, bias, targets, weights, layout, softcap, eps, z_scale, chunk_bytes,
                needs, transform=(1.0, 1.0), stats=0, low_memory=False):  # fmt: skip
        requested = [name for i, name in enumerate(STATISTICS) if stats >> i & 1]
        want = {"entropy", "log_sum_sq_probs", "is_top1", "predicted"} & set(requested)
        if eps or "mean_logits" in requested:
            want.add("total")
        if "is_top1" in want or "predicted" in want:
            want.add("max")
        # Keep the slice's logits where the whole vocabulary's plan takes one chunk: the same
        # plan on every rank (a slice's own would differ between uneven shards). Eager only:
        # traced, lce_fwd's fake declines.
        keep = (
            any(needs) and not low_memory and not torch.compiler.is_compiling()
            and x.shape[0] > 0 and plan_token_chunk(
                x.shape[0], layout.vocab, x.shape[1], x.element_size(),
                needs[1] and w.dtype != torch.float32, chunk_bytes,
            ) >= x.shape[0]
        )  # fmt: skip
        part = _slice_statistics(x, w, bias, targets, layout.start, softcap, eps, transform,
                                 chunk_bytes, want, needs, keep)  # fmt: skip
        fused, kept = part.pop("fused"), part.pop("kept")
        whole = _whole_vocabulary(part, layout, want)
        lse, valid = whole["lse"], targets >= 0
        ce = whole["ce"]
        if eps:  # (1 - eps) (lse - x_t) + eps (lse - the mean logit)
            ce = (1.0 - eps) * ce + eps * (lse - whole["total"] / layout.vocab)
        ce = torch.where(valid, ce, 0.0)
        zl = torch.where(valid, z_scale * lse * lse, 0.0)
        if "mean_logits" in requested:
            whole["mean_logits"] = whole["total"] / layout.vocab
        statistics = [
            torch.where(valid, whole[name], STATISTIC_FILL.get(name, 0.0))
            if name in requested
            else x.new_empty(0)
            for name in STATISTICS
        ]
        entropy, *others = statistics
        ctx.save_for_backward(x, w, bias, targets, weights, lse, entropy)
        ctx.opts = (layout, softcap, eps, z_scale, chunk_bytes, needs, transform, fused)
        ctx.kept = kept if kept.numel() else None  # spent by the first backward
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*others)
        return *reduce_losses(ce, zl, weights), entropy, *others

    @staticmethod
    def backward(ctx, g_loss, g_z, g_entropy, *_):
        x, w, bias, targets, weights, lse, entropy = ctx.saved_tensors
        layout, softcap, eps, z_scale, chunk_bytes, needs, transform, fused = ctx.opts
        need_dx, need_dw, need_db = needs
        kept, ctx.kept = ctx.kept, None
        none = (None,) * 11
        if entropy.numel() == 0:
            g_entropy = None
        if g_loss is None and g_z is None and g_entropy is None:
            return None, None, None, *none
        a, b = upstream_coefficients(weights, g_loss, g_z, x.shape[0], x.device)
        e = None if g_entropy is None else g_entropy.reshape(-1).float().contiguous()
        if kept is not None:
            dx, dw, db = lce_bwd_kept(
                x, w, bias, targets, lse, a, b, kept, targets.new_empty(0), softcap, eps,
                z_scale, need_dx, need_dw, need_db, *transform, None if e is None else entropy,
                e, layout.start, layout.vocab,
            )  # fmt: skip
        else:
            dx, dw, db = lce_bwd_recompute(
                x, w, bias, targets, lse, a, b, softcap, eps, z_scale, chunk_bytes, need_dx,
                need_dw, need_db, False, *transform, None if e is None else entropy, e,
                layout.start, layout.vocab, fused,
            )  # fmt: skip
        if need_dx and layout.reduce_dx:
            dist.all_reduce(dx, group=layout.group)
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                *none)  # fmt: skip


def _sharded_inputs(hidden, weight, labels, bias, group, vocab_start, vocab_size,
                    sequence_parallel, position_ids):  # fmt: skip
    """The ops' inputs (``prepare_head_inputs``), the labels and position ids of the whole
    sequence, and the ``_Layout``; a DTensor head made local, sequence-parallel inputs
    gathered."""
    weight, bias, group, vocab_start, vocab_size = _local_head(
        weight, bias, group, vocab_start, vocab_size
    )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "the vocabulary-parallel head needs torch.distributed initialised (every rank of the "
            "head's group calls it)"
        )
    gather = sequence_parallel and dist.get_world_size(group) > 1
    if gather:
        hidden = _GatherSequence.apply(hidden, group, hidden.dim() - 2)
        labels = _gather(labels, group, labels.dim() - 1)
        if position_ids is not None:
            position_ids = _gather(position_ids, group, position_ids.dim() - 1)
    x, w, bias = prepare_head_inputs(hidden, weight, bias)
    if vocab_start is None or vocab_size is None:
        start, total = vocab_shard(w, group)
        vocab_start = start if vocab_start is None else vocab_start
        vocab_size = total if vocab_size is None else vocab_size
    if not 0 <= vocab_start <= vocab_size - w.shape[0]:
        raise ValueError(
            f"this rank's {w.shape[0]} head rows from row {vocab_start} do not fit a head of "
            f"{vocab_size} rows"
        )
    layout = _Layout(group, int(vocab_start), int(vocab_size), not gather)
    return x, w, bias, labels, position_ids, layout


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
    low_memory: bool = False,
) -> LossOutput:
    """``linear_cross_entropy`` of a head whose rows are sharded over ``group`` (module
    docstring); every rank of ``group`` calls it, and every rank gets the same loss.

    Args:
        hidden: (N, D) or (B, T, D), the same on every rank; with ``sequence_parallel``, this
            rank's part of the sequence (the ranks' parts in rank order and of one size, as the
            all-gather takes them, along T for (B, T, D), along N for (N, D)), and ``labels`` and
            ``position_ids`` its part too; ``cu_seqlens``, which has no parts, the whole
            sequence's.
        weight: this rank's rows of the (V, D) head: rows ``[vocab_start, vocab_start + V_r)``.
            A DTensor sharded on its rows (``Shard(0)`` on one mesh dimension, ``Replicate`` on
            the others: ``parallelize_module``'s ``ColwiseParallel``) gives its own group, start
            and size; its gradient is the DTensor's.
        bias: this rank's rows of the (V,) bias, or None.
        group: the ranks the head is sharded over (default: the world).
        vocab_start, vocab_size: the first row this rank holds and the whole head's rows. Without
            them, one all-gather of the ranks' row counts finds them (rank order, contiguous).
        sequence_parallel: see ``hidden``; the hidden gradient is reduce-scattered back.
        low_memory: recompute each rank's logits in the backward (four products, in slices of
            ``LOW_MEMORY_CHUNK_BYTES`` unless ``chunk_bytes`` is given) rather than keep them from
            the forward where one chunk holds them (three).
        Everything else: as ``linear_cross_entropy`` (labels index the whole vocabulary; a label
        outside [0, V) that is not ``ignore_index`` raises on CPU tensors).

    Returns:
        ``LossOutput(loss, z_loss)``, fp32, the same on every rank: scalars, or per token for
        reduction "none" (the gathered sequence's tokens with ``sequence_parallel``).
    """
    x, w, bias, labels, position_ids, layout = _sharded_inputs(
        hidden, weight, labels, bias, group, vocab_start, vocab_size, sequence_parallel,
        position_ids,
    )  # fmt: skip
    check_options(reduction, label_smoothing, z_loss_scale, softcap)
    targets, weights = prepare_loss_inputs(
        labels,
        x.shape[0],
        layout.vocab,
        x.device,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
        rows=batch_rows(hidden),  # the sequence's gather leaves the rows as they are
    )
    loss, z, *_ = VocabParallelLinearCrossEntropyFunction.apply(
        x, w, bias, targets, weights, layout, float(softcap or 0.0), float(label_smoothing),
        float(z_loss_scale), chunk_budget(chunk_bytes, low_memory), input_needs(x, w, bias),
        (1.0, 1.0), 0, bool(low_memory),
    )  # fmt: skip
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return LossOutput(loss, z)


def vocab_parallel_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
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
) -> TokenLogProbs:
    """``linear_log_probs`` of a head whose rows are sharded over ``group``: the same
    ``TokenLogProbs`` on every rank (the log-probabilities and the entropy take any upstream
    gradient). The sharding arguments and ``low_memory`` as ``vocab_parallel_linear_cross_entropy``
    takes them; the rest as ``linear_log_probs``. ``is_top1`` and ``predicted`` cost two more
    all-reduces (and, where a rank neither keeps its logits nor takes the fused products, one
    more matrix product on it)."""
    stats = check_log_probs_options(outputs, temperature, softcap)
    x, w, bias, labels, position_ids, layout = _sharded_inputs(
        hidden, weight, labels, bias, group, vocab_start, vocab_size, sequence_parallel,
        position_ids,
    )  # fmt: skip
    targets, _ = prepare_loss_inputs(
        labels,
        x.shape[0],
        layout.vocab,
        x.device,
        ignore_index=ignore_index,
        reduction="none",
        num_items_in_batch=None,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
        rows=batch_rows(hidden),  # the sequence's gather leaves the rows as they are
    )
    ce, _, *statistics = VocabParallelLinearCrossEntropyFunction.apply(
        x, w, bias, targets, None, layout, float(softcap or 0.0), 0.0, 0.0,
        chunk_budget(chunk_bytes, low_memory), input_needs(x, w, bias),
        (float(logit_scale), 1.0 / float(temperature)), stats,
        bool(low_memory),
    )  # fmt: skip
    return token_log_probs(ce, statistics, outputs, labels.shape)
