"""The public rotary functions: ``apply_rope`` (angles from position ids, computed in the kernel)
and ``apply_rotary_pos_emb`` (transformers' drop-in for callers that hold cos/sin). Everything is
checked here, before anything launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dispatch import kernel_path
from .launch import LAYOUTS, RopeLayout, _rope, _rope_cos_sin
from .ops import FUNCTIONS, OPS
from .reference import rotate_half

__all__ = ["apply_rope", "apply_rotary_pos_emb"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _check_mrope_section(mrope_section, mrope_interleaved, half) -> tuple[int, int, int]:
    ok = isinstance(mrope_section, Sequence) and len(mrope_section) == 3
    ok = ok and all(type(s) is int and s >= 0 for s in mrope_section)
    if not ok:
        raise ValueError(
            "apply_rope: mrope_section must be three non-negative ints (temporal, height, width "
            "frequencies, e.g. the config's rope_parameters['mrope_section']); got "
            f"{mrope_section!r}"
        )
    if sum(mrope_section) != half:
        raise ValueError(
            f"apply_rope: mrope_section {list(mrope_section)} must sum to rotary_dim/2 = {half} "
            "(one section per frequency); pass rotary_dim for partial rotary"
        )
    if not isinstance(mrope_interleaved, bool):
        raise TypeError(f"apply_rope: mrope_interleaved must be a bool; got {mrope_interleaved!r}")
    return tuple(mrope_section)


def _check_rope(q, k, position_ids, inv_freq, rotary_dim, layout, mrope_section,
                mrope_interleaved):  # fmt: skip
    """Returns (rotary_dim, mrope_section as a tuple or None, position_ids as the kernel reads
    them: (3, B|1, T) with sections, (B|1, T) without)."""
    _check_q_k(q, k, "apply_rope")
    if layout not in LAYOUTS:
        raise ValueError(f"apply_rope: layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    B, _, T, D = q.shape
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(
            "apply_rope: position_ids must be an int32 or int64 tensor; got "
            f"{getattr(position_ids, 'dtype', type(position_ids))}"
        )
    pos_2d = position_ids.dim() == 2 and position_ids.shape[0] in (1, B)
    if mrope_section is None:
        if position_ids.dim() == 3:
            raise ValueError(
                f"apply_rope: position_ids {_shape(position_ids)} are multimodal (3, batch, seq); "
                "pass mrope_section (and mrope_interleaved) to rotate with them"
            )
        if not pos_2d or position_ids.shape[1] != T:
            raise ValueError(
                f"apply_rope: position_ids must be ({B}, {T}) or (1, {T}) for q {_shape(q)}; "
                f"got {_shape(position_ids)}"
            )
    else:
        pos_3d = position_ids.dim() == 3 and position_ids.shape[:2] in ((3, B), (3, 1))
        if not (pos_3d or pos_2d) or position_ids.shape[-1] != T:
            raise ValueError(
                f"apply_rope: multimodal position_ids must be (3, {B}, {T}) or (3, 1, {T}) "
                f"(temporal, height, width rows), or ({B}, {T}) / (1, {T}) for one row shared by "
                f"all three, for q {_shape(q)}; got {_shape(position_ids)}"
            )
        if pos_2d:  # what transformers' multimodal rotary modules do with 2-D positions
            position_ids = position_ids.expand(3, *position_ids.shape)
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
    if mrope_section is not None:
        mrope_section = _check_mrope_section(mrope_section, mrope_interleaved, rd // 2)
    elif mrope_interleaved:
        raise ValueError("apply_rope: mrope_interleaved=True needs mrope_section")
    return rd, mrope_section, position_ids


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    rotary_dim: int | None = None,
    layout: RopeLayout = "half",
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys at their positions, angles computed in the kernel.

    Args:
        q: (B, Hq, T, D) queries; any strides (e.g. transformers' ``.view(B, T, H, D)
            .transpose(1, 2)``). float32, bfloat16 or float16.
        k: (B, Hk, T, D) keys, same dtype and device; Hk may differ from Hq (GQA/MQA), down to
            one key head shared by every query head (MLA's rotary key ``k_pe``, (B, 1, T, r)).
        position_ids: (B, T) or (1, T), int32 or int64: the position of every token. Positions
            may restart inside a row (packed sequences) or start anywhere (a KV-cache offset).
            With ``mrope_section``: (3, B, T) or (3, 1, T), the temporal, height and width
            positions of every token (transformers' ``get_rope_index``; any strides), or (B, T)
            / (1, T) for the same position in all three rows (text only).
        inv_freq: (rotary_dim/2,) inverse frequencies, as a transformers rotary module holds in
            ``inv_freq`` (every rope type that lives in ``inv_freq`` and ``attention_scaling``:
            default, linear, llama3, yarn, dynamic, ...). Read as fp32.
        attention_scaling: multiplies cos and sin (the rotary module's ``attention_scaling``).
        rotary_dim: rotate the first ``rotary_dim`` channels (even, <= D; default D); the rest
            pass through unchanged (partial rotary, e.g. ``partial_rotary_factor``). A rotary
            slice elsewhere (MLA's last ``qk_rope_head_dim`` channels) is passed as a view.
        layout: where the pair rotated by ``position * inv_freq[j]`` lives, r = ``rotary_dim``:

            - ``"half"``: channels (j, j + r/2), in and out: transformers' ``rotate_half``
              (Llama, Mistral, Qwen, Gemma, ...).
            - ``"interleaved"``: channels (2j, 2j + 1), in and out: the complex-number form
              (transformers' Llama 4 ``apply_rotary_emb`` with ``view_as_complex``; GPT-J).
            - ``"interleaved_to_half"``: read (2j, 2j + 1), write (j, j + r/2): transformers'
              ``apply_rotary_pos_emb_interleave`` (Mistral 4 and DeepSeek V2/V3 with
              ``rope_interleave``), which de-interleaves as it rotates. Attention scores equal
              ``"interleaved"``'s (q and k are permuted alike) but the values, and what a KV
              cache stores, are transformers' only in this layout.

        mrope_section: multimodal RoPE (Qwen2-VL and later, the config's
            ``rope_parameters["mrope_section"]``): how many of the r/2 frequencies take their
            angle from the temporal, height and width position rows, three ints summing to r/2.
            Frequency j is rotated by ``position_ids[s(j), b, t] * inv_freq[j]``; s(j) as
            transformers' multimodal rotary modules build cos/sin (``mrope_rows`` states it).
        mrope_interleaved: the section layout over the frequencies. False: contiguous runs
            (Qwen2-VL, Qwen2.5-VL: [0, t) temporal, then height, then width). True: interleaved
            (Qwen3-VL, Qwen3.5: j % 3 == 1 height and j % 3 == 2 width while those sections
            last, temporal otherwise).

    Returns:
        ``(q_rot, k_rot)``: new tensors with the dtype and memory layout of q and k. Inputs are
        never written. Angles are fp32 ``position * inv_freq`` (as transformers computes them),
        cos/sin (absolute error < 1e-6) and the rotation are computed in fp32, and the result is
        rounded once: in bf16 more accurate than transformers' cos/sin paths (rotate-half and
        Mistral 4's), which round cos, sin and each product to bf16; Llama 4's complex path
        computes in fp32 and rounds once too.

    Differentiable in q and k (the backward is the inverse rotation, also out of place, and is
    differentiable in turn); ``position_ids`` and ``inv_freq`` get no gradient. Under
    ``torch.compile(fullgraph=True)`` it is the op ``torch.ops.surgery.rope_fwd`` with its
    registered autograd (fake tensors registered too); an eager call that autograd records runs
    the same formula as the Function ``kernels.rope.ops.FUNCTIONS["rope_fwd"]`` over the launcher;
    one with nothing to differentiate (grad mode off, or neither q nor k requiring grad) the
    launcher alone. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton
    kernel; other CPU tensors a PyTorch path with the same fp32 math. Shapes, dtypes and devices
    are checked before anything runs.

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
    rd, section, position_ids = _check_rope(
        q, k, position_ids, inv_freq, rotary_dim, layout, mrope_section, mrope_interleaved
    )
    scaling = float(attention_scaling)
    interleaved = bool(mrope_interleaved)  # False without sections (checked)
    path = kernel_path(q, k)
    if path == "launcher":
        return _rope(q, k, position_ids, inv_freq, scaling, rd, layout, False, None, None, section,
                     interleaved)  # fmt: skip
    if path == "function":
        return FUNCTIONS["rope_fwd"].apply(q, k, position_ids, inv_freq, scaling, rd, layout,
                                           section, interleaved)  # fmt: skip
    if section is None:  # the op's schema as before multimodal positions existed
        return OPS["rope_fwd"](q, k, position_ids, inv_freq, scaling, rd, layout)
    return OPS["rope_fwd"](q, k, position_ids, inv_freq, scaling, rd, layout, list(section),
                           interleaved)  # fmt: skip


def _cos_sin_eager(q, k, cos, sin):
    # Differentiable in cos/sin too; used only when the caller asks for their gradients.
    cos, sin = cos[:, None], sin[:, None]
    rd = cos.shape[-1]

    def rot(x):
        xr = x[..., :rd]
        return torch.cat((xr * cos + rotate_half(xr) * sin, x[..., rd:]), dim=-1)

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
        Differentiable in q and k: compiled through the op ``torch.ops.surgery.rope_cos_sin_fwd``
        and its registered autograd, eagerly through the same formula as a Function over the
        launcher (without anything to differentiate, the launcher alone); if cos or sin require
        grad, the eager formula runs instead so that they get theirs.

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
    else:
        path = kernel_path(q, k)
        if path == "op":
            oq, ok = OPS["rope_cos_sin_fwd"](q, k, cos, sin)
        elif path == "function":
            oq, ok = FUNCTIONS["rope_cos_sin_fwd"].apply(q, k, cos, sin)
        else:
            oq, ok = _rope_cos_sin(q, k, cos, sin, False, None, None)
    if ud == 2:
        oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
    return oq, ok
