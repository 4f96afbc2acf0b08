"""The head's logits product with the cross entropy in its epilogue: one persistent Triton GEMM
(TMA descriptors, Hopper and later) of ``x_rows @ W.T`` whose tiles never reach memory as logits.
Its three epilogues, by schedule (the package docstring names the schedules):

* ``softcap_products`` (the eager and kept schedules, softcapped heads). Every logit the loss
  sees, x = cap tanh(z / cap), lies in (-cap, cap), so exp(x - r) for a fixed reference r
  (``cap_reference``: the cap itself up to 40) needs no running maximum: the tile writes
  Q = exp(x - r) (1 - t^2) in bf16 (t = tanh(z / cap)) and its rows' sums of exp(x_j - r) per
  128-column piece, added on the host in one order (deterministic, no atomics) into S;
  lse = r + log S, and the gradient of
  ``a ce + b zl`` (``cross_entropy``'s formulas, no label smoothing) is

      dL/dz_ij = c_i Q_ij - a_i (1 - t_iy^2) [j = y_i], c_i = A_i / S_i, A_i = a_i + 2 s lse_i b_i:

  a row scale that folds into the two gradient products (dX = diag(c) (Q W), dW = Q^T (diag(c) X))
  plus one entry per row, the target's, which ``ops`` adds to each product at fp32. Kept apart,
  the one large entry of each gradient row is never rounded to bf16: the gradients come out closer
  to fp32's than the unfused head's. Q holds no coefficient (c_i and the target's entry are the
  rows' alone), so the kept schedule keeps Q, not the logits, from the forward to a backward that
  learns a and b only then. Against the unfused head this saves the log-sum-exp read and
  the gradient's read and write of each chunk (the Gemma 2 head at 1.02-1.04x its three-product
  floor where the unfused one took 1.09-1.16x: ``benchmarks/results/linear_cross_entropy-h200-*``).
* ``lse_products`` (the recompute schedule's forward, and any forward without gradients): no
  store but the pieces' statistics: the rows' sums of exp(x - r) (a softcap within
  ``MAX_SOFTCAP``), or their maximum and sum of exp(x - max) (any other) per 128-column piece,
  combined into the log-sum-exp.
* ``grad_products`` (the recompute schedule's backward, per vocabulary slice): lse known, the tile
  writes the logit gradient d_ij (A_i p_ij - a_i [j = y_i] - e_i p_ij (x_ij - lse_i + h_i)) itself
  (p = exp(x - lse), d = 1 - t^2, or 1 without a softcap; the last term, an entropy h's gradient
  with upstream e, only where asked), where the unfused backward wrote the logits and swept them.

The first two also gather ``STATISTICS`` where asked, one fp32 plane of (rows, pieces) each
(``PLANE_BITS``): sum e (x - r) with e = exp(x - r) for the sums' reference r (the entropy,
log s - that / s), sum exp(2 (x - m)) for the piece's maximum m (log sum p^2), sum x (the mean
logit) and the piece's first column holding m (``is_top1``, ``predicted``: the first piece holding
the row's maximum, as argmax takes the first), combined per row on the host.

Each row's target logit (and 1 - t^2) comes from its own fp32 dot product (``target_logits``).
The logits are fp32 inside the product (not rounded to bf16 first, as the unfused head's are).

A logit scale s and a temperature T (``transform`` = (s, 1 / T)) enter where the tile makes its
logits (``logit_map``): x = (cap / T) tanh(s z / cap), or s z / T without a softcap, so every
epilogue above holds with cap / T in place of cap, and dx/dz gains the factor s / T, folded into
the rows' coefficients (A, a, e) on the host. The log-sum-exp by the pieces' sums of exp(x - r)
takes scaled caps up to ``MAX_SOFTCAP``; past it, the pieces' maxima, as without a softcap.

Where it applies (``applies``): bf16 hidden states and weight, no bias, no label smoothing,
finite s and T > 0, rows of a multiple of 16 bytes (an offset view is copied first), a GPU
of compute capability 9 or later (or the interpreter); for
``softcap_products`` also 0 < cap / T <= 60 (``cap_reference``: the least term exp(-80), a
normal fp32 and bf16 number, the greatest exp(40)) and a z-loss scale with which A_i keeps at
least half of a_i for every possible lse (|lse| < log V + cap / T). Anything else runs unfused,
as does everything with ``SURGERY_FUSED_PRODUCTS=0``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from ..cross_entropy import STATISTICS
from ..dispatch import cdiv, interpreter_enabled, on_device, triton_available

__all__ = [
    "MAX_SOFTCAP",
    "applies",
    "cap_reference",
    "grad_products",
    "logit_map",
    "lse_products",
    "options_apply",
    "softcap_products",
    "statistics_row_bytes",
    "target_logits",
    "tensors_apply",
    "tma_ready",
]

# The sums by the cap: their least term exp(-cap / T - r) no smaller than exp(-LEAST_EXPONENT),
# a normal fp32 / bf16 number (> 1.2e-38) with room to spare, their greatest exp(cap / T - r) no
# larger than exp(2 MAX_SOFTCAP - LEAST_EXPONENT) (``cap_reference``).
LEAST_EXPONENT = 80.0
MAX_SOFTCAP = 60.0
ENABLED = os.environ.get("SURGERY_FUSED_PRODUCTS", "1") != "0"
"""``SURGERY_FUSED_PRODUCTS=0`` (read at import) leaves every head to the unfused path: cuBLAS's
products and the row kernels, for a comparison or to rule the fused products out."""
SOFTCAP_Q, LSE, GRAD = 0, 1, 2  # the kernel's EPILOGUE
# The kernel's STATS: a plane of per-piece sums each (``_piece_statistics``), by the statistic it
# serves: sum e (x - r) (entropy), sum exp(2 (x - max)), sum x, the first maximum's column.
PLANE_BITS = {"entropy": 1, "log_sum_sq_probs": 2, "mean_logits": 4, "is_top1": 8, "predicted": 8}
NEEDS_MAXIMA = PLANE_BITS["log_sum_sq_probs"] | PLANE_BITS["is_top1"]  # the kernel's STATS & 10

if triton_available():
    import triton
    import triton.language as tl

    from ..cross_entropy.kernel import _tanh, _tanh_instruction
    from ..rounding import round_to

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - a Triton without host descriptors
        TensorDescriptor = None
else:  # pragma: no cover
    triton = TensorDescriptor = None

# Fixed, known-good configuration (H200, three heads: benchmarks/results/gemm_epilogue-*.json):
# 128 x 256 tiles, K steps of 64, 3 stages, 8 warps, the epilogue in two 128-column pieces.
BM, BN, BK, STAGES, WARPS, GROUP_M = 128, 256, 64, 3, 8, 8
PIECE = BN // 2
TARGET_BLOCK_D = 256

head_products_kernel = target_logits_kernel = None

if triton is not None:

    @triton.jit
    def _tanh_for(u, INTERP: tl.constexpr):
        if INTERP:  # the interpreter runs no inline assembly
            return _tanh(u)
        return _tanh_instruction(u)

    @triton.jit
    def _tile(tile, num_m, num_n, GROUP: tl.constexpr):
        """Grouped order of the (row, column) tiles: GROUP row tiles share each weight tile."""
        in_group = GROUP * num_n
        first_m = (tile // in_group) * GROUP
        size_m = min(num_m - first_m, GROUP)
        return first_m + (tile % size_m), (tile % in_group) // size_m

    @triton.jit
    def _piece_statistics(x, xm, e, ref, cols, live, slot, row_a, planes, plane, N,
                          STATS: tl.constexpr, STORE_MAX: tl.constexpr,
                          EVEN_N: tl.constexpr):  # fmt: skip
        """A piece's statistics, one plane each (``STATS``' bits, ``PLANE_BITS``; the planes of
        the bits set, in their order): ``x`` the logits, ``xm`` the same with -inf past N, ``e`` =
        exp(x - ref) (0 past N) for the rows' reference ``ref`` (``cap_reference``, or the piece's
        maximum). ``STORE_MAX``: the piece's maximum into ``row_a`` (by the cap, BY_CAP; by the
        maxima the log-sum-exp has stored it)."""
        if STATS & 1:  # sum e (x - ref): the entropy
            tl.store(planes + slot, tl.sum(e * (x - ref[:, None]), 1), mask=live)
        if STATS & 10:  # NEEDS_MAXIMA
            m = tl.max(xm, 1)
            if STORE_MAX:
                tl.store(row_a + slot, m, mask=live)
            if STATS & 2:  # sum exp(2 (x - m)), each term <= 1 (a piece past N: 0)
                shift = tl.where(m == float("-inf"), 0.0, ref - m)
                u = e * tl.exp2(shift * 1.4426950408889634)[:, None]
                at = (STATS & 1) * plane
                tl.store(planes + at + slot, tl.sum(u * u, 1), mask=live)
            if STATS & 8:  # the first maximum's column (is_top1, predicted): the maximum's and
                # a minimum's reductions cost less than tl.argmax's reduction of (value, index)
                # pairs (benchmarks/results/fused_statistics-h200-*)
                at_max = tl.where(xm == m[:, None], cols[None, :], N)
                first = tl.min(at_max, 1)
                at = ((STATS & 1) + (STATS >> 1 & 1) + (STATS >> 2 & 1)) * plane
                tl.store(planes + at + slot, first.to(tl.float32), mask=live)
        if STATS & 4:  # sum x: the mean logit
            xs = x if EVEN_N else tl.where(cols[None, :] < N, x, 0.0)
            at = ((STATS & 1) + (STATS >> 1 & 1)) * plane
            tl.store(planes + at + slot, tl.sum(xs, 1), mask=live)

    @triton.jit
    def _epilogue(acc, out_desc, off_m, off_n, M, N, z_mul, x_cap, x_ref, row_a, row_b, planes,
                  plane, col_offset, EPILOGUE: tl.constexpr, SOFTCAP: tl.constexpr,
                  SCALED: tl.constexpr, BY_CAP: tl.constexpr, STATS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
        """One (BLOCK_M, BLOCK_N) piece of the tile, by EPILOGUE (the module docstring). The
        logits: x = x_cap tanh(acc z_mul) (SOFTCAP), acc z_mul (SCALED) or acc (``logit_map``).
        The row pointers: SOFTCAP_Q, and LSE by the cap (BY_CAP), row_b = the pieces' sums of
        exp(x - x_ref) (``cap_reference``) and row_a their maxima (stored where STATS asks for
        them); LSE by the maxima, row_a = the pieces' maxima, row_b their sums of exp(x -
        maximum) (rows of two pieces per column tile: a piece wholly past N holds -inf and 0);
        ``planes``: STATS' planes of the same shape, ``plane`` words apart. GRAD: row_a = (lse,
        A, a) rows of 3 words, or (lse, A, a, e, h) where STATS (the entropy's gradient, e its
        upstream gradient and h the entropy), row_b = the targets. Each piece's own slot, no
        atomics: the sums are added in one order on the host (deterministic)."""
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        live = rows < M
        # this piece's slot in the (rows, pieces) statistics (SOFTCAP_Q and LSE)
        slot = rows.to(tl.int64) * (2 * tl.cdiv(N, 2 * BLOCK_N)) + off_n // BLOCK_N
        if SOFTCAP:
            t = _tanh_for(acc * z_mul, INTERP)
            x = x_cap * t
        elif SCALED:
            x = acc * z_mul
        else:
            x = acc
        if EPILOGUE == 2:
            words = 5 if STATS else 3
            lse = tl.load(row_a + words * rows, mask=live, other=0.0)
            big_a = tl.load(row_a + words * rows + 1, mask=live, other=0.0)
            small_a = tl.load(row_a + words * rows + 2, mask=live, other=0.0)
            target = tl.load(row_b + rows, mask=live, other=-1)
            p = tl.exp2((x - lse[:, None]) * 1.4426950408889634)
            g = big_a[:, None] * p
            if STATS:  # the entropy's gradient: -e p (x - lse + h)
                e_up = tl.load(row_a + words * rows + 3, mask=live, other=0.0)
                h = tl.load(row_a + words * rows + 4, mask=live, other=0.0)
                g -= e_up[:, None] * p * (x - (lse - h)[:, None])
            hit = (cols + col_offset)[None, :] == target[:, None]
            g = tl.where(hit, g - small_a[:, None], g)
            if SOFTCAP:
                g = g * (1.0 - t * t)
            out_desc.store([off_m, off_n], round_to(g, out_desc.dtype, INTERP))
        elif BY_CAP:
            # exp(x - x_ref) = 2^(t C - R), C = x_cap log2(e), R = x_ref log2(e)
            c = x_cap * 1.4426950408889634
            e = tl.exp2(t * c - x_ref * 1.4426950408889634)
            if not EVEN_N:
                e = tl.where(cols[None, :] < N, e, 0.0)
            if EPILOGUE == 0:
                q = round_to(e * (1.0 - t * t), out_desc.dtype, INTERP)
                out_desc.store([off_m, off_n], q)
            tl.store(row_b + slot, tl.sum(e, 1), mask=live)
            if STATS:
                xm = x if EVEN_N else tl.where(cols[None, :] < N, x, float("-inf"))
                ref = tl.zeros((BLOCK_M,), dtype=tl.float32) + x_ref
                _piece_statistics(x, xm, e, ref, cols, live, slot, row_a, planes, plane,
                                  N, STATS, True, EVEN_N)  # fmt: skip
        else:  # LSE by the maxima: this piece's maximum and sum of exp(x - maximum)
            xm = x if EVEN_N else tl.where(cols[None, :] < N, x, float("-inf"))
            m = tl.max(xm, 1)  # the logits' own maximum: the pieces' order is argmax's
            tl.store(row_a + slot, m, mask=live)
            m = tl.where(m == float("-inf"), 0.0, m)  # a piece wholly past N: a sum of 0
            p = tl.exp2((xm - m[:, None]) * 1.4426950408889634)
            tl.store(row_b + slot, tl.sum(p, 1), mask=live)
            if STATS:
                _piece_statistics(x, xm, p, m, cols, live, slot, row_a, planes, plane, N, STATS,
                                  False, EVEN_N)  # fmt: skip

    @triton.jit
    def head_products_kernel(x_desc, w_desc, out_desc, M, N, K, z_mul, x_cap, x_ref, row_a, row_b,
                             planes, plane, col_offset, EPILOGUE: tl.constexpr,
                             SOFTCAP: tl.constexpr, SCALED: tl.constexpr, BY_CAP: tl.constexpr,
                             STATS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                             NUM_PROGRAMS: tl.constexpr, EVEN_N: tl.constexpr,
                             INTERP: tl.constexpr):  # fmt: skip
        """x (M x K) times W (N x K) transposed, persistent over the tiles, each tile's epilogue
        in two column halves (fewer live registers)."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_steps = tl.cdiv(K, BLOCK_K)
        start = tl.program_id(0)
        tile_out = start - NUM_PROGRAMS
        for tile in tl.range(start, num_m * num_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _tile(tile, num_m, num_n, GROUP)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_steps):
                a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                if INTERP:  # the interpreter's bf16 dot of descriptor loads is wrong: fp32 there
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b.T, acc)
            tile_out += NUM_PROGRAMS
            pid_m, pid_n = _tile(tile_out, num_m, num_n, GROUP)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)),
                                              (0, 2, 1)))  # fmt: skip
            _epilogue(left, out_desc, off_m, off_n, M, N, z_mul, x_cap, x_ref, row_a, row_b,
                      planes, plane, col_offset, EPILOGUE, SOFTCAP, SCALED, BY_CAP, STATS, BLOCK_M,
                      BLOCK_N // 2, EVEN_N, INTERP)  # fmt: skip
            _epilogue(right, out_desc, off_m, off_n + BLOCK_N // 2, M, N, z_mul, x_cap, x_ref,
                      row_a, row_b, planes, plane, col_offset, EPILOGUE, SOFTCAP, SCALED, BY_CAP,
                      STATS, BLOCK_M, BLOCK_N // 2, EVEN_N, INTERP)  # fmt: skip

    @triton.jit
    def target_logits_kernel(x_ptr, w_ptr, t_ptr, xy_ptr, dy_ptr, K, N, stride_x, stride_w,
                             z_mul, x_cap, SOFTCAP: tl.constexpr, SCALED: tl.constexpr,
                             BLOCK_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """Per row: the target's logit as the loss sees it (``_epilogue``'s x) and 1 - t^2 (1
        without a softcap), from the fp32 dot product of the row and the target's weight row; 0
        and 0 for a row without a target (outside [0, N))."""
        row = tl.program_id(0).to(tl.int64)
        y = tl.load(t_ptr + row)
        valid = (y >= 0) & (y < N)
        y = tl.where(valid, y, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m = cols < K  # a row without a target reads row 0 of W, and stores 0
            xv = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + y * stride_w + cols, mask=m, other=0.0).to(tl.float32)
            acc += xv * wv
        z = tl.sum(acc, 0)
        if SOFTCAP:
            t = _tanh_for(z * z_mul, INTERP)
            z = x_cap * t
            d = 1.0 - t * t
        else:
            if SCALED:
                z = z * z_mul
            d = 1.0
        tl.store(xy_ptr + row, tl.where(valid, z, 0.0))
        tl.store(dy_ptr + row, tl.where(valid, d, 0.0))


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _tma_rows(t: torch.Tensor) -> bool:
    """Row-major with unit stride along the row and 16-byte aligned rows (what TMA takes)."""
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def options_apply(v: int, bias, softcap, eps, z_scale, logit_scale, inv_temperature,
                  eager: bool) -> bool:  # fmt: skip
    """The part of ``applies`` that reads no tensor data (a vocabulary of ``v``): what an
    autograd forward can decide while traced, for its backward."""
    if not ENABLED or TensorDescriptor is None or head_products_kernel is None:
        return False
    if eps != 0.0 or bias is not None or not (inv_temperature > 0.0 and softcap >= 0.0):
        return False
    scales = logit_map(softcap, (logit_scale, inv_temperature))
    if not all(math.isfinite(u) for u in (logit_scale, inv_temperature, softcap, *scales)):
        return False
    if not eager:
        return True
    # A = a + 2 s lse b >= a / 2 for every lse in (log V - x_cap, log V + x_cap) when a = b
    x_cap = scales.x_cap
    return _by_cap(x_cap) and not 2.0 * z_scale * (math.log(max(v, 1)) + x_cap) > 0.5


class LogitMap(NamedTuple):
    """How the tile makes the logits the loss sees from its product z (``logit_map``)."""

    z_mul: float  # x = x_cap tanh(z z_mul) with a softcap, z z_mul without
    x_cap: float  # cap / T; 0 without a softcap
    slope: float  # s / T: dx/dz = slope (1 - t^2) with a softcap, slope without


def logit_map(cap: float, transform=(1.0, 1.0)) -> LogitMap:
    """The tile's form of x = (cap / T) tanh(s z / cap), or s z / T without a softcap (cap 0),
    for ``transform`` = (s, 1 / T), the logit scale and the inverse temperature."""
    scale, inv_temperature = transform
    slope = scale * inv_temperature
    if cap > 0:
        return LogitMap(scale / cap, cap * inv_temperature, slope)
    return LogitMap(slope, 0.0, slope)


def _by_cap(x_cap: float) -> bool:
    """Whether the sums of exp(x - r) (``cap_reference``) stay normal fp32 numbers for every x in
    (-x_cap, x_cap) (the log-sum-exp by the cap, and Q; else by the pieces' maxima)."""
    return 0.0 < x_cap <= MAX_SOFTCAP


def cap_reference(x_cap: float) -> float:
    """The reference r of the sums of exp(x - r) over logits in (-x_cap, x_cap), 0 < x_cap <=
    ``MAX_SOFTCAP``: the scaled cap itself up to LEAST_EXPONENT / 2 (every term at most 1), past
    it LEAST_EXPONENT - x_cap, so that the least term stays exp(-LEAST_EXPONENT) and the greatest
    is at most exp(2 MAX_SOFTCAP - LEAST_EXPONENT) = exp(40) (a vocabulary's sum of them, Q's
    entries and the rows' 1 / S all far inside fp32's and bf16's range; the eager schedule's rows
    of X scaled by coef / S, rounded to bf16, lose only products under about 1e-15 at a scaled
    cap of 60). GRPO's Gemma 2 head at temperature 0.7 (x_cap 42.9) takes 37.1."""
    return min(x_cap, LEAST_EXPONENT - x_cap)


def tensors_apply(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The part of ``applies`` on the tensors' metadata (dtype, shape, device: the same for a
    forward and the backward that recomputes from its saved tensors): bf16, rows of a multiple of
    16 bytes, a GPU of compute capability 9 or later (or the interpreter). Rows TMA cannot take
    as they lie (an offset view) are copied first (``tma_ready``), not left unfused: the choice
    does not depend on where a tensor happens to start."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.shape[0] == 0:
        return False
    if x.dim() != 2 or w.dim() != 2 or x.shape[-1] % 8:
        return False
    if x.is_cuda:
        return w.device == x.device and _capability_ok(x.device.index or 0)
    return x.device.type == "cpu" and interpreter_enabled()


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh copy of it where its rows are not laid out as TMA needs."""
    return t if _tma_rows(t) else t.clone(memory_format=torch.contiguous_format)


def statistics_row_bytes(v: int, stats: int = 0) -> int:
    """Bytes per row of ``lse_products``' statistics (two fp32 words per 128 columns, and one
    more per plane that ``stats`` asks for)."""
    return 2 * 4 * (2 + _plane_bits(stats).bit_count()) * cdiv(v, BN)


def applies(x, w, bias, softcap, eps, z_scale, logit_scale, inv_temperature,
            eager: bool) -> bool:  # fmt: skip
    """Whether the fused products can take this head (the module docstring's list);
    ``eager``: for ``softcap_products``, else for ``lse_products`` / ``grad_products``."""
    return options_apply(w.shape[0], bias, softcap, eps, z_scale, logit_scale, inv_temperature,
                         eager) and tensors_apply(x, w)  # fmt: skip


def _launch(x, w, out, cap, row_a, row_b, col_offset, epilogue, planes=None, bits=0,
            transform=(1.0, 1.0)):  # fmt: skip
    n, d = x.shape
    v = w.shape[0]
    z_mul, x_cap, _ = logit_map(cap, transform)
    x_ref = cap_reference(x_cap) if _by_cap(x_cap) else 0.0
    interp = not x.is_cuda
    programs = 4 if interp else torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(programs, cdiv(n, BM) * cdiv(v, BN))
    if out is None:  # no store (LSE): a descriptor the kernel never uses
        out = x
    plane = 0 if planes is None else planes.stride(0)
    with on_device(x):
        head_products_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [BM, BK]),
            TensorDescriptor.from_tensor(w, [BN, BK]),
            TensorDescriptor.from_tensor(out, [BM, PIECE]),
            n, v, d, float(z_mul), float(x_cap), float(x_ref), row_a, row_b,
            row_b if planes is None else planes, plane, col_offset, EPILOGUE=epilogue,
            SOFTCAP=cap > 0, SCALED=cap == 0 and z_mul != 1.0,
            BY_CAP=epilogue != GRAD and _by_cap(x_cap), STATS=bits,
            BLOCK_M=BM, BLOCK_N=BN,
            BLOCK_K=BK, GROUP=GROUP_M, NUM_PROGRAMS=programs, EVEN_N=v % BN == 0,
            INTERP=interp, num_stages=STAGES, num_warps=WARPS,
        )  # fmt: skip


def _rows_out(n: int, v: int, like: torch.Tensor) -> torch.Tensor:
    """An (n, v) buffer whose rows are padded to a multiple of 8 elements (16 bytes: TMA)."""
    return torch.empty(n, cdiv(v, 8) * 8, dtype=like.dtype, device=like.device)[:, :v]


def target_logits(x, w, targets, cap: float, transform=(1.0, 1.0)):
    """(x_y, d_y), fp32 per row: the target's logit as the loss sees it (``logit_map``) and
    1 - t^2 (1 without a softcap); 0 and 0 for a row without a target."""
    n, d = x.shape
    z_mul, x_cap, _ = logit_map(cap, transform)
    x_y = torch.empty(n, dtype=torch.float32, device=x.device)
    d_y = torch.empty(n, dtype=torch.float32, device=x.device)
    with on_device(x):
        target_logits_kernel[(n,)](
            x, w, targets, x_y, d_y, d, w.shape[0], x.stride(0), w.stride(0), float(z_mul),
            float(x_cap), SOFTCAP=cap > 0, SCALED=cap == 0 and z_mul != 1.0,
            BLOCK_K=TARGET_BLOCK_D, INTERP=not x.is_cuda, num_warps=4,
        )  # fmt: skip
    return x_y, d_y


def _pieces(n: int, v: int, device, planes: int = 0) -> torch.Tensor:
    """(n, pieces) fp32: a slot per row and 128-column piece, two per 256-column tile; with
    ``planes``, (planes, n, pieces)."""
    shape = (planes,) * bool(planes) + (n, 2 * cdiv(v, BN))
    return torch.empty(shape, dtype=torch.float32, device=device)


def _plane_bits(stats: int) -> int:
    """The kernel's ``STATS`` (bits of ``PLANE_BITS``) for ``stats``, a bit mask of
    ``STATISTICS``."""
    return sum({PLANE_BITS[name] for i, name in enumerate(STATISTICS) if stats >> i & 1})


class _Pieces(NamedTuple):
    """A launch's per-piece statistics: ``sums`` of exp(x - ``ref``) for the reference ``ref``
    (``cap_reference``, where ``_by_cap``), or of exp(x - maxima) (``ref`` 0), the pieces'
    ``maxima`` (where computed), the planes of ``PLANE_BITS`` asked for."""

    sums: torch.Tensor
    maxima: torch.Tensor | None
    planes: torch.Tensor | None
    ref: float


def _launch_pieces(x, w, out, cap: float, epilogue: int, stats: int, transform) -> _Pieces:
    n, v = x.shape[0], w.shape[0]
    bits = _plane_bits(stats)
    x_cap = logit_map(cap, transform).x_cap
    ref = cap_reference(x_cap) if _by_cap(x_cap) else 0.0
    sums = _pieces(n, v, x.device)
    maxima = _pieces(n, v, x.device) if ref == 0 or bits & NEEDS_MAXIMA else None
    planes = _pieces(n, v, x.device, bits.bit_count()) if bits else None
    _launch(x, w, out, cap, sums if maxima is None else maxima, sums, 0, epilogue, planes, bits,
            transform)  # fmt: skip
    return _Pieces(sums, maxima, planes, ref)


def _row_statistics(pieces: _Pieces, stats: int, v: int, lse, s) -> dict:
    """The rows' ``STATISTICS`` asked for by ``stats`` from the pieces' (``predicted``, int64,
    in place of ``is_top1`` too), for every row (``ops`` masks those without a target); ``lse``
    and ``s`` = sum exp(x - ref) (the pieces' ``ref``) or exp(x - max) (ref 0) the rows' own."""
    names = {name for i, name in enumerate(STATISTICS) if stats >> i & 1}
    bits = _plane_bits(stats)
    out, (sums, maxima, planes, ref) = {}, pieces
    planes = dict(zip(sorted(b for b in set(PLANE_BITS.values()) if bits & b),
                      planes if bits else ()))  # fmt: skip
    top = None if maxima is None else maxima.amax(1, keepdim=True)
    if "entropy" in names:  # H = log s - sum e (x - r) / s, both relative to one reference r
        t = planes[1]
        if ref > 0:  # r = the scaled cap's reference in every piece
            t = t.sum(1)
        else:  # r = the piece's maximum: moved to the row's, pieces past V (-inf, 0) add 0
            scale = (maxima - top).exp()
            t = ((t + torch.where(sums > 0, (maxima - top) * sums, 0.0)) * scale).sum(1)
        out["entropy"] = s.log() - t / s
    if "log_sum_sq_probs" in names:  # log sum exp(2 (x - lse))
        squares = (planes[2] * (2.0 * (maxima - top)).exp()).sum(1)
        out["log_sum_sq_probs"] = squares.log() + 2.0 * (top[:, 0] - lse)
    if "mean_logits" in names:
        out["mean_logits"] = planes[4].sum(1) / v
    if names & {"is_top1", "predicted"}:  # the first piece holding the row's maximum
        first = maxima.argmax(1, keepdim=True)
        out["predicted"] = planes[8].gather(1, first)[:, 0].to(torch.int64)
    return out


def softcap_products(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float,
                     stats: int = 0, transform=(1.0, 1.0)):  # fmt: skip
    """``(q, s, x_y, d_y, statistics)`` for rows ``x`` (n, D) and weight ``w`` (V, D), cap > 0:
    Q (n, V) bf16 and S for the scaled cap's reference (``cap_reference``; the log-sum-exp is
    that plus log S), ``target_logits`` and the
    ``STATISTICS`` asked for by ``stats`` (``_row_statistics``). Call only where ``applies(...,
    eager=True)``."""
    n, v = x.shape[0], w.shape[0]
    if not _by_cap(logit_map(cap, transform).x_cap):
        raise ValueError(f"softcap_products needs 0 < cap / T <= {MAX_SOFTCAP}")
    q = _rows_out(n, v, x)
    pieces = _launch_pieces(x, w, q, cap, SOFTCAP_Q, stats, transform)
    s = pieces.sums.sum(1)
    values = _row_statistics(pieces, stats, v, pieces.ref + s.log(), s)
    return q, s, *target_logits(x, w, targets, cap, transform), values


def lse_products(x: torch.Tensor, w: torch.Tensor, cap: float, stats: int = 0,
                 transform=(1.0, 1.0)):  # fmt: skip
    """``(lse, statistics)``: the rows' log-sum-exp of the logits the loss sees (fp32, n;
    ``logit_map``) and the ``STATISTICS`` asked for by ``stats`` (``_row_statistics``), storing
    no logits (``statistics_row_bytes``). Call only where ``applies(..., eager=False)``."""
    v = w.shape[0]
    pieces = _launch_pieces(x, w, None, cap, LSE, stats, transform)
    if pieces.ref > 0:
        s = pieces.sums.sum(1)
        lse = s.log() + pieces.ref
    else:
        top = pieces.maxima.amax(1)
        s = (pieces.sums * (pieces.maxima - top[:, None]).exp()).sum(1)
        lse = top + s.log()
    return lse, _row_statistics(pieces, stats, v, lse, s)


def grad_products(x, w, targets, lse, big_a, small_a, cap: float, col_offset: int = 0,
                  entropy=None, coef_entropy=None, transform=(1.0, 1.0)):  # fmt: skip
    """The logit gradient (n, V) in x's dtype of the columns ``[col_offset, col_offset + V)``
    whose weight rows are ``w``: k d (A p - a [j = y] - e p (x - lse + h)) per row, p = exp(x -
    lse) (``A``, ``a``, ``e`` = ``coef_entropy``: fp32 (n,), 0 on rows without a target; the
    last term only where ``entropy``, h, is given; x and k = s / T by ``logit_map``). Call only
    where ``applies(..., eager=False)``."""
    n, v = x.shape[0], w.shape[0]
    k = logit_map(cap, transform).slope
    if k != 1.0:  # dx/dz's factor, folded into the rows' coefficients
        big_a, small_a = big_a * k, small_a * k
        coef_entropy = None if coef_entropy is None else coef_entropy * k
    words = [lse, big_a, small_a] + ([] if entropy is None else [coef_entropy, entropy])
    rows = torch.stack(words, 1).contiguous()
    out = _rows_out(n, v, x)
    _launch(x, w, out, cap, rows, targets, col_offset, GRAD, bits=int(entropy is not None),
            transform=transform)  # fmt: skip
    return out
