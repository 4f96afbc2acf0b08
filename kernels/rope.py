"""Position-aware rotary embedding (RoPE), rotate-half layout.

Order (STYLE.md 2): Triton kernels -> host launchers (``rope_fwd``, ``rope_bwd``,
``rope_cos_sin_fwd``, ``rope_cos_sin_bwd``) -> torch.library ops with their autograd ->
``apply_rope`` and ``apply_rotary_pos_emb``, with the reference ``apply_rope_reference`` last.

For channel pairs (j, j + r/2), j < r/2, of the first r = ``rotary_dim`` channels of each head:

    angle  = float32(position) * inv_freq[j]                    (fp32, exactly as transformers)
    out_j        = s (x_j cos(angle) - x_{j+r/2} sin(angle))
    out_{j+r/2}  = s (x_{j+r/2} cos(angle) + x_j sin(angle))     (s = attention_scaling)

and channels r..D-1 pass through unchanged. The map is a scaled rotation, so its backward is the
same kernel with the angle negated: dx = s R(-angle) dout.

``apply_rope`` computes cos/sin in the kernel from ``position_ids``, once per (token, frequency)
and reused across every head of q and k in the program, so no (B, T, D) cos/sin tensors exist,
and packed rows whose positions restart at 0 (or start at a cache offset) are rotated right.
On NVIDIA GPUs cos/sin come from the SFU after a range reduction to [-pi, pi]: absolute error
below 1e-6, invisible next to bf16/fp16 rounding (2e-3/2.4e-4) and to the fp32 rounding of the
angle itself (position * 6e-8 rad) that transformers' own path carries too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .dispatch import cdiv, interpreter_enabled, next_power_of_2, triton_available, use_triton
from .launch import FastLauncher
from .rounding import round_to

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = [
    "RopeLaunch",
    "apply_rope",
    "apply_rope_reference",
    "apply_rotary_pos_emb",
    "rope_bwd",
    "rope_cos_sin_bwd",
    "rope_cos_sin_fwd",
    "rope_fwd",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def _cos_sin_sfu(angle):
        # cos/sin of fp32 angles in ~10 instructions instead of libdevice's ~40 plus a slow path:
        # reduce to [-pi, pi] with 2*pi split in two (the FMAs keep k * 2pi_hi exact, so the
        # residue is right to ~1e-7 for any angle a position reaches), then the SFU's sin/cos,
        # absolute error < 2**-20.9 on [-pi, pi]: far below bf16/fp16 rounding, and below the
        # fp32 rounding of the angle itself beyond the first positions.
        k = tl.floor(angle * 0.15915494309189535 + 0.5)
        r = tl.fma(-k, 6.2831854820251465, angle)
        r = tl.fma(-k, -1.7484556025237907e-07, r)
        cos = tl.inline_asm_elementwise(
            "cos.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        sin = tl.inline_asm_elementwise(
            "sin.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        return cos, sin

    @triton.jit
    def _rotate_block(
        x_ptr,
        o_ptr,
        h0,
        n_heads,
        sx_h,
        sx_t,
        sx_d,
        so_h,
        so_t,
        so_d,
        t3,
        mask_t3,
        cos_lo,
        sin_lo,
        cos_hi,
        sin_hi,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        # One [BLOCK_T, BLOCK_H, HALF] tile per half of the rotated channels; x and o already
        # point at this program's batch row. 64-bit offsets: a (B, H, T, D) view of a large
        # (B, T, H, D) buffer has offsets past 2**31.
        h3 = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        mask = mask_t3 & (h3 < n_heads)
        f3 = tl.arange(0, HALF_PAD)[None, None, :]
        if HALF != HALF_PAD:
            mask_f = mask & (f3 < HALF)
        else:
            mask_f = mask
        x_lo = x_ptr + t3 * sx_t + h3 * sx_h + f3 * sx_d
        o_lo = o_ptr + t3 * so_t + h3 * so_h + f3 * so_d
        x1 = tl.load(x_lo, mask=mask_f, other=0.0).to(tl.float32)
        x2 = tl.load(x_lo + HALF * sx_d, mask=mask_f, other=0.0).to(tl.float32)
        out_ty = o_ptr.dtype.element_ty
        out_lo = round_to(x1 * cos_lo - x2 * sin_lo, out_ty, INTERPRETED)
        out_hi = round_to(x2 * cos_hi + x1 * sin_hi, out_ty, INTERPRETED)
        tl.store(o_lo, out_lo, mask=mask_f)
        tl.store(o_lo + HALF * so_d, out_hi, mask=mask_f)
        if PASS > 0:
            # Channels past rotary_dim are copied: the output is a new tensor.
            p3 = 2 * HALF + tl.arange(0, PASS_PAD)[None, None, :]
            mask_p = mask & (p3 < 2 * HALF + PASS)
            xp = tl.load(x_ptr + t3 * sx_t + h3 * sx_h + p3 * sx_d, mask=mask_p, other=0.0)
            tl.store(o_ptr + t3 * so_t + h3 * so_h + p3 * so_d, xp.to(out_ty), mask=mask_p)

    @triton.jit
    def _rotate_q_and_k(
        q_ptr,
        k_ptr,
        oq_ptr,
        ok_ptr,
        pid_b,
        n_q_heads,
        n_k_heads,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        soq_b,
        soq_h,
        soq_t,
        soq_d,
        sok_b,
        sok_h,
        sok_t,
        sok_d,
        t3,
        mask_t3,
        cos_lo,
        sin_lo,
        cos_hi,
        sin_hi,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        # Head blocks of q and k form one list; program g of the head-group axis takes blocks
        # g, g + G, ... so a split stays balanced between q and k (GQA: k has fewer heads).
        n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
        n_blocks = n_q_blocks + tl.cdiv(n_k_heads, BLOCK_H)
        q_ptr += pid_b * sq_b
        k_ptr += pid_b * sk_b
        oq_ptr += pid_b * soq_b
        ok_ptr += pid_b * sok_b
        for j in range(tl.program_id(1), n_blocks, tl.num_programs(1)):
            if j < n_q_blocks:
                _rotate_block(q_ptr, oq_ptr, j * BLOCK_H, n_q_heads, sq_h, sq_t, sq_d,
                              soq_h, soq_t, soq_d, t3, mask_t3, cos_lo, sin_lo, cos_hi, sin_hi,
                              HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, INTERPRETED)  # fmt: skip
            else:
                _rotate_block(k_ptr, ok_ptr, (j - n_q_blocks) * BLOCK_H, n_k_heads, sk_h, sk_t,
                              sk_d, sok_h, sok_t, sok_d, t3, mask_t3, cos_lo, sin_lo, cos_hi,
                              sin_hi, HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H,
                              INTERPRETED)  # fmt: skip

    @triton.jit
    def rope_fwd_kernel(
        q_ptr,
        k_ptr,
        oq_ptr,
        ok_ptr,
        pos_ptr,
        inv_freq_ptr,
        T,
        n_q_heads,
        n_k_heads,
        scale,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        soq_b,
        soq_h,
        soq_t,
        soq_d,
        sok_b,
        sok_h,
        sok_t,
        sok_d,
        spos_b,
        spos_t,
        s_inv,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        INVERSE: tl.constexpr,
        SFU_TRIG: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """Grid (token blocks, head groups, batch). INVERSE rotates by -angle (the backward)."""
        pid_b = tl.program_id(2).to(tl.int64)
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        pos = tl.load(pos_ptr + pid_b * spos_b + offs_t * spos_t, mask=mask_t, other=0)
        f = tl.arange(0, HALF_PAD)
        inv_freq = tl.load(inv_freq_ptr + f * s_inv, mask=f < HALF, other=0.0).to(tl.float32)
        # Same fp32 product as transformers' rotary modules, so angles agree bit for bit.
        angle = pos.to(tl.float32)[:, None, None] * inv_freq[None, None, :]
        if SFU_TRIG:
            cos, sin = _cos_sin_sfu(angle)
        else:
            cos, sin = tl.cos(angle), tl.sin(angle)
        cos = cos * scale
        sin = sin * scale
        if INVERSE:
            sin = -sin
        t3 = offs_t.to(tl.int64)[:, None, None]
        _rotate_q_and_k(q_ptr, k_ptr, oq_ptr, ok_ptr, pid_b, n_q_heads, n_k_heads,
                        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
                        soq_b, soq_h, soq_t, soq_d, sok_b, sok_h, sok_t, sok_d,
                        t3, mask_t[:, None, None], cos, sin, cos, sin,
                        HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, INTERPRETED)  # fmt: skip

    @triton.jit
    def rope_cos_sin_kernel(
        q_ptr,
        k_ptr,
        oq_ptr,
        ok_ptr,
        cos_ptr,
        sin_ptr,
        T,
        n_q_heads,
        n_k_heads,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        soq_b,
        soq_h,
        soq_t,
        soq_d,
        sok_b,
        sok_h,
        sok_t,
        sok_d,
        sc_b,
        sc_t,
        sc_d,
        ss_b,
        ss_t,
        ss_d,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS: tl.constexpr,
        PASS_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """q * cos + rotate_half(q) * sin with cos/sin rows (B|1, T, r) read once per program.

        Both halves of cos and sin are read, so any cos/sin (not only [c, c] / [s, s]) gives
        transformers' formula; TRANSPOSE applies the transposed map (the backward).
        """
        pid_b = tl.program_id(2).to(tl.int64)
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        t3 = offs_t.to(tl.int64)[:, None, None]
        f3 = tl.arange(0, HALF_PAD)[None, None, :]
        mask = mask_t[:, None, None] & (f3 < HALF)
        c_lo_ptr = cos_ptr + pid_b * sc_b + t3 * sc_t + f3 * sc_d
        s_lo_ptr = sin_ptr + pid_b * ss_b + t3 * ss_t + f3 * ss_d
        cos_lo = tl.load(c_lo_ptr, mask=mask, other=0.0).to(tl.float32)
        cos_hi = tl.load(c_lo_ptr + HALF * sc_d, mask=mask, other=0.0).to(tl.float32)
        sin_lo = tl.load(s_lo_ptr, mask=mask, other=0.0).to(tl.float32)
        sin_hi = tl.load(s_lo_ptr + HALF * ss_d, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            # dx_lo = g_lo cos_lo + g_hi sin_hi ; dx_hi = g_hi cos_hi - g_lo sin_lo
            sin_tmp = -sin_hi
            sin_hi = -sin_lo
            sin_lo = sin_tmp
        _rotate_q_and_k(q_ptr, k_ptr, oq_ptr, ok_ptr, pid_b, n_q_heads, n_k_heads,
                        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
                        soq_b, soq_h, soq_t, soq_d, sok_b, sok_h, sok_t, sok_d,
                        t3, mask_t[:, None, None], cos_lo, sin_lo, cos_hi, sin_hi,
                        HALF, HALF_PAD, PASS, PASS_PAD, BLOCK_H, INTERPRETED)  # fmt: skip


if triton is not None:
    # Launched directly once compiled (kernels/launch.py): the host time of a launch otherwise
    # exceeds the kernel's GPU time at training shapes.
    _launch_rope = FastLauncher(rope_fwd_kernel)
    _launch_cos_sin = FastLauncher(rope_cos_sin_kernel)


# ---------------------------------------------------------------------------------------------
# Host launchers. Outputs are always new tensors laid out like the input (``empty_like``), so
# transformers' (B, T, H, D) buffer seen as (B, H, T, D) stays (B, T, H, D) underneath.


@dataclass(frozen=True)
class RopeLaunch:
    """Launch configuration (STYLE.md 8). ``head_groups=None`` picks enough programs to fill the
    device; the defaults are the fixed known-good setting, others exist for tests and sweeps.

    Default (bf16, D = 128): tiles of 2 tokens x 32 heads x 64 channel pairs, 4 warps. Chosen
    from the 36-config sweep on the H100 (benchmarks/results/rope.json, `--sweep`): 93-94% of
    copy bandwidth forward and backward on both benchmark shapes, where the earlier default
    (4 tokens, 2048-element tiles) reached only 43% on q (4, 32, 2048, 128).
    """

    block_t: int = 2
    # Elements of one half-tile (BLOCK_T x BLOCK_H x rotary_dim/2); sets BLOCK_H.
    tile_elems: int = 4096
    head_groups: int | None = None
    num_warps: int = 4


DEFAULT_LAUNCH = RopeLaunch()
# The interpreter pays per program and per operation, not per element: few large programs.
INTERPRETER_LAUNCH = RopeLaunch(block_t=32, tile_elems=1 << 14)
# Programs per SM that the automatic head split aims for before it splits heads across programs.
_PROGRAMS_PER_SM = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=512)
def _plan(launch, B, T, Hq, Hk, D, rotary_dim, sm_count):
    """Grid and compile-time meta-parameters ((name, value) pairs) of one launch. Cached: a
    training step launches the same few shapes every layer, and this arithmetic would otherwise
    be a visible part of the host time of a ~0.1 ms kernel. ``sm_count`` is None off CUDA (no
    head split)."""
    half = rotary_dim // 2
    half_pad = next_power_of_2(half)
    block_t = launch.block_t
    block_h = max(1, launch.tile_elems // (block_t * half_pad))
    block_h = min(next_power_of_2(block_h), next_power_of_2(max(Hq, Hk)))
    n_blocks = cdiv(Hq, block_h) + cdiv(Hk, block_h)
    t_blocks = cdiv(T, block_t)
    groups = launch.head_groups
    if groups is None:
        groups = 1
        if sm_count is not None:
            # Short sequences (decode, small batches) would leave SMs idle: split the heads.
            groups = min(n_blocks, max(1, cdiv(_PROGRAMS_PER_SM * sm_count, B * t_blocks)))
    groups = max(1, min(groups, n_blocks))
    pass_dim = D - rotary_dim
    meta = (
        ("HALF", half),
        ("HALF_PAD", half_pad),
        ("PASS", pass_dim),
        ("PASS_PAD", next_power_of_2(pass_dim) if pass_dim else 1),
        ("BLOCK_T", block_t),
        ("BLOCK_H", block_h),
        ("num_warps", launch.num_warps),
    )
    return (t_blocks, groups, B), meta


def _launch_plan(launch, q, k, rotary_dim):
    B, Hq, T, D = q.shape
    if q.is_cuda:
        return _plan(launch or DEFAULT_LAUNCH, B, T, Hq, k.shape[1], D, rotary_dim,
                     _sm_count(q.device.index or 0))  # fmt: skip
    return _plan(launch or INTERPRETER_LAUNCH, B, T, Hq, k.shape[1], D, rotary_dim, None)


def _rotate_torch(x, out, cos_lo, sin_lo, cos_hi, sin_hi, rotary_dim):
    """PyTorch path (CPU without the interpreter): the kernel's formula in fp32, into ``out``."""
    half = rotary_dim // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:rotary_dim].float()
    out[..., :half] = x1 * cos_lo - x2 * sin_lo
    out[..., half:rotary_dim] = x2 * cos_hi + x1 * sin_hi
    out[..., rotary_dim:] = x[..., rotary_dim:]


