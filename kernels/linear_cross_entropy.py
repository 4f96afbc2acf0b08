"""Fused linear cross entropy: the loss of ``hidden @ weight.T (+ bias)`` without ever holding the
full (tokens x vocab) logits.

Two schedules share the row kernels of ``cross_entropy.py`` (cuBLAS does the matrix products):

* eager (default, any reduction but "none", when gradients are needed): tokens in chunks; for each
  chunk the logits are computed once, the row kernel turns them into the loss AND, in place, into
  the logit gradient for the known per-token weights, and the two gradient products follow at
  once. Three matrix products in all, the practical floor. The backward only scales the stored
  gradients by the upstream scalar. The weight gradient is accumulated in fp32 across chunks.
* recompute (reduction "none", ``low_memory=True``, or a gradient reaching ``z_loss`` on its own):
  the forward keeps only the per-token logsumexp; the backward recomputes the logits one vocabulary
  slice at a time, so each slice of the weight gradient is complete after one product and no
  fp32 copy of the weight gradient exists. Four matrix products.

Extra memory is bounded by ``chunk_bytes`` (logits of one chunk, in the input dtype) plus, in the
eager schedule with several chunks, one fp32 weight-sized accumulator; it does not grow with the
number of tokens. Under ``torch.no_grad()`` only the loss is computed.

Under ``torch.autocast`` the public function casts hidden, weight and bias to the autocast dtype on
entry, as ``F.linear`` (transformers' ``lm_head``) casts them, and the ops run with autocast
disabled: their products are then the products of the unpatched head, and nothing inside them is
cast again (autocast is thread-local state that a custom op would otherwise inherit, forward and
backward, and ``torch.mm(..., out=...)`` rejects the dtype autocast would pick).
"""

from __future__ import annotations

import functools
import sys

import torch

from .cross_entropy import (
    STATISTICS,
    check_options,
    cross_entropy_bwd,
    cross_entropy_fwd,
    prepare_loss_inputs,
    reduce_losses,
    statistics_mask,
    upstream_coefficients,
)
from .dispatch import cdiv, on_device, triton_available, use_triton
from .reference import LossOutput

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    scale_by_upstream_kernel = None

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "LOW_MEMORY_CHUNK_BYTES",
    "linear_cross_entropy",
    "linear_cross_entropy_statistics",
]

DEFAULT_CHUNK_BYTES = 1 << 30  # logits of one token chunk (eager schedule)
LOW_MEMORY_CHUNK_BYTES = 64 << 20  # logits of one slice (recompute schedule, low_memory=True)
_ALIGN = 128


SCALE_BLOCK = 4096

if triton is not None:

    @triton.jit
    def scale_by_upstream_kernel(x_ptr, out_ptr, g_ptr, n, BLOCK: tl.constexpr,
                                 IN_PLACE: tl.constexpr):  # fmt: skip
        """out = x * g, g read from device memory (fp32 product, rounded once). IN_PLACE (out is
        x): the upstream gradient of a training loss is almost always exactly 1, and then every
        program returns at once: the weight-gradient pass (V x D, read and written) costs
        nothing, with no host synchronisation to find out."""
        g = tl.load(g_ptr).to(tl.float32)
        if not IN_PLACE or g != 1.0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            tl.store(out_ptr + offs, (x * g).to(out_ptr.dtype.element_ty), mask=mask)


