"""The softcapped head's logits product with the cross entropy in its epilogue.

With a final softcap every logit the loss sees, x = cap tanh(z / cap), lies in (-cap, cap), so
exp(x - cap) needs no running maximum. The product ``x_rows @ W.T`` (a persistent Triton GEMM
through TMA descriptors) therefore never writes the logits: each tile's epilogue writes

    Q_ij = exp(x_ij - cap) (1 - t_ij^2)        (bf16, t = tanh(z / cap))

and adds the row sums S_i = sum_j exp(x_ij - cap) into an fp32 vector; a small kernel computes
each target's capped logit and 1 - t^2 from its own fp32 dot product. Then lse_i = cap + log S_i,
and the gradient of ``a_i ce_i + b_i zl_i`` (``cross_entropy``'s formulas, no label smoothing) is

    dL/dz_ij = c_i Q_ij - a_i (1 - t_iy^2) [j = y_i],  c_i = A_i / S_i,  A_i = a_i + 2 s lse_i b_i,

a row scale that folds into the two gradient products (dX = diag(c) (Q W), dW = Q^T (diag(c) X))
plus one entry per row, the target's, which ``ops`` adds to each product at fp32 (in Q's units
for dX: -(1 - t_iy^2) S_i a_i / A_i times the target's weight row). Kept apart, the one large
entry of each gradient row is never rounded to bf16: the gradients come out closer to fp32's than
the unfused head's (``benchmarks/results/linear_cross_entropy.json``). The logits are never read
back: against the unfused head this saves the log-sum-exp read and the gradient's read and write
of every chunk (``benchmarks/gemm_epilogue.py``: the Gemma 2 head at 1.02x its three-product floor
where the unfused one took 1.06x).

Where it applies (``applies``): bf16 hidden states and weight, no bias, 0 < cap <= 40 (so that
exp(-2 cap) is a normal fp32 and bf16 number), no label smoothing, logit scale and temperature 1,
no statistics, a z-loss scale small enough that a_i + 2 s lse_i b_i keeps at least half of a_i for
every possible lse (|lse| < log V + cap), rows whose stride TMA can take, and a GPU of compute
capability 9 or later (or the interpreter). Anything else runs the unfused path.
"""

from __future__ import annotations

import functools
import math

import torch

from ..dispatch import cdiv, interpreter_enabled, on_device, triton_available

__all__ = ["MAX_SOFTCAP", "applies", "softcap_products"]

MAX_SOFTCAP = 40.0  # exp(-2 cap) must stay a normal fp32 / bf16 number (> 1.2e-38)

if triton_available():
    import triton
    import triton.language as tl

    from ..cross_entropy.kernel import _tanh, _tanh_instruction

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - a Triton without host descriptors
        TensorDescriptor = None
else:  # pragma: no cover
    triton = TensorDescriptor = None

# Fixed, known-good configuration (H200, three heads: benchmarks/results/gemm_epilogue-*.json):
# 128 x 256 tiles, K steps of 64, 3 stages, 8 warps, the epilogue in two 128-column pieces.
BM, BN, BK, STAGES, WARPS, PIECES, GROUP_M = 128, 256, 64, 3, 8, 2, 8
TARGET_BLOCK_D = 256

softcap_products_kernel = target_logits_kernel = None