def _outputs(q, k, out):
    if out is None:
        return torch.empty_like(q), torch.empty_like(k)
    oq, ok = out
    if oq.shape != q.shape or ok.shape != k.shape or oq.dtype != q.dtype or ok.dtype != k.dtype:
        raise ValueError(f"out {_shape(oq)}, {_shape(ok)} must match q {_shape(q)}, k {_shape(k)}")
    return out


def _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, inverse, launch, out):
    oq, ok = _outputs(q, k, out)
    _, Hq, T, _ = q.shape
    Hk = k.shape[1]
    if q.numel() == 0 and k.numel() == 0:
        return oq, ok
    if not use_triton(q):
        pos = position_ids.to(torch.float32)[:, None, :, None]  # (B|1, 1, T, 1)
        angle = pos * inv_freq.to(device=q.device, dtype=torch.float32)
        cos = angle.cos() * attention_scaling
        sin = angle.sin() * attention_scaling
        if inverse:
            sin = -sin
        _rotate_torch(q, oq, cos, sin, cos, sin, rotary_dim)
        _rotate_torch(k, ok, cos, sin, cos, sin, rotary_dim)
        return oq, ok
    grid, meta = _launch_plan(launch, q, k, rotary_dim)
    interpreted = interpreter_enabled()
    scalars = (T, Hq, Hk, float(attention_scaling), *q.stride(), *k.stride(), *oq.stride(),
               *ok.stride(), position_ids.stride(0) if position_ids.shape[0] > 1 else 0,
               position_ids.stride(1), inv_freq.stride(0))  # fmt: skip
    # Inline PTX on NVIDIA only; the interpreter and ROCm take the precise tl.cos/tl.sin.
    sfu = not interpreted and torch.version.hip is None
    flags = (("INVERSE", inverse), ("SFU_TRIG", sfu), ("INTERPRETED", interpreted))
    _launch_rope(grid, (q, k, oq, ok, position_ids, inv_freq), scalars, meta + flags)
    return oq, ok


