"""Host launchers of the rotary kernels (``rope_fwd``, ``rope_bwd``, ``rope_cos_sin_fwd``,
``rope_cos_sin_bwd``), their launch configuration, the multimodal section layout
(``mrope_rows``), and the PyTorch path CPU tensors take when the Triton interpreter is off.

Launchers take inputs as validated by ``apply_rope`` / ``apply_rotary_pos_emb`` (no checks here).
Outputs are always new tensors laid out like the input (``empty_like``), so transformers' (B, T,
H, D) buffer seen as (B, H, T, D) stays (B, T, H, D) underneath, unless ``out`` names others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from ..dispatch import cdiv, interpreter_enabled, next_power_of_2, use_triton
from ..launch import FastLauncher
from .kernel import rope_cos_sin_kernel, rope_fwd_kernel

__all__ = [
    "DEFAULT_LAUNCH",
    "INTERPRETER_LAUNCH",
    "LAYOUTS",
    "RopeLaunch",
    "RopeLayout",
    "mrope_rows",
    "rope_bwd",
    "rope_cos_sin_bwd",
    "rope_cos_sin_fwd",
    "rope_fwd",
]

RopeLayout = Literal["half", "interleaved", "interleaved_to_half"]
# Where channel pair j is read and written: (input interleaved, output interleaved). False: the
# pair (j, j + r/2) (rotate-half); True: the pair (2j, 2j + 1).
LAYOUTS: dict[str, tuple[bool, bool]] = {
    "half": (False, False),
    "interleaved": (True, True),
    "interleaved_to_half": (True, False),
}

# The kernel's constexprs for one position per token (no multimodal rows).
_TEXT_POSITIONS = (("MROPE", 0), ("SECTION_T", 0), ("SECTION_H", 0), ("SECTION_W", 0))

if rope_fwd_kernel is not None:
    # Launched directly once compiled (kernels/launch.py): the host time of a launch otherwise
    # exceeds the kernel's GPU time at training shapes.
    _launch_rope = FastLauncher(rope_fwd_kernel)
    _launch_cos_sin = FastLauncher(rope_cos_sin_kernel)
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    _launch_rope = _launch_cos_sin = None


@dataclass(frozen=True)
class RopeLaunch:
    """Launch configuration. ``head_groups=None`` picks enough programs to fill the
    device; the defaults are the fixed known-good setting, others exist for tests and sweeps.

    Default (bf16, D = 128): tiles of 2 tokens x 32 heads x 64 channel pairs, 4 warps, the best
    of a 36-config sweep (benchmarks/results/rope.json, `--sweep`) forward and backward on both
    benchmark shapes, well ahead of the earlier default (4 tokens, 2048-element tiles).
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


@functools.lru_cache(maxsize=64)
def mrope_rows(
    half: int, mrope_section: tuple[int, int, int], interleaved: bool
) -> tuple[int, ...]:
    """The position row (0 temporal, 1 height, 2 width) that each of the ``half`` frequencies
    takes its angle from, for ``mrope_section`` = (t, h, w) frequencies per row (t + h + w =
    ``half``; checked by ``apply_rope``).

    Contiguous (Qwen2-VL, Qwen2.5-VL): frequencies [0, t) temporal, [t, t + h) height, the rest
    width. Interleaved (Qwen3-VL, Qwen3.5): frequency j is height if j % 3 == 1 and j < 3h, width
    if j % 3 == 2 and j < 3w, temporal otherwise. The kernel computes the same from constexprs
    (``_mrope_positions``); this is the PyTorch path's copy.
    """
    t, h, w = mrope_section
    if interleaved:
        return tuple(
            1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
            for j in range(half)
        )
    return tuple(0 if j < t else 1 if j < t + h else 2 for j in range(half))


def _positions_fp32(position_ids, half, mrope_section, mrope_interleaved):
    """fp32 positions that broadcast against (B|1, 1, T, half) angles: one per token, or (the
    multimodal case) one per (token, frequency), gathered from the frequency's row."""
    if mrope_section is None:
        return position_ids.to(torch.float32)[:, None, :, None]  # (B|1, 1, T, 1)
    rows = mrope_rows(half, mrope_section, mrope_interleaved)
    rows = torch.tensor(rows, dtype=torch.long, device=position_ids.device)
    pos = position_ids.index_select(0, rows).to(torch.float32)  # (half, B|1, T)
    return pos.permute(1, 2, 0)[:, None]  # (B|1, 1, T, half)


def _pair(x, rotary_dim, interleaved):
    """The two members of every rotated channel pair: (x_j, x_{j+r/2}) or (x_{2j}, x_{2j+1})."""
    if interleaved:
        return x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    half = rotary_dim // 2
    return x[..., :half], x[..., half:rotary_dim]