if triton is not None:

    @triton.jit
    def _tanh_for(u, INTERP: tl.constexpr):
        if INTERP:  # the interpreter runs no inline assembly
            return _tanh(u)
        return _tanh_instruction(u)

    @triton.jit
    def _rounded(x, dtype: tl.constexpr, INTERP: tl.constexpr):
        """fp32 to ``dtype`` to nearest even: the GPU's conversion. The interpreter's truncates,
        so there the bf16 rounding is done on the bits first (finite values)."""
        if INTERP:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _tile(tile, num_m, num_n, GROUP: tl.constexpr):
        """Grouped order of the (row, column) tiles: GROUP row tiles share each weight tile."""
        in_group = GROUP * num_n
        first_m = (tile // in_group) * GROUP
        size_m = min(num_m - first_m, GROUP)
        return first_m + (tile % size_m), (tile % in_group) // size_m

    @triton.jit
    def _epilogue(acc, q_desc, s_ptr, off_m, off_n, M, N, cap, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
        """Q of one (BLOCK_M, BLOCK_N) piece stored, its rows' sums of exp(x - cap) added to S."""
        c = cap * 1.4426950408889634  # exp(x - cap) = 2^(t C - C), C = cap log2(e)
        t = _tanh_for(acc * (1.0 / cap), INTERP)
        e = tl.exp2(t * c - c)
        if not EVEN_N:
            e = tl.where((off_n + tl.arange(0, BLOCK_N))[None, :] < N, e, 0.0)
        q_desc.store([off_m, off_n], _rounded(e * (1.0 - t * t), q_desc.dtype, INTERP))
        rows = off_m + tl.arange(0, BLOCK_M)
        tl.atomic_add(s_ptr + rows, tl.sum(e, 1), mask=rows < M, sem="relaxed")

    @triton.jit
    def softcap_products_kernel(x_desc, w_desc, q_desc, s_ptr, M, N, K, cap,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                                NUM_PROGRAMS: tl.constexpr, EVEN_N: tl.constexpr,
                                INTERP: tl.constexpr):  # fmt: skip
        """Q and S (the module docstring) of x (M x K) and W (N x K), persistent over the tiles;
        each tile's epilogue in two column halves (fewer live registers)."""
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
            _epilogue(left, q_desc, s_ptr, off_m, off_n, M, N, cap, BLOCK_M, BLOCK_N // 2,
                      EVEN_N, INTERP)  # fmt: skip
            _epilogue(right, q_desc, s_ptr, off_m, off_n + BLOCK_N // 2, M, N, cap, BLOCK_M,
                      BLOCK_N // 2, EVEN_N, INTERP)  # fmt: skip

    @triton.jit
    def target_logits_kernel(x_ptr, w_ptr, t_ptr, xy_ptr, dy_ptr, K, N, stride_x, stride_w, cap,
                             BLOCK_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """Per row: the target's capped logit cap t and 1 - t^2, from the fp32 dot product of the
        row and the target's weight row; 0 and 0 for a row without a target (outside [0, N))."""
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
        t = _tanh_for(tl.sum(acc, 0) * (1.0 / cap), INTERP)
        tl.store(xy_ptr + row, tl.where(valid, cap * t, 0.0))
        tl.store(dy_ptr + row, tl.where(valid, 1.0 - t * t, 0.0))


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


def applies(x, w, bias, softcap, eps, z_scale, logit_scale, inv_temperature, stats) -> bool:
    """Whether ``lce_fwd``'s chunks can take the fused product (the module docstring's list)."""
    if TensorDescriptor is None or softcap_products_kernel is None:
        return False
    if not (0.0 < softcap <= MAX_SOFTCAP) or eps != 0.0 or stats:
        return False
    if logit_scale != 1.0 or inv_temperature != 1.0 or bias is not None:
        return False
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.shape[0] == 0:
        return False
    # a + 2 s lse b >= a / 2 for every lse in (log V - cap, log V + cap) when a = b
    if 2.0 * z_scale * (math.log(w.shape[0]) + softcap) > 0.5:
        return False
    if not (_tma_rows(x) and _tma_rows(w)):
        return False
    if x.is_cuda:
        return w.device == x.device and _capability_ok(x.device.index or 0)
    return x.device.type == "cpu" and interpreter_enabled()


def softcap_products(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float):
    """``(q, s, x_y, d_y)`` of the module docstring for rows ``x`` (n, D) and weight ``w``
    (V, D): Q (n, V) bf16 (its rows padded to a multiple of 8 elements, as TMA needs), S, each
    target's capped logit and 1 - t^2 (fp32, n; 0 for rows without a target). Call only where
    ``applies``."""
    n, d = x.shape
    v = w.shape[0]
    padded = cdiv(v, 8) * 8
    q = torch.empty(n, padded, dtype=x.dtype, device=x.device)[:, :v]
    s = torch.zeros(n, dtype=torch.float32, device=x.device)
    x_y = torch.empty(n, dtype=torch.float32, device=x.device)
    d_y = torch.empty(n, dtype=torch.float32, device=x.device)
    interp = not x.is_cuda
    programs = 4 if interp else torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(programs, cdiv(n, BM) * cdiv(v, BN))
    with on_device(x):
        softcap_products_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [BM, BK]),
            TensorDescriptor.from_tensor(w, [BN, BK]),
            TensorDescriptor.from_tensor(q, [BM, BN // PIECES]),
            s, n, v, d, float(cap),
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP=GROUP_M, NUM_PROGRAMS=programs,
            EVEN_N=v % (BN // PIECES) == 0, INTERP=interp, num_stages=STAGES, num_warps=WARPS,
        )  # fmt: skip
        target_logits_kernel[(n,)](
            x, w, targets, x_y, d_y, d, v, x.stride(0), w.stride(0), float(cap),
            BLOCK_K=TARGET_BLOCK_D, INTERP=interp, num_warps=4,
        )  # fmt: skip
    return q, s, x_y, d_y