def rope_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    launch: RopeLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of (B, Hq, T, D) ``q`` and (B, Hk, T, D) ``k``; inputs as validated by
    ``apply_rope`` (no checks here). ``out``: tensors to write instead of new ones (any strides;
    never q or k themselves)."""
    return _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, False, launch, out)


def rope_bwd(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    launch: RopeLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rope_fwd``'s inputs: the inverse rotation (scaled) of the output grads."""
    return _rope(grad_q, grad_k, position_ids, inv_freq, attention_scaling, rotary_dim, True,
                 launch, out)  # fmt: skip


def _rope_cos_sin(q, k, cos, sin, transpose, launch, out):
    oq, ok = _outputs(q, k, out)
    _, Hq, T, _ = q.shape
    Hk = k.shape[1]
    if q.numel() == 0 and k.numel() == 0:
        return oq, ok
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    if not use_triton(q):
        c, s = cos.float()[:, None], sin.float()[:, None]  # (B|1, 1, T, r)
        c_lo, c_hi, s_lo, s_hi = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
        if transpose:
            s_lo, s_hi = -s_hi, -s_lo
        _rotate_torch(q, oq, c_lo, s_lo, c_hi, s_hi, rotary_dim)
        _rotate_torch(k, ok, c_lo, s_lo, c_hi, s_hi, rotary_dim)
        return oq, ok
    grid, meta = _launch_plan(launch, q, k, rotary_dim)
    scalars = (T, Hq, Hk, *q.stride(), *k.stride(), *oq.stride(), *ok.stride(),
               cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2),
               sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1), sin.stride(2))  # fmt: skip
    flags = (("TRANSPOSE", transpose), ("INTERPRETED", interpreter_enabled()))
    _launch_cos_sin(grid, (q, k, oq, ok, cos, sin), scalars, meta + flags)
    return oq, ok