def _rotate_torch(x, out, cos_lo, sin_lo, cos_hi, sin_hi, rotary_dim, in_il=False, out_il=False):
    """PyTorch path (CPU without the interpreter): the kernel's formula in fp32, into ``out``."""
    x1, x2 = _pair(x, rotary_dim, in_il)
    x1, x2 = x1.float(), x2.float()
    o1, o2 = _pair(out, rotary_dim, out_il)
    o1.copy_(x1 * cos_lo - x2 * sin_lo)
    o2.copy_(x2 * cos_hi + x1 * sin_hi)
    out[..., rotary_dim:] = x[..., rotary_dim:]


def _outputs(q, k, out):
    if out is None:
        return torch.empty_like(q), torch.empty_like(k)
    oq, ok = out
    if oq.shape != q.shape or ok.shape != k.shape or oq.dtype != q.dtype or ok.dtype != k.dtype:
        raise ValueError(
            f"out {tuple(oq.shape)}, {tuple(ok.shape)} must match q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    return out


def _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, layout, inverse, launch,
          out, mrope_section=None, mrope_interleaved=False):  # fmt: skip
    oq, ok = _outputs(q, k, out)
    _, Hq, T, _ = q.shape
    Hk = k.shape[1]
    if q.numel() == 0 and k.numel() == 0:
        return oq, ok
    in_il, out_il = LAYOUTS[layout]
    if inverse:
        # The transpose of "read pairs one way, write them another" reads the other way round.
        in_il, out_il = out_il, in_il
    if not use_triton(q):
        pos = _positions_fp32(position_ids, rotary_dim // 2, mrope_section, mrope_interleaved)
        angle = pos * inv_freq.to(device=q.device, dtype=torch.float32)
        cos = angle.cos() * attention_scaling
        sin = angle.sin() * attention_scaling
        if inverse:
            sin = -sin
        _rotate_torch(q, oq, cos, sin, cos, sin, rotary_dim, in_il, out_il)
        _rotate_torch(k, ok, cos, sin, cos, sin, rotary_dim, in_il, out_il)
        return oq, ok
    grid, meta = _launch_plan(launch, q, k, rotary_dim)
    interpreted = interpreter_enabled()
    if mrope_section is None:  # (B|1, T): no row axis
        spos = (0, position_ids.stride(0) if position_ids.shape[0] > 1 else 0,
                position_ids.stride(1))  # fmt: skip
        positions = _TEXT_POSITIONS
    else:  # (3, B|1, T)
        spos = (position_ids.stride(0), position_ids.stride(1) if position_ids.shape[1] > 1 else 0,
                position_ids.stride(2))  # fmt: skip
        positions = (("MROPE", 2 if mrope_interleaved else 1), ("SECTION_T", mrope_section[0]),
                     ("SECTION_H", mrope_section[1]), ("SECTION_W", mrope_section[2]))  # fmt: skip
    scalars = (T, Hq, Hk, float(attention_scaling), *q.stride(), *k.stride(), *oq.stride(),
               *ok.stride(), *spos, inv_freq.stride(0))  # fmt: skip
    # Inline PTX on NVIDIA only; the interpreter and ROCm take the precise tl.cos/tl.sin.
    sfu = not interpreted and torch.version.hip is None
    flags = (("IN_INTERLEAVED", in_il), ("OUT_INTERLEAVED", out_il), ("INVERSE", inverse),
             *positions, ("SFU_TRIG", sfu), ("INTERPRETED", interpreted))  # fmt: skip
    _launch_rope(grid, (q, k, oq, ok, position_ids, inv_freq), scalars, meta + flags)
    return oq, ok


def rope_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    layout: RopeLayout = "half",
    launch: RopeLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of (B, Hq, T, D) ``q`` and (B, Hk, T, D) ``k`` in ``layout`` (see
    ``apply_rope``). ``out``: tensors to write instead of new ones (any strides; never q or k
    themselves). With ``mrope_section``, ``position_ids`` is (3, B|1, T) (see ``apply_rope``)."""
    return _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, layout, False,
                 launch, out, mrope_section, mrope_interleaved)  # fmt: skip


def rope_bwd(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    layout: RopeLayout = "half",
    launch: RopeLaunch | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rope_fwd``'s inputs (same ``layout`` and positions): the inverse rotation
    (scaled) of the output grads, pairs read where ``rope_fwd`` writes them and written where it
    reads them."""
    return _rope(grad_q, grad_k, position_ids, inv_freq, attention_scaling, rotary_dim, layout,
                 True, launch, out, mrope_section, mrope_interleaved)  # fmt: skip


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
