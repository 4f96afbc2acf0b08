"""The fused head's host side below autograd: the in-place upstream scaling (a Triton kernel and
its op), the token-chunk plan, and the three torch.library ops that run the schedules (the
package docstring): ``lce_fwd`` (loss, statistics and, in the eager schedule, the gradients; in the
kept one, the logits or a softcapped head's Q), ``lce_bwd_kept`` (the kept schedule's backward)
and ``lce_bwd_recompute`` (the recompute schedule's)."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from ..cross_entropy import (
    STATISTIC_FILL,
    cross_entropy_bwd,
    cross_entropy_fwd,
    statistics_buffers,
    statistics_outputs,
)
from ..dispatch import cdiv, interpreter_enabled, on_device, triton_available, use_triton
from .products import applies as products_apply
from .products import (
    cap_reference,
    grad_products,
    logit_map,
    lse_products,
    softcap_products,
    statistics_row_bytes,
    target_logits,
    tma_ready,
)
from .terms import TargetTerms, accumulate_mm, scaled_dw, scaled_dx, target_terms

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FP32_RANGE",
    "LOW_MEMORY_CHUNK_BYTES",
    "chunk_budget",
    "join_gradient_stream",
    "keeps_q",
    "kept_is_q",
    "kept_pays",
    "kept_slot_free",
    "lce_bwd_kept",
    "lce_bwd_recompute",
    "lce_fwd",
    "live_rows",
    "plan_token_chunk",
    "scale_by_upstream_",
    "scaled_by_upstream",
]

if triton_available():
    import triton
    import triton.language as tl

    from ..rounding import round_to
else:  # pragma: no cover
    triton = None
    scale_by_upstream_kernel = None

DEFAULT_CHUNK_BYTES = 1 << 30  # logits of one token chunk (eager schedule)
LOW_MEMORY_CHUNK_BYTES = 64 << 20  # logits of one slice (recompute schedule, low_memory=True)


def chunk_budget(chunk_bytes: int | None, low_memory: bool) -> int:
    """The logits' bytes per chunk or slice a call asked for, else the default of its schedule."""
    if chunk_bytes is not None:
        return int(chunk_bytes)
    return LOW_MEMORY_CHUNK_BYTES if low_memory else DEFAULT_CHUNK_BYTES


_ALIGN = 128


SCALE_BLOCK = 4096