def rope_cos_sin_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    launch: RopeLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q * cos + rotate_half(q) * sin`` (and k) on the first ``cos.shape[-1]`` channels, with
    (B|1, T, r) ``cos``/``sin``; new tensors laid out like q and k."""
    return _rope_cos_sin(q, k, cos, sin, False, launch, out)


def rope_cos_sin_bwd(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    launch: RopeLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rope_cos_sin_fwd``'s q and k inputs (the transposed map)."""
    return _rope_cos_sin(grad_q, grad_k, cos, sin, True, launch, out)


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (fullgraph=True traces through them). Each op's
# backward is its partner op, so double backward works too (both maps are linear in q, k).


@torch.library.custom_op("surgery::rope_fwd", mutates_args=())
def _rope_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_fwd(q, k, position_ids, inv_freq, attention_scaling, rotary_dim)


@torch.library.custom_op("surgery::rope_bwd", mutates_args=())
def _rope_bwd_op(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_bwd(grad_q, grad_k, position_ids, inv_freq, attention_scaling, rotary_dim)


@torch.library.custom_op("surgery::rope_cos_sin_fwd", mutates_args=())
def _rope_cos_sin_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_fwd(q, k, cos, sin)


@torch.library.custom_op("surgery::rope_cos_sin_bwd", mutates_args=())
def _rope_cos_sin_bwd_op(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_bwd(grad_q, grad_k, cos, sin)


def _fake_like(x, y, *args):
    return torch.empty_like(x), torch.empty_like(y)


for _op in (_rope_fwd_op, _rope_bwd_op, _rope_cos_sin_fwd_op, _rope_cos_sin_bwd_op):
    _op.register_fake(_fake_like)


def _save_rope_args(ctx, inputs, output):
    _, _, position_ids, inv_freq, attention_scaling, rotary_dim = inputs
    ctx.save_for_backward(position_ids, inv_freq)
    ctx.rope_args = (attention_scaling, rotary_dim)


def _save_cos_sin(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _partner_backward(partner_op, n_extra):
    def backward(ctx, grad_q, grad_k):
        # Grads reach us as new tensors from autograd; the partner op writes new ones again, so
        # nothing autograd still holds is overwritten.
        extra = getattr(ctx, "rope_args", ())
        dq, dk = partner_op(grad_q, grad_k, *ctx.saved_tensors, *extra)
        return (dq, dk) + (None,) * n_extra

    return backward


_rope_fwd_op.register_autograd(_partner_backward(_rope_bwd_op, 4), setup_context=_save_rope_args)
_rope_bwd_op.register_autograd(_partner_backward(_rope_fwd_op, 4), setup_context=_save_rope_args)
_rope_cos_sin_fwd_op.register_autograd(
    _partner_backward(_rope_cos_sin_bwd_op, 2), setup_context=_save_cos_sin
)
_rope_cos_sin_bwd_op.register_autograd(
    _partner_backward(_rope_cos_sin_fwd_op, 2), setup_context=_save_cos_sin
)


class _RopeFunction(torch.autograd.Function):
    """Eager autograd over the launchers, for the same maps as the ops above. The ops carry the
    autograd torch.compile sees; in eager mode their Python dispatch costs several times this
    Function's host time, which shows when the GPU work is a tenth of a millisecond."""

    @staticmethod
    def forward(ctx, q, k, position_ids, inv_freq, attention_scaling, rotary_dim, inverse):
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.rope_args = (attention_scaling, rotary_dim, inverse)
        return _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, inverse, None,
                     None)  # fmt: skip

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        scaling, rotary_dim, inverse = ctx.rope_args
        args = (grad_q, grad_k, *ctx.saved_tensors, scaling, rotary_dim, not inverse)
        # Only a double backward (create_graph=True) needs this backward to be differentiable;
        # otherwise the launcher runs directly, without a second Function's host cost.
        if torch.is_grad_enabled():
            dq, dk = _RopeFunction.apply(*args)
        else:
            dq, dk = _rope(*args, None, None)
        return dq, dk, None, None, None, None, None


class _RopeCosSinFunction(torch.autograd.Function):
    """Eager autograd of the cos/sin map (see ``_RopeFunction``)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, transpose):
        ctx.save_for_backward(cos, sin)
        ctx.transpose = transpose
        return _rope_cos_sin(q, k, cos, sin, transpose, None, None)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward
            dq, dk = _RopeCosSinFunction.apply(grad_q, grad_k, cos, sin, not ctx.transpose)
        else:
            dq, dk = _rope_cos_sin(grad_q, grad_k, cos, sin, not ctx.transpose, None, None)
        return dq, dk, None, None, None


# ---------------------------------------------------------------------------------------------
# Public functions.


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _check_q_k(q, k, what: str) -> None:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError(f"{what}: q and k must be tensors, got {type(q)} and {type(k)}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"{what}: q and k must be 4-D (batch, heads, seq, head_dim); got q {_shape(q)}, "
            f"k {_shape(k)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{what}: q {_shape(q)} and k {_shape(k)} must agree in batch, seq and head_dim "
            "(only the head count may differ)"
        )
    if q.dtype not in _FLOAT_DTYPES or q.dtype != k.dtype:
        raise TypeError(
            f"{what}: q and k must share one of float32/bfloat16/float16; got {q.dtype} "
            f"and {k.dtype}"
        )
    if q.device != k.device:
        raise ValueError(f"{what}: q is on {q.device} but k is on {k.device}")


def _check_rope(q, k, position_ids, inv_freq, rotary_dim) -> int:
    _check_q_k(q, k, "apply_rope")
    B, _, T, D = q.shape
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(
            "apply_rope: position_ids must be an int32 or int64 tensor; got "
            f"{getattr(position_ids, 'dtype', type(position_ids))}"
        )
    if position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
        raise ValueError(
            f"apply_rope: position_ids must be ({B}, {T}) or (1, {T}) for q {_shape(q)}; got "
            f"{_shape(position_ids)}"
        )
    rd = D if rotary_dim is None else int(rotary_dim)
    if rd <= 0 or rd > D or rd % 2:
        raise ValueError(
            f"apply_rope: rotary_dim must be even and in (0, head_dim={D}] for q {_shape(q)}; "
            f"got {rd}" + (" (the default is head_dim)" if rotary_dim is None else "")
        )
    if not isinstance(inv_freq, torch.Tensor) or not inv_freq.is_floating_point():
        raise TypeError(f"apply_rope: inv_freq must be a floating tensor; got {type(inv_freq)}")
    if inv_freq.dim() != 1 or inv_freq.shape[0] != rd // 2:
        raise ValueError(
            f"apply_rope: inv_freq must have rotary_dim/2 = {rd // 2} entries for rotary_dim "
            f"{rd} (q {_shape(q)}); got {_shape(inv_freq)}. Pass rotary_dim for partial rotary."
        )
    for name, t in (("position_ids", position_ids), ("inv_freq", inv_freq)):
        if t.device != q.device:
            raise ValueError(f"apply_rope: {name} is on {t.device} but q is on {q.device}")
    return rd


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys at their positions, angles computed in the kernel.

    Args:
        q: (B, Hq, T, D) queries; any strides (e.g. transformers' ``.view(B, T, H, D)
            .transpose(1, 2)``). float32, bfloat16 or float16.
        k: (B, Hk, T, D) keys, same dtype and device; Hk may differ from Hq (GQA/MQA).
        position_ids: (B, T) or (1, T), int32 or int64: the position of every token. Positions
            may restart inside a row (packed sequences) or start anywhere (a KV-cache offset).
        inv_freq: (rotary_dim/2,) inverse frequencies, as a transformers rotary module holds in
            ``inv_freq`` (every rope type that lives in ``inv_freq`` and ``attention_scaling``:
            default, linear, llama3, yarn, dynamic, ...). Read as fp32.
        attention_scaling: multiplies cos and sin (the rotary module's ``attention_scaling``).
        rotary_dim: rotate the first ``rotary_dim`` channels (even, <= D; default D); the rest
            pass through unchanged (partial rotary, e.g. ``partial_rotary_factor``).

    Returns:
        ``(q_rot, k_rot)``: new tensors with the dtype and memory layout of q and k. Inputs are
        never written. Angles are fp32 ``position * inv_freq`` (as transformers computes them),
        cos/sin (absolute error < 1e-6) and the rotation are computed in fp32, and the result is
        rounded once: in bf16 more accurate than transformers' eager path, which rounds cos, sin
        and each product to bf16.

    Differentiable in q and k (the backward is the inverse rotation, also out of place);
    ``position_ids`` and ``inv_freq`` get no gradient. Under ``torch.compile(fullgraph=True)`` it
    runs as the op ``torch.ops.surgery.rope_fwd`` (fake tensors and autograd registered). CUDA
    tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton kernel; other CPU
    tensors a PyTorch path with the same fp32 math. Shapes, dtypes and devices are checked before
    anything runs.

    Autocast (the rule of every kernel here: inputs are cast on entry where the unpatched module's
    ops would cast them, and nothing after that depends on autocast): the rotation is elementwise,
    which autocast leaves alone, so nothing is cast and the outputs keep q's and k's dtype, bit for
    bit the call without autocast. transformers' path differs in dtype only: in an fp32 model under
    autocast its cos/sin are fp32 and ``q * cos`` promotes q/k from the autocast projections to
    fp32; every attention implementation casts them back to the autocast dtype before reading them
    (sdpa and eager attention's matmuls are autocast ops, flash attention casts to the autocast
    dtype itself), so attention reads the same values (but for a rare one-ulp difference: one
    rounding here against two there), and no fp32 copy of q and k is written.
    """
    rd = _check_rope(q, k, position_ids, inv_freq, rotary_dim)
    scaling = float(attention_scaling)
    if torch.compiler.is_compiling():
        return _rope_fwd_op(q, k, position_ids, inv_freq, scaling, rd)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        # Nothing to differentiate: the launcher alone, without the Function's host time.
        return _rope(q, k, position_ids, inv_freq, scaling, rd, False, None, None)
    return _RopeFunction.apply(q, k, position_ids, inv_freq, scaling, rd, False)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cos_sin_eager(q, k, cos, sin):
    # Differentiable in cos/sin too; used only when the caller asks for their gradients.
    cos, sin = cos[:, None], sin[:, None]
    rd = cos.shape[-1]

    def rot(x):
        xr = x[..., :rd]
        return torch.cat((xr * cos + _rotate_half(xr) * sin, x[..., rd:]), dim=-1)

    return rot(q), rot(k)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb`` for callers that hold cos/sin.

    Args:
        q, k: (B, Hq, T, D) / (B, Hk, T, D) with ``unsqueeze_dim=1`` (transformers' default), or
            (B, T, Hq, D) / (B, T, Hk, D) with ``unsqueeze_dim=2``; any strides; fp32/bf16/fp16.
        cos, sin: (B, T, r) or (1, T, r), as a rotary module returns them (any float dtype, read
            as fp32). r = D is transformers' Llama formula; an even r < D rotates the first r
            channels and passes the rest through (the partial-rotary variant, e.g. Phi-3).
        unsqueeze_dim: where transformers would unsqueeze cos/sin: 1 or 2 (or -3, -2).

    Returns:
        ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` computed in fp32 and
        rounded once to q's dtype; new tensors laid out like q and k (inputs are never written).
        Differentiable in q and k through the Triton kernel; if cos or sin require grad, the
        eager formula runs instead so that they get theirs.

    Autocast: as ``apply_rope`` (nothing is cast, the outputs keep q's and k's dtype, where
    transformers' formula promotes them with fp32 cos/sin).
    """
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise TypeError("apply_rotary_pos_emb: cos and sin must be tensors")
    ud = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim
    if ud not in (1, 2):
        raise ValueError(
            f"apply_rotary_pos_emb: unsqueeze_dim must be 1 (q as (B, H, T, D)) or 2 "
            f"(q as (B, T, H, D)); got {unsqueeze_dim}"
        )
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and ud == 2:
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(
                f"apply_rotary_pos_emb: q and k must be 4-D; got q {_shape(q)}, k {_shape(k)}"
            )
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    _check_q_k(q, k, "apply_rotary_pos_emb")
    B, _, T, D = q.shape
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(
            f"apply_rotary_pos_emb: cos and sin must both be (B, T, rotary_dim) or "
            f"(1, T, rotary_dim); got cos {_shape(cos)}, sin {_shape(sin)}"
        )
    r = cos.shape[-1]
    if cos.shape[0] not in (1, B) or cos.shape[1] != T or r % 2 or not 0 < r <= D:
        raise ValueError(
            f"apply_rotary_pos_emb: cos/sin {_shape(cos)} do not fit q {_shape(q)} (batch, seq "
            f"and head_dim as seen with unsqueeze_dim={unsqueeze_dim}): need ({B} or 1, {T}, "
            f"r) with r even and <= {D}"
        )
    if not cos.is_floating_point() or not sin.is_floating_point():
        raise TypeError(f"apply_rotary_pos_emb: cos/sin must be floating; got {cos.dtype}")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"apply_rotary_pos_emb: cos/sin are on {cos.device}, q on {q.device}")
    if cos.requires_grad or sin.requires_grad:
        oq, ok = _cos_sin_eager(q, k, cos, sin)
    elif torch.compiler.is_compiling():
        oq, ok = _rope_cos_sin_fwd_op(q, k, cos, sin)
    elif not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        oq, ok = _rope_cos_sin(q, k, cos, sin, False, None, None)
    else:
        oq, ok = _RopeCosSinFunction.apply(q, k, cos, sin, False)
    if ud == 2:
        oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
    return oq, ok


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``apply_rope`` in plain PyTorch: angles = position * inv_freq, rotate-half
    layout, the first ``rotary_dim`` channels rotated and the rest passed through.

    Computed in fp32, or in fp64 when q is fp64 (tests use that as ground truth: the angle
    product is then exact too); differentiable; the result is cast back to q's dtype.
    """
    d = q.shape[-1] if rotary_dim is None else rotary_dim
    ct = torch.promote_types(q.dtype, torch.float32)
    pos = position_ids.to(ct)
    freqs = pos[..., None] * inv_freq.to(ct)[None, None, :]  # (B|1, T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling)[:, None]  # (B|1, 1, T, d)
    sin = (emb.sin() * attention_scaling)[:, None]

    def rot(x):
        xf = x.to(ct)
        xr, xp = xf[..., :d], xf[..., d:]
        out = torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)
        return out.to(x.dtype)

    return rot(q), rot(k)
