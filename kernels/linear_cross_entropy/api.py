"""The fused head's autograd.Function (one path, eager and compiled), its argument checks, and
the public ``linear_cross_entropy`` and ``linear_cross_entropy_statistics``."""

from __future__ import annotations

import sys

import torch

from ..cross_entropy import (
    batch_rows,
    check_options,
    named_statistics,
    prepare_loss_inputs,
    reduce_losses,
    statistics_mask,
    upstream_coefficients,
)
from ..reference import LossOutput
from .ops import (
    FP32_RANGE,
    chunk_budget,
    join_gradient_stream,
    keeps_q,
    kept_is_q,
    kept_pays,
    kept_slot_free,
    lce_bwd_kept,
    lce_bwd_recompute,
    lce_fwd,
    live_rows,
    scale_by_upstream_,
)
from .products import options_apply

__all__ = [
    "LinearCrossEntropyFunction",
    "UpstreamHint",
    "input_needs",
    "linear_cross_entropy",
    "linear_cross_entropy_statistics",
    "prepare_head_inputs",
]


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The one autograd path of the fused head, for ``linear_cross_entropy`` and
    ``linear_log_probs``. Outputs: the reduced (or per-token) loss and z-loss, then one tensor
    per name of ``STATISTICS`` (empty where not requested; only the entropy has a gradient).
    ``transform``: (logit scale, 1 / temperature). ``hint``: an ``UpstreamHint`` (per-token
    losses only, see ``linear_log_probs``), or None."""

    @staticmethod
    def forward(
        ctx, x, w, bias, targets, weights, softcap, eps, z_scale, chunk_bytes, low_memory, needs,
        skip_ignored, transform=(1.0, 1.0), stats=0, hint=None,
    ):  # fmt: skip
        # `needs` is taken before apply(): inside forward grad mode is off, and needs_input_grad
        # does not see an outer torch.no_grad().
        need_dx, need_dw, need_db = needs
        compiled = torch.compiler.is_compiling()
        # A softcapped head's Q kept from the forward (lce_fwd's keep_products) gives the eager
        # schedule's three products for any upstream gradient, with no guess and no host read:
        # planned (the device's slot free), it is taken instead of speculating. Other heads keep
        # the logits' gradient for a unit coefficient where they do not speculate (no z-loss, no
        # bias, not fp16: lce_fwd). Neither has room for an entropy's gradient: the logits are
        # kept instead where the hint saw the last backward take one, or, without a hint,
        # wherever the entropy is an output.
        keep_products = not hint.entropy_grad if hint is not None else not (stats & 1)  # entropy
        q_planned = (
            weights is None and not low_memory and not compiled and keep_products
            and (need_dx or need_dw) and kept_slot_free(x.device)
            and keeps_q(x, w, bias, softcap, eps, z_scale, transform, need_dw, chunk_bytes)
        )  # fmt: skip
        # Per-token losses whose upstream gradient was uniform last time: the gradients for the
        # hint's guess of it on every token with a target, now (checked in the backward).
        speculate = (
            weights is None and hint is not None and hint.uniform and not q_planned
            and x.dtype in FP32_RANGE  # fp16: as the eager schedule below
        )  # fmt: skip
        guess = hint.guess(targets) if speculate else None
        grad_weights = weights if guess is None else (targets >= 0).to(torch.float32) * guess
        # Not in fp16: there the gradients of a token mean (about p / tokens) made at an upstream
        # gradient of 1 would lose their digits below fp16's least numbers, before a loss scale
        # (fp16 training's) multiplies them; the backward makes them from the upstream gradient.
        eager = (
            grad_weights is not None and not low_memory and (need_dx or need_dw or need_db)
            and x.dtype in FP32_RANGE
        )  # fmt: skip
        # Speculating, the backward's first act is a host read (the hint's check), which waits
        # for what the current stream has queued: the gradient products go to a side stream, so
        # that it waits for the losses alone and the host goes on while they are made.
        ctx.overlap = bool(
            speculate and eager and x.is_cuda and not compiled
            and not torch.cuda.is_current_stream_capturing()
        )  # fmt: skip
        # Without them, the logits (a softcapped head's Q) are kept for the backward where one
        # chunk holds them (three products, not four: lce_fwd's ``keep``); eager only (their
        # shape is the batch's).
        keep = grad_weights is None and not low_memory and not compiled
        ce, zl, lse, dx, dw, db, kept, kept_rows, kept_terms, entropy, *others = lce_fwd(
            x, w, bias, targets, grad_weights if eager else None, softcap, eps, z_scale,
            chunk_bytes, need_dx, need_dw, need_db, skip_ignored, *transform, stats, ctx.overlap,
            keep, keep_products,
        )  # fmt: skip
        # spent by the first backward (a second one recomputes)
        ctx.kept = (kept, kept_rows, kept_terms) if kept.numel() else None
        # The gradients for an upstream gradient of 1 (or the hint's guess), scaled in the
        # backward. Eagerly they sit on ctx and are scaled in place; the backward drops them, so
        # a second backward (retain_graph) recomputes instead of reusing scaled ones. Compiled,
        # that would keep them to the end of the step (the compiler keeps tensors put on ctx
        # until the graph is freed: a second lm_head gradient beside the real one): there they
        # are saved tensors, handed to the backward graph, which frees them once scaled out of
        # place (``scale_by_upstream_``). Compiled graphs have no retain_graph (donated buffers).
        grads = (dx, dw, db) if eager else ()
        ctx.save_for_backward(
            x, w, bias, targets, weights, lse, entropy, *(grads if compiled else ())
        )
        ctx.eager_grads = grads if eager and not compiled else None
        ctx.opts = (softcap, eps, z_scale, chunk_bytes, need_dx, need_dw, need_db, skip_ignored,
                    transform)  # fmt: skip
        # whether lce_fwd took the fused products (their log-sum-exp is the fp32 products'),
        # decided without reading tensor data (traced, x and w are fake); the backward's op
        # checks the tensors themselves. A kept Q came from them.
        ctx.fused_lse = kept_is_q(kept_terms) or (ctx.kept is None and options_apply(
            w.shape[0], bias, softcap, eps, z_scale, *transform, eager
        ))  # fmt: skip
        # nothing to learn from meta tensors (shape tracing: no data to read)
        ctx.hint = hint if weights is None and not compiled and not x.is_meta else None
        ctx.guess = guess
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*others)
        return *reduce_losses(ce, zl, weights), entropy, *others

    @staticmethod
    def backward(ctx, g_loss, g_z, g_entropy, *_):
        x, w, bias, targets, weights, lse, entropy, *saved_grads = ctx.saved_tensors
        softcap, eps, z_scale, chunk_bytes, need_dx, need_dw, need_db, skip_ignored, transform = (
            ctx.opts
        )
        dx = dw = db = None
        eager = tuple(saved_grads) or ctx.eager_grads
        kept, ctx.eager_grads, ctx.kept = ctx.kept, None, None
        if entropy.numel() == 0:
            g_entropy = None
        if ctx.hint is not None:
            ctx.hint.entropy_grad = g_entropy is not None
        # A kept Q or unit gradient serves any upstream gradient but an entropy's: then nothing
        # for the hint to learn (no host read), but where it has not yet seen a backward, whose
        # uniform gradient lets the next forwards speculate (a unit gradient is kept only where
        # they do not).
        serves = kept is not None and kept[2].numel() > 0 and g_entropy is None
        learn = ctx.hint is not None and not (
            serves and (kept_is_q(kept[2]) or ctx.hint.uniform is not None)
        )
        if learn and g_loss is None:
            ctx.hint.uniform = False  # nothing to scale: the next forward computes no gradients
        elif learn:
            # Per-token losses: the eager gradients hold for a uniform upstream gradient only.
            uniform = ctx.hint.learn(g_loss, targets, ctx.guess)
            if uniform is None:
                eager = None  # recomputed below for the upstream gradient as it is
            else:
                g_loss = uniform
        if ctx.overlap:  # after the hint's host read, not before; whether or not they are used
            join_gradient_stream(x.device)
        if eager is not None:
            if g_loss is not None:
                # The stored gradients are for an upstream gradient of 1 (or of the hint's
                # guess): scaled in place, a no-op on the device where the guess was right.
                if ctx.guess is not None:
                    g_loss = g_loss / ctx.guess
                dx, dw, db = (
                    (scale_by_upstream_(t, g_loss) if t.numel() else t) if need else None
                    for t, need in zip(eager, (need_dx, need_dw, need_db), strict=True)
                )  # (a batch of no token: its empty dx as it is)
            # z_loss and the entropy are usually only logged; a gradient reaching either on its
            # own is recomputed (the ce part is already in the eager gradients).
            g_rest = (None, g_z if z_scale > 0.0 else None)
        else:
            g_rest = (g_loss, g_z)
        if g_rest[0] is not None or g_rest[1] is not None or g_entropy is not None:
            a, b = upstream_coefficients(weights, *g_rest, x.shape[0], x.device)
            e = None if g_entropy is None else g_entropy.reshape(-1).float().contiguous()
            if kept is not None and kept[2].numel() and e is not None:
                kept = None  # a kept Q has no room for an entropy's gradient: recomputed
            live = live_rows(targets, a, b, e) if kept is not None and skip_ignored else None
            if kept is not None and not kept_pays(kept[0], live):
                kept = None  # few rows with a gradient: recomputed over them alone
            if kept is not None:
                logits, rows, terms = kept
                rdx, rdw, rdb = lce_bwd_kept(
                    x, w, bias, targets, lse, a, b, logits, rows, softcap, eps, z_scale,
                    need_dx, need_dw, need_db, *transform, None if e is None else entropy, e,
                    terms=terms,
                )  # fmt: skip
            else:
                rdx, rdw, rdb = lce_bwd_recompute(
                    x, w, bias, targets, lse, a, b, softcap, eps, z_scale, chunk_bytes,
                    need_dx, need_dw, need_db, skip_ignored, *transform,
                    None if e is None else entropy, e, fused_lse=ctx.fused_lse, live=live,
                )  # fmt: skip
            dx = _add(dx, rdx if need_dx else None)
            dw = _add(dw, rdw if need_dw else None)
            db = _add(db, rdb if need_db else None)
        return dx, dw, db, *(None,) * 12


class UpstreamHint:
    """Shared by the calls of ``linear_log_probs`` in one training loop: whether the last
    backward's upstream gradient on the per-token losses was the same for every token with a
    target (``uniform``: None before any). When it was, the next forward computes the gradients
    at once, the eager schedule's three matrix products, and its backward scales them; when it
    no longer is, that backward recomputes (four products in all, that once), and the forwards
    after it keep their logits for the backward where one chunk holds them (three again): without
    a z-loss or a bias, not in fp16, their gradient for a unit coefficient per row, which serves
    any upstream gradient on the log-probabilities with no host read, so that ``uniform`` then
    stays False (nothing more is learned: an RL loop's advantages never return to uniform).

    The forward computes them for a guess of the upstream gradient, so that the backward's
    scaling (a pass over the weight gradient, V x D read and written) is skipped on the device
    where the guess holds: ``1 / (tokens with a target)`` where the last one was exactly that (a
    token mean over the batch: TRL's SFT loss without gradient accumulation), else the last value
    (a constant divisor). A guess is only taken between 2**-64 and 1 in magnitude, so that the
    forward's gradients are never larger than the unit ones (no overflow the unit guess would
    not have) and the backward's division by it stays finite. Not in fp16 (no speculation
    there, as no eager schedule: a token mean's small gradients would round to zero before a loss
    scale multiplies them). A wrong guess costs the scaling, as before.

    ``entropy_grad``: whether the last backward took a gradient through the entropy (an RL
    entropy bonus). A softcapped head's forward keeps its fused product's Q for the backward
    (``ops.keeps_q``: three products, no speculation) unless it did: a Q has no room for that
    gradient, which then costs a recompute."""

    def __init__(self) -> None:
        self.uniform: bool | None = None
        self.entropy_grad = False
        self.last: torch.Tensor | None = None  # the last uniform value, 0-dim fp32
        self.token_mean = False  # it was 1 / (tokens with a target) of its batch

    def __repr__(self) -> str:
        return (f"UpstreamHint(uniform={self.uniform}, token_mean={self.token_mean}, "
                f"entropy_grad={self.entropy_grad})")  # fmt: skip

    def guess(self, targets: torch.Tensor) -> torch.Tensor:
        """The 0-dim fp32 upstream gradient the next backward is expected to bring, on the
        targets' device (no host read): 1 where nothing better is known."""
        one = torch.ones((), dtype=torch.float32, device=targets.device)
        if self.token_mean:
            return _reciprocal_count(targets >= 0)
        return one if self.last is None else self.last.to(targets.device)

    def learn(self, g: torch.Tensor, targets: torch.Tensor,
              guess: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
        """Record the upstream gradient ``g`` of this backward; return its 0-dim value where it
        is the same on every token with a target (0 where none has one), else None. ``guess``:
        the one this call's forward took; where the value divided by it is no finite number (a
        tiny guess, a huge gradient), None too: the gradients made for it cannot be scaled, and
        are recomputed. One host read."""
        g = g.reshape(-1).to(torch.float32)
        valid = targets >= 0
        hi = torch.where(valid, g, float("-inf")).amax()
        lo = torch.where(valid, g, float("inf")).amin()
        size = hi.abs()
        scalable = ~valid.any() | (True if guess is None else torch.isfinite(hi / guess))
        checks = [hi == lo, ~valid.any(), hi == _reciprocal_count(valid),
                  (size >= 2.0**-64) & (size <= 1.0), scalable]  # fmt: skip
        same, none, token_mean, in_range, scalable = torch.stack(checks).tolist()  # the host read
        value = g.new_zeros(()) if none else hi if same else None
        self.uniform = value is not None
        usable = same and not none and in_range
        self.last = hi.detach() if usable else None
        self.token_mean = bool(usable and token_mean)
        return value if scalable else None


def _reciprocal_count(valid: torch.Tensor) -> torch.Tensor:
    """1 / (tokens with a target, ``valid``), 0-dim fp32 (1 where none has), as a token mean's
    backward divides: ``1.0 / count`` in fp32."""
    count = valid.sum().clamp(min=1).to(torch.float32)
    return torch.reciprocal(count)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a.add_(b)


def _check_not_sharded(**tensors) -> None:
    for name, t in tensors.items():
        # DeepSpeed ZeRO-3 gives each parameter ds_numel (its full size) and, outside the forward
        # of the module that owns it, leaves an empty placeholder in it. No deepspeed import.
        full = getattr(t, "ds_numel", None)
        if full is not None and t.numel() != full:
            status = getattr(getattr(t, "ds_status", None), "name", None)
            raise ValueError(
                f"linear_cross_entropy got {name} as a DeepSpeed ZeRO-3 parameter that is not "
                f"gathered (shape {tuple(t.shape)}, full shape {tuple(t.ds_shape)}, status "
                f"{status}): outside the forward of the module that owns it, ZeRO-3 leaves only an "
                "empty placeholder. Call it through that module, inside its forward, where ZeRO-3 "
                "has gathered it: a patched model does (lm_head(hidden, labels=...)). For a loss "
                "without gradients, deepspeed.zero.GatheredParameters(weight) gathers it."
            )
    # A DTensor exists only once its module is imported: no import cost for anyone else.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return
    for name, t in tensors.items():
        if isinstance(t, dtensor.DTensor):
            raise TypeError(
                f"linear_cross_entropy got {name} as a DTensor (placements {tuple(t.placements)}),"
                " e.g. a parameter sharded by FSDP2's fully_shard; it needs the whole tensor. Call"
                " it through the module that owns the weight, inside its forward, where FSDP2 has"
                " all-gathered it: a patched model does (lm_head(hidden, labels=...)). Do not pass"
                " weight.full_tensor(): its gradient would skip FSDP's reduction."
            )


def _check_shapes(hidden, weight, bias) -> None:
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, D), got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden of shape {tuple(hidden.shape)} does not match weight of shape "
            f"{tuple(weight.shape)}: the last dimension must be D = {weight.shape[1]}"
        )
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be (N, D) or (B, T, D), got shape {tuple(hidden.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")


def _autocast_inputs(hidden, weight, bias):
    """hidden, weight and bias as ``F.linear`` sees them under the autocast of hidden's device:
    every floating tensor but fp64 in the autocast dtype (differentiable casts: gradients flow
    back to the tensors as given). Unchanged outside autocast."""
    dev = hidden.device.type
    # Not torch.amp.is_autocast_available: dynamo (torch 2.11) cannot trace it. Of the device
    # types a tensor can have, only meta has no autocast state to ask for.
    if dev == "meta" or not torch.is_autocast_enabled(dev):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(dev)

    def cast(t):
        return t if t is None or t.dtype in (dtype, torch.float64) else t.to(dtype)

    return cast(hidden), cast(weight), cast(bias)


def input_needs(x, w, bias) -> tuple[bool, bool, bool]:
    """Whether the hidden states, the weight and the bias need a gradient, taken before
    ``apply()`` (inside the forward grad mode is off, and ``needs_input_grad`` does not see an
    outer ``torch.no_grad()``)."""
    grad_on = torch.is_grad_enabled()
    return (
        grad_on and x.requires_grad,
        grad_on and w.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )


def prepare_head_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checked (whole tensors, matching shapes), cast as autocast casts ``F.linear``'s inputs,
    hidden flattened to (N, D), both with unit stride along D: the inputs of the ops."""
    _check_not_sharded(hidden=hidden, weight=weight, bias=bias)
    _check_shapes(hidden, weight, bias)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(
            f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias "
            f"({None if bias is None else bias.dtype}) must have the same dtype (or run under "
            "torch.autocast)"
        )
    x = hidden.reshape(-1, hidden.shape[-1])
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) != x.shape[1]):
        x = x.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return x, w, bias


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
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
    low_memory: bool = False,
    chunk_bytes: int | None = None,
    skip_ignored: bool = False,
) -> LossOutput:
    """Cross entropy of ``hidden @ weight.T + bias`` against ``labels``, the logits one chunk at a
    time (the package docstring's schedules).

    Args:
        hidden: (N, D) or (B, T, D); fp32, bf16 or fp16.
        weight: (V, D), the lm_head weight, same dtype as ``hidden`` (under autocast any dtypes:
            see below).
        labels: (N,) or (B, T) integer targets; ``ignore_index`` marks tokens without one. A label
            outside [0, V) that is not ``ignore_index`` raises (CPU, or SURGERY_DEBUG=1) or is
            treated as ignored and flagged for ``check_labels()`` (GPU, no host sync).
        bias: optional (V,).
        reduction: "mean" over tokens with a target; "sum"; "none" (per token, shape of labels,
            0 where ignored, exact gradients for any upstream gradient); "sequence": each
            sequence's mean over its tokens with a target, then the mean over sequences with any —
            on a packed batch, exactly the loss of the same sequences unpacked.
        num_items_in_batch: HF gradient-accumulation normaliser ("mean"/"sum"): sum divided by it.
        position_ids: (B, T) or (1, T): a sequence starts where the position does not continue
            (e.g. restarts at 0). cu_seqlens: (S + 1,) cumulative lengths over the flattened
            tokens. Without either, each row of (B, T) labels is one sequence.
        z_loss_scale: s > 0 adds s * logsumexp^2 per token to ``loss``; ``z_loss`` is that term
            alone, same reduction.
        label_smoothing: as ``F.cross_entropy`` defines it.
        softcap: final-logit softcap (Gemma 2/3): cap * tanh(logits / cap).
        shift: next-token targets (label t + 1 of the same row; never across a sequence
            boundary when position_ids / cu_seqlens are given) without copying ``hidden``.
            (B, T, ...) inputs of more than one row need (B, T) labels (flat ones raise).
        low_memory: recompute the logits in the backward one vocabulary slice at a time: no fp32
            weight-gradient accumulator and smaller chunks, at the cost of a fourth product.
        chunk_bytes: logits bytes per chunk (default 1 GiB, 64 MiB with ``low_memory``; chunks
            never go below 1024 tokens or 4096 vocabulary columns).
        skip_ignored: tokens without a target (``ignore_index``, a masked prompt, padding; with
            reduction "none" also those whose upstream gradient is 0) take no part in the matrix
            products, forward or backward (with the logits kept from the forward, the rows of 0
            upstream gradient take part unless they are over a third of them: the others' are
            then recomputed alone): exact (their logit gradients are 0; their losses are 0
            either way), and an SFT batch with half its tokens masked costs about half the
            products. The price is one host read of the count in the forward, and one in the
            backward unless the gradients were made in the forward (the eager schedule), which
            drains the queue of work the GPU is doing; off while a CUDA graph is captured.
            Default off: without it no call reads anything on the host.

    Returns:
        ``LossOutput(loss, z_loss)``, fp32: scalars, or per-token for reduction "none".

    Autocast (the rule every kernel follows: inputs are cast on entry where the unpatched module's
    ops would cast them, and nothing after that depends on autocast): under ``torch.autocast`` on
    hidden's device, hidden, weight and bias are cast to the autocast dtype on entry, as
    ``F.linear`` (transformers' ``lm_head``) casts them, so the logits are the autocast-dtype
    logits of the unpatched head; softcap and loss are computed in fp32 from them, and the
    gradients flow back through the casts to the tensors as given (an fp32 weight gets an fp32
    gradient, as through ``F.linear``). The matrix products run with autocast disabled, forward
    and backward: the result is bit for bit that of the same call without autocast on the cast
    inputs.
    """
    loss, _ = linear_cross_entropy_statistics(
        hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
        num_items_in_batch=num_items_in_batch, position_ids=position_ids, cu_seqlens=cu_seqlens,
        z_loss_scale=z_loss_scale, label_smoothing=label_smoothing, softcap=softcap, shift=shift,
        low_memory=low_memory, chunk_bytes=chunk_bytes, skip_ignored=skip_ignored,
    )  # fmt: skip
    return loss


def linear_cross_entropy_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
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
    low_memory: bool = False,
    chunk_bytes: int | None = None,
    skip_ignored: bool = False,
) -> tuple[LossOutput, dict[str, torch.Tensor]]:
    """``linear_cross_entropy``'s loss (every argument as it takes them) and, from the same
    sweep over the logits, per-token ``statistics`` of ``softmax(logits)`` for logging: names
    among ``STATISTICS`` (``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``,
    ``predicted``: the first maximum's column, as argmax takes it), shaped like ``labels``, fp32
    (``is_top1`` bool, ``predicted`` int64), 0 (-1 for ``predicted``) where a token has no
    target, detached.
    Each costs a few operations per logit, none when not asked; the loss and its gradients are
    those of ``linear_cross_entropy`` exactly (the same autograd path).
    """
    stats = statistics_mask(statistics)
    x, w, bias = prepare_head_inputs(hidden, weight, bias)
    check_options(reduction, label_smoothing, z_loss_scale, softcap)
    targets, weights = prepare_loss_inputs(
        labels,
        x.shape[0],
        w.shape[0],
        x.device,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        shift=shift,
        rows=batch_rows(hidden),
    )
    needs = input_needs(x, w, bias)
    loss, z, *values = LinearCrossEntropyFunction.apply(
        x, w, bias, targets, weights, float(softcap or 0.0), float(label_smoothing),
        float(z_loss_scale), chunk_budget(chunk_bytes, low_memory), bool(low_memory), needs,
        bool(skip_ignored), (1.0, 1.0), stats,
    )  # fmt: skip
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return LossOutput(loss, z), named_statistics(values, statistics, labels.shape)