def _scale_launch(t: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> bool:
    """``out = t * g`` through ``scale_by_upstream_kernel`` (in place where ``out`` is ``t``);
    False (nothing done) where the kernel does not apply."""
    if scale_by_upstream_kernel is None or not use_triton(t) or not t.is_contiguous():
        return False
    g32 = g.detach().reshape(1).to(torch.float32)
    n = t.numel()
    with on_device(t):
        scale_by_upstream_kernel[(cdiv(n, SCALE_BLOCK),)](
            t, out, g32, n, BLOCK=SCALE_BLOCK, IN_PLACE=out is t
        )
    return True


@torch.library.custom_op("surgery::scaled_by_upstream", mutates_args=())
def scaled_by_upstream(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t * g`` in a new tensor (``g`` 0-dim): ``scale_by_upstream_`` under ``torch.compile``,
    through the same kernel, out of place: one vectorised pass, where PyTorch's multiply by a
    0-dim tensor took twice a copy's time over an lm_head gradient."""
    out = torch.empty_like(t)
    if not _scale_launch(t, out, g):
        torch.mul(t, g.to(t.dtype), out=out)
    return out


@scaled_by_upstream.register_fake
def _(t, g):
    return torch.empty_like(t)


def scale_by_upstream_(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t`` scaled by a 0-dim upstream gradient ``g``: in place eagerly (a no-op on the device if
    g == 1). Under ``torch.compile`` a new tensor from one opaque op: the saved gradient is a
    buffer the compiled backward may reuse for a multiply written in the graph, and a gradient
    returned in such a buffer is copied again by autograd before it is accumulated (a second
    lm_head gradient alive to the end of the compiled backward: ``benchmarks/results/
    memory_qwen3_moe_surgery_compiled_padded-before-lm-head-grad-fix.txt``); a new tensor is
    taken as it is, and the saved one is freed at once."""
    if t.numel() == 0:
        return t
    if torch.compiler.is_compiling():
        return scaled_by_upstream(t, g)
    if not _scale_launch(t, t, g):
        t.mul_(g.to(t.dtype))
    return t


# Smallest chunk (rows of the token chunk, columns of the vocabulary slice) worth a matrix
# product: below this the products run far under peak and, in the recompute schedule, re-reading
# the fp32 hidden-gradient accumulator per slice (N x D x 8 bytes) costs more than the product.
MIN_CHUNK_ROWS = 1024
MIN_SLICE_COLS = 4096


def _rows_for(budget: int, row_bytes: int, total: int, minimum: int = _ALIGN) -> int:
    rows = max(minimum, (budget // max(row_bytes, 1)) // _ALIGN * _ALIGN)
    return min(rows, max(total, 1))


def plan_token_chunk(n: int, v: int, d: int, elem: int, accumulate_fp32: bool, budget: int) -> int:
    """Tokens per chunk for the eager schedule. Several chunks need an fp32 weight-gradient
    accumulator (when ``accumulate_fp32``) that is read and written once per chunk (V x D x 8
    bytes: 4.7 GB per chunk for Gemma 2's head), so one chunk is taken unless several would hold
    less than half of its memory."""
    if n * v * elem <= 2 * (budget + (v * d * 4 if accumulate_fp32 else 0)):
        return max(n, 1)
    return _rows_for(budget, v * elem, n, MIN_CHUNK_ROWS)


@functools.cache
def _addmm_out_dtype_works(device_type: str) -> bool:
    # torch.addmm(..., out_dtype=float32) accumulates a bf16/fp16 product into fp32 in cuBLAS; not
    # every build/backend has it, so it is probed once.
    if device_type != "cuda":
        return False
    try:
        acc = torch.zeros(2, 2, device="cuda")
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0].item() == 2.0)
    except (RuntimeError, TypeError):
        return False


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slice_rows: int) -> None:
    """acc (fp32) += a @ b for low-precision a, b without an fp32 copy of either."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_out_dtype_works(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # bounded temporary: slices of the output rows
        for r0 in range(0, acc.shape[0], slice_rows):
            acc[r0 : r0 + slice_rows] += a[r0 : r0 + slice_rows] @ b


def _logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())


def _autocast_disabled(fn):
    """``fn(x, ...)`` run with autocast off on x's device: the body's products run in the dtype
    of their inputs whatever autocast the caller, or the thread running the backward, has on."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast(args[0].device.type, enabled=False):
            return fn(*args, **kwargs)

    return run


def _kept_rows(keep: torch.Tensor) -> torch.Tensor | None:
    """The indices of the rows ``keep`` marks, or None to compute every row: when none is
    dropped, or while a CUDA graph is captured (the count is a host read, which capture
    forbids)."""
    if keep.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    rows = keep.nonzero().flatten()  # the host read
    return None if rows.numel() == keep.numel() else rows


def _scatter_rows(part: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The (n, ...) tensor holding ``part``'s rows at ``rows`` and zeros elsewhere."""
    return part.new_zeros(n, *part.shape[1:]).index_copy_(0, rows, part)


@torch.library.custom_op("surgery::linear_cross_entropy_fwd", mutates_args=())
@_autocast_disabled
def lce_fwd(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    weights: torch.Tensor | None,
    softcap: float,
    eps: float,
    z_scale: float,
    chunk_bytes: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    skip_ignored: bool = False,
    logit_scale: float = 1.0,
    inv_temperature: float = 1.0,
    stats: int = 0,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """Eager schedule (also the plain forward when ``weights`` is None or nothing needs a grad).

    Returns (ce, z, lse, dx, dw, db, *statistics): per-token fp32 losses and logsumexp, the
    gradients for unit upstream gradient on ``sum(weights * (ce + z))``, and the per-token
    ``STATISTICS`` whose bit is set in ``stats`` (bit i for the i-th name); empty tensors where
    not requested.

    ``skip_ignored``: the rows without a target (or of weight 0) take no part in the products;
    their losses, logsumexp, statistics and hidden gradient are 0. Exact: such a row's logit
    gradient is 0.
    """
    n_all, rows = x.shape[0], None
    if skip_ignored:
        rows = _kept_rows((targets >= 0) & (True if weights is None else weights != 0))
    if rows is not None:  # the kept rows only, scattered back at the end
        x, targets = x[rows], targets[rows]
        weights = None if weights is None else weights[rows]
    n, d = x.shape
    v = w.shape[0]
    dev = x.device
    grads = weights is not None and (need_dx or need_dw or need_db)
    need_dx, need_dw, need_db = need_dx and grads, need_dw and grads, need_db and grads
    accumulate_fp32 = need_dw and w.dtype != torch.float32
    chunk = plan_token_chunk(n, v, d, x.element_size(), accumulate_fp32, chunk_bytes)
    single = chunk >= n
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    ce = torch.empty(n, dtype=torch.float32, device=dev)
    zl = torch.empty(n, dtype=torch.float32, device=dev)
    # Outputs of a custom op may not alias each other: distinct empties where not requested.
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    if need_dw and n == 0:  # no row to accumulate (every one skipped)
        dw = torch.zeros_like(w)
    elif need_dw:
        dw = torch.empty_like(w) if single else torch.zeros(v, d, dtype=torch.float32, device=dev)
    else:
        dw = x.new_empty(0)
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else x.new_empty(0)
    statistics = _statistics_buffers(stats, n, dev)
    slice_rows = _rows_for(chunk_bytes // 4, d * 4, v)
    for n0 in range(0, n, chunk):
        n1 = min(n0 + chunk, n)
        xc = x[n0:n1]
        logits = _logits(xc, w, bias)
        rl, rc, rz = cross_entropy_fwd(
            logits,
            targets[n0:n1],
            softcap=softcap,
            label_smoothing=eps,
            z_loss_scale=z_scale,
            coef_ce=weights[n0:n1] if grads else None,
            coef_z=weights[n0:n1] if grads else None,
            grad_out=logits if grads else None,  # our own buffer: overwritten in place
            logit_scale=logit_scale,
            inv_temperature=inv_temperature,
            stats={k: t[n0:n1] for k, t in statistics.items()},
        )
        lse[n0:n1], ce[n0:n1], zl[n0:n1] = rl, rc, rz
        if not grads:
            continue
        if need_dx:
            torch.mm(logits, w, out=dx[n0:n1])
        if need_dw:
            if single:
                torch.mm(logits.t(), xc, out=dw)
            else:
                _accumulate_mm(dw, logits.t(), xc, slice_rows)
        if need_db:
            db += logits.sum(0, dtype=torch.float32)
    if need_dw and dw.dtype != w.dtype:
        dw = dw.to(w.dtype)
    if need_db:
        db = db.to(bias.dtype)
    if rows is not None:
        ce, zl, lse = (_scatter_rows(t, rows, n_all) for t in (ce, zl, lse))
        statistics = {k: _scatter_rows(t, rows, n_all) for k, t in statistics.items()}
        if need_dx:
            dx = _scatter_rows(dx, rows, n_all)
    return ce, zl, lse, dx, dw, db, *_statistics_outputs(statistics, x)


def _statistics_buffers(stats: int, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A buffer of ``n`` rows for each statistic whose bit is set in ``stats``."""
    return {
        name: torch.empty(
            n, dtype=torch.bool if name == "is_top1" else torch.float32, device=device
        )
        for i, name in enumerate(STATISTICS)
        if stats >> i & 1
    }


def _statistics_outputs(statistics: dict[str, torch.Tensor], x: torch.Tensor) -> tuple:
    """One tensor per name of ``STATISTICS``: the buffer, or an empty tensor (distinct ones: the
    outputs of a custom op may not alias each other)."""
    return tuple(statistics.get(name, x.new_empty(0)) for name in STATISTICS)


@torch.library.custom_op("surgery::linear_cross_entropy_bwd", mutates_args=())
@_autocast_disabled
def lce_bwd_recompute(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef_ce: torch.Tensor,
    coef_z: torch.Tensor,
    softcap: float,
    eps: float,
    z_scale: float,
    chunk_bytes: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    skip_ignored: bool = False,
    logit_scale: float = 1.0,
    inv_temperature: float = 1.0,
    entropy: torch.Tensor | None = None,
    coef_entropy: torch.Tensor | None = None,
    vocab_start: int = 0,
    vocab_total: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute schedule's backward: vocabulary slices, each weight-gradient slice complete after
    one product; the hidden gradient is accumulated in fp32. ``coef_entropy``: the upstream
    gradient of the per-token ``entropy`` too. ``skip_ignored``: rows without a target or with
    every coefficient 0 (they contribute nothing) take no part in the products.

    ``vocab_start`` / ``vocab_total`` (0: ``w``'s rows are the whole vocabulary): ``w`` holds rows
    ``[vocab_start, vocab_start + V)`` of a head of ``vocab_total`` rows (vocabulary-parallel);
    ``targets`` and ``lse`` are then the whole vocabulary's, and the hidden gradient is this
    slice's part of it."""
    n_all, rows = x.shape[0], None
    if skip_ignored:
        live = (coef_ce != 0) | (coef_z != 0)
        if coef_entropy is not None:
            live = live | (coef_entropy != 0)
        rows = _kept_rows((targets >= 0) & live)
    if rows is not None:  # the kept rows only, the hidden gradient scattered back at the end
        x, targets, lse, coef_ce, coef_z = (t[rows] for t in (x, targets, lse, coef_ce, coef_z))
        if coef_entropy is not None:
            entropy, coef_entropy = entropy[rows], coef_entropy[rows]
    n, d = x.shape
    v = w.shape[0]
    dev = x.device
    if n == 0:  # every row skipped: nothing reaches the hidden states, the weight or the bias
        dx = x.new_zeros(n_all, d) if need_dx else x.new_empty(0)
        dw = torch.zeros_like(w) if need_dw else x.new_empty(0)
        db = torch.zeros_like(bias) if need_db else x.new_empty(0)
        return dx, dw, db
    cols = _rows_for(chunk_bytes, n * x.element_size(), v, MIN_SLICE_COLS)
    dx_acc = torch.zeros(n, d, dtype=torch.float32, device=dev) if need_dx else None
    dw = torch.empty_like(w) if need_dw else x.new_empty(0)
    db = torch.empty(v, dtype=torch.float32, device=dev) if need_db else x.new_empty(0)
    for v0 in range(0, v, cols):
        v1 = min(v0 + cols, v)
        wc = w[v0:v1]
        logits = _logits(x, wc, None if bias is None else bias[v0:v1])
        cross_entropy_bwd(
            logits,
            targets,
            lse,
            coef_ce,
            coef_z,
            logits,
            col_offset=vocab_start + v0,
            vocab_size=vocab_total or v,
            softcap=softcap,
            label_smoothing=eps,
            z_loss_scale=z_scale,
            logit_scale=logit_scale,
            inv_temperature=inv_temperature,
            entropy=entropy,
            coef_entropy=coef_entropy,
        )
        if need_dw:
            torch.mm(logits.t(), x, out=dw[v0:v1])
        if need_dx:
            _accumulate_mm(dx_acc, logits, wc, max(_ALIGN, n // 8))
        if need_db:
            db[v0:v1] = logits.sum(0, dtype=torch.float32)
    dx = dx_acc.to(x.dtype) if need_dx else x.new_empty(0)
    if need_db:
        db = db.to(bias.dtype)
    if rows is not None and need_dx:
        dx = _scatter_rows(dx, rows, n_all)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# torch.library ops


@lce_fwd.register_fake
def _(x, w, bias, targets, weights, softcap, eps, z_scale, chunk_bytes, need_dx, need_dw, need_db,
      skip_ignored=False, logit_scale=1.0, inv_temperature=1.0, stats=0):  # fmt: skip
    n = x.shape[0]
    grads = weights is not None
    per_tok = [x.new_empty(n, dtype=torch.float32) for _ in range(3)]
    dx = torch.empty_like(x) if grads and need_dx else x.new_empty(0)
    dw = torch.empty_like(w) if grads and need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if grads and need_db and bias is not None else x.new_empty(0)
    statistics = _statistics_outputs(_statistics_buffers(stats, n, x.device), x)
    return (*per_tok, dx, dw, db, *statistics)


@lce_bwd_recompute.register_fake
def _(x, w, bias, targets, lse, coef_ce, coef_z, softcap, eps, z_scale, chunk_bytes, need_dx,
      need_dw, need_db, skip_ignored=False, logit_scale=1.0, inv_temperature=1.0, entropy=None,
      coef_entropy=None, vocab_start=0, vocab_total=0):  # fmt: skip
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(w) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


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
        # Per-token losses whose upstream gradient was uniform last time: the gradients for a
        # unit one on every token with a target, now (checked in the backward).
        speculate = weights is None and hint is not None and hint.uniform
        grad_weights = (targets >= 0).to(torch.float32) if speculate else weights
        eager = grad_weights is not None and not low_memory and (need_dx or need_dw or need_db)
        ce, zl, lse, dx, dw, db, entropy, *others = lce_fwd(
            x, w, bias, targets, grad_weights if eager else None, softcap, eps, z_scale,
            chunk_bytes, need_dx, need_dw, need_db, skip_ignored, *transform, stats,
        )  # fmt: skip
        # The gradients for unit upstream gradient, scaled in the backward. Eagerly they sit on
        # ctx and are scaled in place; the backward drops them, so a second backward
        # (retain_graph) recomputes instead of reusing scaled ones. Compiled, that would keep them
        # to the end of the step (the compiler keeps tensors put on ctx until the graph is freed:
        # a second lm_head gradient beside the real one): there they are saved
        # tensors, handed to the backward graph, which frees them once scaled out of place
        # (``scale_by_upstream_``). Compiled graphs have no retain_graph (donated buffers).
        compiled = torch.compiler.is_compiling()
        grads = (dx, dw, db) if eager else ()
        ctx.save_for_backward(
            x, w, bias, targets, weights, lse, entropy, *(grads if compiled else ())
        )
        ctx.eager_grads = grads if eager and not compiled else None
        ctx.opts = (softcap, eps, z_scale, chunk_bytes, need_dx, need_dw, need_db, skip_ignored,
                    transform)  # fmt: skip
        ctx.hint = hint if weights is None and not compiled else None
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
        ctx.eager_grads = None
        if entropy.numel() == 0:
            g_entropy = None
        if ctx.hint is not None and g_loss is None:
            ctx.hint.uniform = False  # nothing to scale: the next forward computes no gradients
        elif ctx.hint is not None:
            # Per-token losses: the eager gradients hold for a uniform upstream gradient only.
            uniform = _uniform_upstream(g_loss, targets)
            ctx.hint.uniform = uniform is not None
            if uniform is None:
                eager = None  # recomputed below for the upstream gradient as it is
            else:
                g_loss = uniform
        if eager is not None:
            if g_loss is not None:
                # The stored gradients are for unit upstream gradient: scale in place.
                dx, dw, db = (scale_by_upstream_(t, g_loss) if t.numel() else None for t in eager)
            # z_loss and the entropy are usually only logged; a gradient reaching either on its
            # own is recomputed (the ce part is already in the eager gradients).
            g_rest = (None, g_z if z_scale > 0.0 else None)
        else:
            g_rest = (g_loss, g_z)
        if g_rest[0] is not None or g_rest[1] is not None or g_entropy is not None:
            a, b = upstream_coefficients(weights, *g_rest, x.shape[0], x.device)
            e = None if g_entropy is None else g_entropy.reshape(-1).float().contiguous()
            rdx, rdw, rdb = lce_bwd_recompute(
                x, w, bias, targets, lse, a, b, softcap, eps, z_scale, chunk_bytes,
                need_dx, need_dw, need_db, skip_ignored, *transform,
                None if e is None else entropy, e,
            )  # fmt: skip
            dx = _add(dx, rdx if need_dx else None)
            dw = _add(dw, rdw if need_dw else None)
            db = _add(db, rdb if need_db else None)
        return dx, dw, db, *(None,) * 12


class UpstreamHint:
    """Shared by the calls of ``linear_log_probs`` in one training loop: whether the last
    backward's upstream gradient on the per-token losses was the same for every token with a
    target (``uniform``: None before any). When it was, the next forward computes the gradients
    for a unit one at once, the eager schedule's three matrix products, and its backward scales
    them; when it no longer is, that backward recomputes (four products in all, that once)."""

    def __init__(self) -> None:
        self.uniform: bool | None = None

    def __repr__(self) -> str:
        return f"UpstreamHint(uniform={self.uniform})"


def _uniform_upstream(g: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """The 0-dim upstream gradient every token with a target has, or None if they differ (one
    host read). No token with a target: 0."""
    g = g.reshape(-1).to(torch.float32)
    valid = targets >= 0
    hi = torch.where(valid, g, float("-inf")).amax()
    lo = torch.where(valid, g, float("inf")).amin()
    same, none = torch.stack([hi == lo, ~valid.any()]).tolist()  # the host read
    if none:
        return g.new_zeros(())
    return hi if same else None


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
    """Cross entropy of ``hidden @ weight.T + bias`` against ``labels`` without the full logits.

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
        low_memory: recompute the logits in the backward one vocabulary slice at a time: no fp32
            weight-gradient accumulator and smaller chunks, at the cost of a fourth product.
        chunk_bytes: logits bytes per chunk (default 1 GiB, 64 MiB with ``low_memory``; chunks
            never go below 1024 tokens or 4096 vocabulary columns).
        skip_ignored: tokens without a target (``ignore_index``, a masked prompt, padding; with
            reduction "none" also those whose upstream gradient is 0) take no part in the matrix
            products, forward or backward: exact (their logit gradients are 0; their losses are
            0 either way), and an SFT batch with half its tokens masked costs about half the
            products. The price is one host read of the count per call (forward, and the
            recompute backward), which drains the queue of work the GPU is doing; off while a
            CUDA graph is captured. Default off: without it no call reads anything on the host.

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
    among ``STATISTICS`` (``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``),
    shaped like ``labels``, fp32 (``is_top1`` bool), 0 where a token has no target, detached.
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
    )
    if chunk_bytes is None:
        chunk_bytes = LOW_MEMORY_CHUNK_BYTES if low_memory else DEFAULT_CHUNK_BYTES
    needs = input_needs(x, w, bias)
    loss, z, *values = LinearCrossEntropyFunction.apply(
        x, w, bias, targets, weights, float(softcap or 0.0), float(label_smoothing),
        float(z_loss_scale), int(chunk_bytes), bool(low_memory), needs, bool(skip_ignored),
        (1.0, 1.0), stats,
    )  # fmt: skip
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    named = {
        name: t.detach().view(labels.shape)
        for name, t in zip(STATISTICS, values, strict=True)
        if name in statistics
    }
    return LossOutput(loss, z), named