if triton is not None:

    @triton.jit
    def scale_by_upstream_kernel(x_ptr, out_ptr, g_ptr, n, BLOCK: tl.constexpr,
                                 IN_PLACE: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
        """out = x * g, g read from device memory (fp32 product, rounded once to nearest: the
        interpreter too, ``rounding.round_to``). IN_PLACE (out is x): the upstream gradient of a
        training loss is almost always exactly 1, and then every program returns at once: the
        weight-gradient pass (V x D, read and written) costs nothing, with no host
        synchronisation to find out."""
        g = tl.load(g_ptr).to(tl.float32)
        if not IN_PLACE or g != 1.0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            y = round_to(x * g, out_ptr.dtype.element_ty, INTERPRETED)
            tl.store(out_ptr + offs, y, mask=mask)


def _scale_launch(t: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> bool:
    """``out = t * g`` through ``scale_by_upstream_kernel`` (in place where ``out`` is ``t``);
    False (nothing done) where the kernel does not apply."""
    if scale_by_upstream_kernel is None or not use_triton(t) or not t.is_contiguous():
        return False
    g32 = g.detach().reshape(1).to(torch.float32)
    n = t.numel()
    with on_device(t):
        scale_by_upstream_kernel[(cdiv(n, SCALE_BLOCK),)](
            t, out, g32, n, BLOCK=SCALE_BLOCK, IN_PLACE=out is t,
            INTERPRETED=interpreter_enabled(),
        )  # fmt: skip
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


def _rows_of(rows: torch.Tensor, *tensors: torch.Tensor | None) -> tuple:
    """Each of ``tensors`` at ``rows`` (None stays None)."""
    return tuple(None if t is None else t[rows] for t in tensors)


def _scatter_rows(part: torch.Tensor, rows: torch.Tensor, n: int, fill: float = 0.0):
    """The (n, ...) tensor holding ``part``'s rows at ``rows`` and ``fill`` elsewhere."""
    return part.new_full((n, *part.shape[1:]), fill).index_copy_(0, rows, part)


def _row_losses(lse, x_y, targets, v: int, z_scale: float):
    """``(valid, ce, zl)`` of rows whose log-sum-exp and target logit the fused products gave
    (no label smoothing): 0 on rows without a target in [0, v)."""
    valid = (targets >= 0) & (targets < v)
    ce = torch.where(valid, lse - x_y, 0.0)
    return valid, ce, torch.where(valid, z_scale * lse * lse, 0.0)


def _lse_chunk(xc, w, targets, cap: float, z_scale: float, stats: int, transform):
    """One chunk's ``(lse, ce, zl, valid, statistics)`` through ``lse_products``: no logits
    stored."""
    lse, values = lse_products(xc, w, cap, stats, transform)
    x_y, _ = target_logits(xc, w, targets, cap, transform)
    valid, ce, zl = _row_losses(lse, x_y, targets, w.shape[0], z_scale)
    return lse, ce, zl, valid, values


def _fill_statistics(statistics: dict, values: dict, valid, targets) -> None:
    """The requested statistics' slices (``statistics``) from a fused chunk's ``values``
    (``products._row_statistics``), as the unfused kernels fill them: 0 (``is_top1`` False,
    ``predicted`` -1) on rows without a target."""
    for name, out in statistics.items():
        if name == "is_top1":
            out.copy_(valid & (values["predicted"] == targets))
        elif name == "predicted":
            out.copy_(torch.where(valid, values["predicted"], -1))
        else:
            out.copy_(torch.where(valid, values[name], 0.0))


def _softcap_chunk(xc, w, targets, cap: float, z_scale: float, stats: int, transform):
    """One chunk's ``(lse, ce, zl, valid, statistics, q, rows)`` through ``softcap_products``
    (its docstring has the formulas, with cap / T for cap): Q as the product wrote it, and
    ``rows`` (2, n) fp32, each row's S and 1 - t^2 at its target, which with the rows'
    coefficients make its ``terms.TargetTerms`` (``terms.target_terms``)."""
    q, s, x_y, d_y, values = softcap_products(xc, w, targets, cap, stats, transform)
    lse = s.log() + cap_reference(logit_map(cap, transform).x_cap)
    valid, ce, zl = _row_losses(lse, x_y, targets, w.shape[0], z_scale)
    return lse, ce, zl, valid, values, q, torch.stack([s, d_y])


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def _gradient_stream(device: torch.device):
    """The side stream of ``lce_fwd(overlap=True)``'s gradient products, one per device (made
    under a lock: two threads' first calls must not each make one, or a join would wait on the
    other's)."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


# The current stream's tensors the side stream reads or writes, by the stream that made them:
# held (not freed) until that stream has waited for the side stream (``join_gradient_stream``), so
# that their memory is handed out again in that stream's order, not while the side stream may
# still use it. (By stream, not device: a join on another thread's stream waits for nothing of
# this one's.)
_HELD: dict[torch.cuda.Stream, list[torch.Tensor]] = {}


@contextlib.contextmanager
def _on_gradient_stream(stream, *tensors):
    """Work queued inside runs on ``stream`` (None: where it is) after everything the current
    stream has queued; ``tensors``, memory of the current stream read or written there, are held
    until ``join_gradient_stream``."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    _HELD.setdefault(current, []).extend(t for t in tensors if isinstance(t, torch.Tensor))
    with torch.cuda.stream(stream):
        yield


def _share_with_gradient_stream(stream, *inputs) -> None:
    """The caller's tensors that the side stream reads, recorded on it: holding them is not
    enough when their memory is freed whatever references hold it (a parameter manager's
    weight, FSDP2's reshard or ZeRO-3's release after the forward); recorded, the allocator
    hands it out again only once the side stream's work queued so far is done."""
    for t in inputs:
        if t is not None:
            t.record_stream(stream)


def join_gradient_stream(device: torch.device) -> None:
    """Make the current stream wait for the gradients ``lce_fwd(overlap=True)`` queued on its
    side stream (without a host wait), and let go of what it held: call before reading them."""
    stream, current = _gradient_stream(device), torch.cuda.current_stream(device)
    current.wait_stream(stream)
    _HELD.pop(current, None)


# The logits a forward kept for its backward (``lce_fwd(keep=True)``), by device, as a weak
# reference: while they wait, another forward recomputes instead of keeping (several forwards
# before one backward, as pipeline schedules run them, would otherwise hold one chunk each; a
# graph that is never backpropagated holds its logits, and so its slot, until it is freed).
_KEPT: dict[torch.device, weakref.ref] = {}
_KEPT_LOCK = threading.Lock()


class _Reserved:
    """What holds a device's slot between ``_reserve_kept`` and the logits taking it."""


def kept_slot_free(device: torch.device) -> bool:
    """Whether no call's kept logits hold the device's slot now (``_reserve_kept`` would give it;
    a peek, for planning: the reservation itself is ``lce_fwd``'s)."""
    ref = _KEPT.get(device)
    return ref is None or ref() is None


def _reserve_kept(device: torch.device) -> _Reserved | None:
    """The device's slot for kept logits, reserved while the returned object lives (None where
    another call's kept logits hold it); under a lock, so that two threads cannot both keep."""
    with _KEPT_LOCK:
        ref = _KEPT.get(device)
        if ref is not None and ref() is not None:
            return None
        reserved = _Reserved()
        _KEPT[device] = weakref.ref(reserved)
        return reserved


def live_rows(targets, coef_ce, coef_z, coef_entropy) -> torch.Tensor | None:
    """The rows with a target and a coefficient that is not 0 (``skip_ignored``'s rows in a
    backward), or None for every row (also while a CUDA graph is captured). One host read."""
    live = (coef_ce != 0) | (coef_z != 0)
    if coef_entropy is not None:
        live = live | (coef_entropy != 0)
    return _kept_rows((targets >= 0) & live)


def keeps_q(x, w, bias, softcap: float, eps: float, z_scale: float, transform, need_dw: bool,
            chunk_bytes: int) -> bool:  # fmt: skip
    """Whether ``lce_fwd(keep=True, keep_products=True)`` without weights keeps a Q of
    ``softcap_products`` (slot permitting): the eager plan takes the rows ``x`` in one chunk, no
    z-loss, the eager products apply (a softcapped bf16 head on a GPU that runs them)."""
    n, d = x.shape
    return (
        n > 0
        and plan_token_chunk(n, w.shape[0], d, x.element_size(),
                             need_dw and w.dtype != torch.float32, chunk_bytes) >= n
        and _q_applies(x, w, bias, softcap, eps, z_scale, transform)
    )  # fmt: skip


def _q_applies(x, w, bias, softcap: float, eps: float, z_scale: float, transform) -> bool:
    """Whether a Q of ``softcap_products`` can serve the kept schedule: the eager products apply,
    and no z-loss (the backward's ``terms.target_terms`` take one coefficient per row)."""
    return z_scale == 0.0 and products_apply(x, w, bias, softcap, eps, z_scale, *transform,
                                             eager=True)  # fmt: skip


# The dtypes with fp32's exponent range (its least normal number; bf16's largest is smaller only
# by its mantissa's bits): fp16 and the 8-bit floats are not among them.
FP32_RANGE = (torch.float32, torch.float64, torch.bfloat16)


def kept_is_q(kept_terms: torch.Tensor) -> bool:
    """Whether ``lce_fwd``'s ``kept_terms`` are a kept Q's, (2, rows): from the fused products
    (a kept unit gradient's are (1, rows); none kept, empty)."""
    return kept_terms.dim() == 2 and kept_terms.shape[0] == 2


def kept_pays(logits: torch.Tensor, live: torch.Tensor | None) -> bool:
    """Whether the kept logits' two products over their rows cost no more than the recompute
    schedule's three over the ``live`` rows alone (``live_rows``): at least two thirds of the
    kept rows are live."""
    return live is None or 3 * live.numel() >= 2 * logits.shape[0]


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
    overlap: bool = False,
    keep: bool = False,
    keep_products: bool = False,
    fuse: bool = True,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """Eager schedule (also the plain forward when ``weights`` is None or nothing needs a grad).

    Returns (ce, z, lse, dx, dw, db, kept, kept_rows, kept_terms, *statistics): per-token fp32
    losses and logsumexp, the gradients for unit upstream gradient on ``sum(weights * (ce +
    z))``, the kept logits, their rows and terms (``keep``) and the per-token ``STATISTICS``
    whose bit is set in ``stats`` (bit i for the i-th name); empty tensors where not requested.

    ``keep`` (no ``weights``, a gradient needed): the logits of the rows that take part, (rows,
    V) in the inputs' dtype, and those rows' indices (empty: every row), for ``lce_bwd_kept``,
    where the eager schedule's plan would take them in one chunk and no other call's kept logits
    on this device wait for their backward (else empty, and the backward recomputes): an
    upstream gradient known only in the backward then costs three products, not four. They come
    from the unfused product (the backward's gradient is made of them, so the log-sum-exp must
    be theirs). Traced (fake or meta tensors), their shape is the batch's: declined there.
    ``keep_products`` too (and no z-loss) where ``softcap_products`` applies (a softcapped head):
    its Q in place of the logits, and ``kept_terms``, (2, rows) fp32, the rows' S and 1 - t^2 at
    the target (``_softcap_chunk``): no pass over the logits, forward or backward, a backward
    that cannot take an entropy's gradient (its caller recomputes then). Elsewhere with
    ``keep_products``, no z-loss, no bias and not in fp16: the logits' gradient for a coefficient
    of 1 on the cross entropy of every row with a target (written by the row sweep, which reads
    them anyway), and ``kept_terms`` (1, rows) fp32, 1 on those rows and 0 on the others: the
    backward scales its rows by their coefficients inside its two products (no pass over them,
    the same limits as a Q's).

    ``fuse`` False: the unfused products even where the fused ones would apply (a vocabulary
    slice computed with options its loss does not have, whose backward recomputes unfused logits
    that must share this log-sum-exp: ``vocab_parallel``'s label smoothing).

    ``skip_ignored``: the rows without a target (or of weight 0) take no part in the products;
    their losses, logsumexp, statistics and hidden gradient are 0. Exact: such a row's logit
    gradient is 0.

    ``overlap`` (CUDA, one token chunk): the gradient products (two of the three) run on a side
    stream, so that a host read the caller makes once the losses are known
    (``UpstreamHint.learn``) waits for the logits' product and the row sweep only, and the host
    goes on while the gradients are made; the caller calls ``join_gradient_stream`` before it
    reads them (the logits stay held until then: a backward soon after the forward; the weight
    and bias are recorded on the side stream too, since a parameter manager may free them before
    the join). Several chunks stay on one stream: each chunk's logits would be held.
    """
    n_all, rows, caller_w, caller_bias = x.shape[0], None, w, bias
    wants = need_dx or need_dw or need_db
    grads = weights is not None and wants
    if skip_ignored:
        rows = _kept_rows((targets >= 0) & (True if weights is None else weights != 0))
    if rows is not None:  # the kept rows only, scattered back at the end
        x, targets = x[rows], targets[rows]
        weights = None if weights is None else weights[rows]
    n, d = x.shape
    v = w.shape[0]
    dev = x.device
    # keep: the logits for the backward, where the eager schedule would take one chunk (its
    # plan, weight gradient included: the step's peak is then the eager schedule's) and no other
    # call's kept logits wait for their backward on this device; they are the unfused
    # product's, which the backward's gradient is then made of, and the log-sum-exp must be theirs
    keep = keep and weights is None and wants and n > 0 and plan_token_chunk(
        n, v, d, x.element_size(), need_dw and w.dtype != torch.float32, chunk_bytes
    ) >= n  # fmt: skip
    reserved = _reserve_kept(dev) if keep else None
    keep = reserved is not None
    # through the fused products: their lse is the fp32 products' (a backward recomputing the
    # logits takes them too: lce_bwd_recompute's fused_lse); with gradients, or Q kept for them,
    # softcapped heads with 0 < cap / T <= MAX_SOFTCAP and a z-loss within its bound only
    # (products.options_apply); Q kept without a z-loss (``_q_applies``; the plan held for keep)
    keep_q = keep and keep_products and fuse and _q_applies(
        x, w, bias, softcap, eps, z_scale, (logit_scale, inv_temperature)
    )  # fmt: skip
    # else, without a z-loss or a bias, the logits' gradient for a coefficient of 1 on every row
    # with a target, written by the row sweep in place of them: the backward's coefficients are
    # then a scale of its rows, which its two products take (``_kept_q_backward``); not in fp16,
    # whose range may not hold X's rows scaled by a loss scaler's upstream gradient
    keep_unit = (
        keep and keep_products and not keep_q and z_scale == 0.0 and bias is None
        and x.dtype in FP32_RANGE
    )  # fmt: skip
    fused = keep_q or (not keep and fuse and products_apply(
        x, w, bias, softcap, eps, z_scale, logit_scale, inv_temperature, eager=grads
    ))  # fmt: skip
    transform = (logit_scale, inv_temperature)
    if fused:
        x, w = tma_ready(x), tma_ready(w)
    need_dx, need_dw, need_db = need_dx and grads, need_dw and grads, need_db and grads
    accumulate_fp32 = need_dw and w.dtype != torch.float32
    chunk = n if keep else plan_token_chunk(n, v, d, x.element_size(), accumulate_fp32, chunk_bytes)
    if fused and not grads and not keep:  # no logits stored: the budget bounds the statistics
        chunk = _rows_for(chunk_bytes, statistics_row_bytes(v, stats), n, MIN_CHUNK_ROWS)
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
    statistics = statistics_buffers(stats, n, dev)
    slice_rows = _rows_for(chunk_bytes // 4, d * 4, v)
    side, kept, kept_terms = None, x.new_empty(0), lse.new_empty(0)
    if overlap and grads and single and dev.type == "cuda":
        join_gradient_stream(dev)  # what an earlier call left held (its backward never ran)
        side = _gradient_stream(dev)
        _share_with_gradient_stream(side, caller_w, caller_bias)
    for n0 in range(0, n, chunk):
        n1 = min(n0 + chunk, n)
        xc = x[n0:n1]
        terms = None  # the fused product's gradient terms
        if fused and (grads or keep_q):
            rl, rc, rz, valid, values, logits, q_rows = _softcap_chunk(
                xc, w, targets[n0:n1], softcap, z_scale, stats, transform
            )
            if keep_q:
                kept_terms = q_rows
            else:
                terms = target_terms(weights[n0:n1], rl, q_rows, targets[n0:n1], v, z_scale,
                                       softcap, transform)  # fmt: skip
        elif fused:
            rl, rc, rz, valid, values = _lse_chunk(xc, w, targets[n0:n1], softcap, z_scale, stats,
                                                   transform)  # fmt: skip
        if fused:
            part = {k: t[n0:n1] for k, t in statistics.items()}
            _fill_statistics(part, values, valid, targets[n0:n1])
        else:
            logits = _logits(xc, w, bias)
            coef = weights[n0:n1] if grads else None
            if keep_unit:
                coef = torch.ones(n1 - n0, dtype=torch.float32, device=dev)
                kept_terms = (targets[n0:n1] >= 0).to(torch.float32)[None]
            rl, rc, rz = cross_entropy_fwd(
                logits,
                targets[n0:n1],
                softcap=softcap,
                label_smoothing=eps,
                z_loss_scale=z_scale,
                coef_ce=coef,
                coef_z=coef,
                grad_out=None if coef is None else logits,  # our own buffer: overwritten in place
                logit_scale=logit_scale,
                inv_temperature=inv_temperature,
                stats={k: t[n0:n1] for k, t in statistics.items()},
            )
        lse[n0:n1], ce[n0:n1], zl[n0:n1] = rl, rc, rz
        if keep:
            kept = logits
            _KEPT[dev] = weakref.ref(kept)  # the slot passes from ``reserved`` to them
        if not grads:
            continue
        with _on_gradient_stream(side, x, w, logits, dx, dw, db, *(terms or ())):
            if need_dx:
                if terms is not None:
                    scaled_dx(logits, w, terms, dx[n0:n1], slice_rows)
                else:
                    torch.mm(logits, w, out=dx[n0:n1])
            if need_dw:
                if terms is not None:
                    scaled_dw(logits, xc, terms, dw, not single, slice_rows)
                elif single:
                    torch.mm(logits.t(), xc, out=dw)
                else:
                    accumulate_mm(dw, logits.t(), xc, slice_rows)
            if need_db:
                db += logits.sum(0, dtype=torch.float32)
    # the gradients' last steps where they were made (the outputs: the current stream's memory)
    if need_dw and dw.dtype != w.dtype:
        dw_out = torch.empty_like(w)
        with _on_gradient_stream(side, dw, dw_out):
            dw = dw_out.copy_(dw)
    if need_db:
        db_out = torch.empty_like(bias)
        with _on_gradient_stream(side, db, db_out):
            db = db_out.copy_(db)
    if rows is not None:
        ce, zl, lse = (_scatter_rows(t, rows, n_all) for t in (ce, zl, lse))
        statistics = {k: _scatter_rows(t, rows, n_all, STATISTIC_FILL.get(k, 0.0))
                      for k, t in statistics.items()}  # fmt: skip
        if need_dx:
            dx_out = dx.new_zeros(n_all, d)
            with _on_gradient_stream(side, dx, dx_out, rows):
                dx = dx_out.index_copy_(0, rows, dx)
    kept_rows = rows if keep and rows is not None else targets.new_empty(0)
    return (ce, zl, lse, dx, dw, db, kept, kept_rows, kept_terms,
            *statistics_outputs(statistics, x))  # fmt: skip


def _gradient_in_place(
    logits,
    targets,
    lse,
    coef_ce,
    coef_z,
    loss,
    transform,
    entropy,
    coef_entropy,
    col_offset: int = 0,
    vocab_size: int | None = None,
) -> None:
    """The rows' logit gradient for their coefficients, written in place of ``logits`` (columns
    ``[col_offset, ...)`` of a vocabulary of ``vocab_size``); ``loss``: (softcap, label smoothing,
    z-loss scale), ``transform``: (logit scale, 1 / temperature)."""
    softcap, eps, z_scale = loss
    cross_entropy_bwd(logits, targets, lse, coef_ce, coef_z, logits, col_offset=col_offset,
                      vocab_size=vocab_size, softcap=softcap, label_smoothing=eps,
                      z_loss_scale=z_scale, logit_scale=transform[0],
                      inv_temperature=transform[1], entropy=entropy,
                      coef_entropy=coef_entropy)  # fmt: skip


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
    fused_lse: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute schedule's backward: vocabulary slices, each weight-gradient slice complete after
    one product; the hidden gradient is accumulated in fp32, in blocks of rows whose accumulator
    holds at most twice ``chunk_bytes`` (each block's slices recomputed, the weight gradient added
    to in its dtype past the first block). ``coef_entropy``: the upstream
    gradient of the per-token ``entropy`` too. ``skip_ignored``: rows without a target or with
    every coefficient 0 (they contribute nothing) take no part in the products (``live``: those
    that do, where the caller has found them with ``live_rows``).

    ``vocab_start`` / ``vocab_total`` (0: ``w``'s rows are the whole vocabulary): ``w`` holds rows
    ``[vocab_start, vocab_start + V)`` of a head of ``vocab_total`` rows (vocabulary-parallel);
    ``targets`` and ``lse`` are then the whole vocabulary's, and the hidden gradient is this
    slice's part of it.

    ``fused_lse``: ``lse`` came from the fused products (``lce_fwd`` took them); the logits are then
    recomputed by ``grad_products`` where it applies, which writes each slice's gradient in place
    of its logits."""
    fused = fused_lse and products_apply(
        x, w, bias, softcap, eps, z_scale, logit_scale, inv_temperature, eager=False
    )
    transform = (logit_scale, inv_temperature)
    if fused:
        x, w = tma_ready(x), tma_ready(w)
    n_all, rows = x.shape[0], None
    if skip_ignored:  # ``live``: the caller's ``live_rows`` (no second host read)
        rows = live if live is not None else live_rows(targets, coef_ce, coef_z, coef_entropy)
    if rows is not None:  # the kept rows only, the hidden gradient scattered back at the end
        x, targets, lse, coef_ce, coef_z, entropy, coef_entropy = _rows_of(
            rows, x, targets, lse, coef_ce, coef_z, entropy, coef_entropy
        )  # fmt: skip
    n, d = x.shape
    v = w.shape[0]
    dev = x.device
    if n == 0:  # every row skipped: nothing reaches the hidden states, the weight or the bias
        dx = x.new_zeros(n_all, d) if need_dx else x.new_empty(0)
        dw = torch.zeros_like(w) if need_dw else x.new_empty(0)
        db = torch.zeros_like(bias) if need_db else x.new_empty(0)
        return dx, dw, db
    # Rows in blocks whose fp32 hidden-gradient accumulator holds at most twice the budget (one
    # block but under low_memory's small budget at long inputs: Qwen 2.5's head at 16384 tokens
    # takes two of 8192 at 64 MiB, 0.11 GiB of accumulator where one took 0.22). Each block
    # recomputes its own slices of the logits; the weight gradient's slices are added to in its
    # own dtype after the first block (one rounding more each).
    blocks = cdiv(n * d * 4, 2 * chunk_bytes) if need_dx else 1
    block = min(n, cdiv(cdiv(n, blocks), _ALIGN) * _ALIGN)
    cols = _rows_for(chunk_bytes, block * x.element_size(), v, MIN_SLICE_COLS)
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(w) if need_dw else x.new_empty(0)
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else x.new_empty(0)
    big_a = small_a = None
    if fused:  # the rows' coefficients A = a + 2 s lse b and a, 0 without a target
        valid = (targets >= 0) & (targets < (vocab_total or v))
        big_a = torch.where(valid, coef_ce + 2.0 * z_scale * lse * coef_z, 0.0)
        small_a = torch.where(valid, coef_ce, 0.0)
        if coef_entropy is not None:
            coef_entropy = torch.where(valid, coef_entropy, 0.0)
    for r0 in range(0, n, block):
        r1 = min(r0 + block, n)
        xb, tb, lb, ab, bb, eb, ceb, big_b, small_b = (
            None if t is None else t[r0:r1]
            for t in (x, targets, lse, coef_ce, coef_z, entropy, coef_entropy, big_a, small_a)
        )  # fmt: skip
        dx_acc = torch.zeros(r1 - r0, d, dtype=torch.float32, device=dev) if need_dx else None
        for v0 in range(0, v, cols):
            v1 = min(v0 + cols, v)
            wc = w[v0:v1]
            if fused:
                logits = grad_products(xb, wc, tb, lb, big_b, small_b, softcap, vocab_start + v0,
                                       eb, ceb, transform)  # fmt: skip
            else:
                logits = _logits(xb, wc, None if bias is None else bias[v0:v1])
                _gradient_in_place(logits, tb, lb, ab, bb, (softcap, eps, z_scale), transform,
                                   eb, ceb, vocab_start + v0, vocab_total or v)  # fmt: skip
            if need_dw and r0 == 0:
                torch.mm(logits.t(), xb, out=dw[v0:v1])
            elif need_dw:
                dw[v0:v1].addmm_(logits.t(), xb)
            if need_dx:
                accumulate_mm(dx_acc, logits, wc, max(_ALIGN, (r1 - r0) // 8))
            if need_db:
                db[v0:v1] += logits.sum(0, dtype=torch.float32)
        if need_dx:
            dx[r0:r1] = dx_acc
    if need_db:
        db = db.to(bias.dtype)
    if rows is not None and need_dx:
        dx = _scatter_rows(dx, rows, n_all)
    return dx, dw, db


@torch.library.custom_op("surgery::linear_cross_entropy_bwd_kept", mutates_args=("logits",))
@_autocast_disabled
def lce_bwd_kept(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef_ce: torch.Tensor,
    coef_z: torch.Tensor,
    logits: torch.Tensor,
    rows: torch.Tensor,
    softcap: float,
    eps: float,
    z_scale: float,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    logit_scale: float = 1.0,
    inv_temperature: float = 1.0,
    entropy: torch.Tensor | None = None,
    coef_entropy: torch.Tensor | None = None,
    vocab_start: int = 0,
    vocab_total: int = 0,
    terms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of the logits ``lce_fwd(keep=True)`` kept, of the rows ``rows`` (its
    ``kept_rows``; empty: every row): their gradient for the upstream coefficients (as
    ``lce_bwd_recompute`` takes them) written in place of them (``logits`` is spent), then the
    two products. ``vocab_start`` / ``vocab_total``: as ``lce_bwd_recompute`` takes them (a
    vocabulary-parallel slice's logits: ``targets`` and ``lse`` the whole vocabulary's).

    ``terms`` (non-empty: ``lce_fwd``'s ``kept_terms``): ``logits`` is a kept Q of
    ``softcap_products`` or a kept unit gradient (one GPU, no z-loss, no entropy's gradient, no
    bias): the products take it as it is with the rows' ``terms.target_terms`` for ``coef_ce``
    (a unit gradient: ``coef_ce`` alone), as the eager schedule's do."""
    n_all = x.shape[0]
    rows = rows if rows.numel() else None
    if rows is not None:
        x, targets, lse, coef_ce, coef_z, entropy, coef_entropy = _rows_of(
            rows, x, targets, lse, coef_ce, coef_z, entropy, coef_entropy
        )  # fmt: skip
    if terms is not None and terms.numel():
        if entropy is not None or bias is not None or z_scale != 0.0 or vocab_total:
            raise ValueError(
                "a kept Q or unit gradient takes the log-probabilities' gradient alone"
            )
        return _kept_q_backward(x, w, targets, lse, coef_ce, logits, terms, softcap,
                                (logit_scale, inv_temperature), need_dx, need_dw, n_all,
                                rows)  # fmt: skip
    _gradient_in_place(logits, targets, lse, coef_ce, coef_z, (softcap, eps, z_scale),
                       (logit_scale, inv_temperature), entropy, coef_entropy, vocab_start,
                       vocab_total or w.shape[0])  # fmt: skip
    dx = torch.mm(logits, w) if need_dx else x.new_empty(0)
    dw = torch.mm(logits.t(), x) if need_dw else x.new_empty(0)
    db = logits.sum(0, dtype=torch.float32).to(bias.dtype) if need_db else x.new_empty(0)
    if rows is not None and need_dx:
        dx = _scatter_rows(dx, rows, n_all)
    return dx, dw, db


def _kept_q_backward(x, w, targets, lse, coef, q, q_rows, cap, transform, need_dx, need_dw,
                     n_all, rows):  # fmt: skip
    """``lce_bwd_kept``'s ``(dx, dw, db)`` from a kept Q and its ``kept_terms`` (or a kept unit
    gradient and its rows' weights, ``q_rows`` of one row): the eager schedule's two gradient
    products (``terms.scaled_dx``, ``scaled_dw``) for ``coef``."""
    v, d = w.shape
    if kept_is_q(q_rows):
        terms = target_terms(coef, lse, q_rows, targets, v, 0.0, cap, transform)
    else:  # the gradient for a unit coefficient: scaled by the row's
        terms = TargetTerms(torch.where(q_rows[0] > 0, coef, 0.0), None, None)
    slice_rows = _rows_for(DEFAULT_CHUNK_BYTES // 4, d * 4, v)
    dx, dw = x.new_empty(0), x.new_empty(0)  # outputs of a custom op may not alias
    if need_dx:
        dx = torch.empty_like(x)
        scaled_dx(q, w, terms, dx, slice_rows)
        if rows is not None:
            dx = _scatter_rows(dx, rows, n_all)
    if need_dw:
        dw = torch.empty_like(w)
        scaled_dw(q, x, terms, dw, False, slice_rows)
    return dx, dw, x.new_empty(0)


# ---------------------------------------------------------------------------------------------
# torch.library ops


@lce_fwd.register_fake
def _(x, w, bias, targets, weights, softcap, eps, z_scale, chunk_bytes, need_dx, need_dw, need_db,
      skip_ignored=False, logit_scale=1.0, inv_temperature=1.0, stats=0, overlap=False,
      keep=False, keep_products=False, fuse=True):  # fmt: skip
    n = x.shape[0]  # keep declined (lce_fwd's docstring)
    grads = weights is not None
    per_tok = [x.new_empty(n, dtype=torch.float32) for _ in range(3)]
    dx = torch.empty_like(x) if grads and need_dx else x.new_empty(0)
    dw = torch.empty_like(w) if grads and need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if grads and need_db and bias is not None else x.new_empty(0)
    statistics = statistics_outputs(statistics_buffers(stats, n, x.device), x)
    kept = (x.new_empty(0), targets.new_empty(0), per_tok[0].new_empty(0))
    return (*per_tok, dx, dw, db, *kept, *statistics)


@lce_bwd_kept.register_fake
def _(x, w, bias, targets, lse, coef_ce, coef_z, logits, rows, softcap, eps, z_scale, need_dx,
      need_dw, need_db, logit_scale=1.0, inv_temperature=1.0, entropy=None, coef_entropy=None,
      vocab_start=0, vocab_total=0, terms=None):  # fmt: skip
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(w) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


@lce_bwd_recompute.register_fake
def _(x, w, bias, targets, lse, coef_ce, coef_z, softcap, eps, z_scale, chunk_bytes, need_dx,
      need_dw, need_db, skip_ignored=False, logit_scale=1.0, inv_temperature=1.0, entropy=None,
      coef_entropy=None, vocab_start=0, vocab_total=0, fused_lse=False,
      live=None):  # fmt: skip
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(w) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db
