"""The public rotary functions: ``apply_rope`` (angles from position ids, computed in the kernel)
and ``apply_rotary_pos_emb`` (transformers' drop-in for callers that hold cos/sin). Everything is
checked here, before anything launches."""

from __future__ import annotations

import torch

from .launch import LAYOUTS, RopeLayout, _rope, _rope_cos_sin
from .ops import RopeCosSinFunction, RopeFunction, _rope_cos_sin_fwd_op, _rope_fwd_op
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


def _check_rope(q, k, position_ids, inv_freq, rotary_dim, layout) -> int:
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
    layout: RopeLayout = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys at their positions, angles computed in the kernel.

    Args:
        q: (B, Hq, T, D) queries; any strides (e.g. transformers' ``.view(B, T, H, D)
            .transpose(1, 2)``). float32, bfloat16 or float16.
        k: (B, Hk, T, D) keys, same dtype and device; Hk may differ from Hq (GQA/MQA), down to
            one key head shared by every query head (MLA's rotary key ``k_pe``, (B, 1, T, r)).
        position_ids: (B, T) or (1, T), int32 or int64: the position of every token. Positions
            may restart inside a row (packed sequences) or start anywhere (a KV-cache offset).
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

    Returns:
        ``(q_rot, k_rot)``: new tensors with the dtype and memory layout of q and k. Inputs are
        never written. Angles are fp32 ``position * inv_freq`` (as transformers computes them),
        cos/sin (absolute error < 1e-6) and the rotation are computed in fp32, and the result is
        rounded once: in bf16 more accurate than transformers' cos/sin paths (rotate-half and
        Mistral 4's), which round cos, sin and each product to bf16; Llama 4's complex path
        computes in fp32 and rounds once too.

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
    rd = _check_rope(q, k, position_ids, inv_freq, rotary_dim, layout)
    scaling = float(attention_scaling)
    if torch.compiler.is_compiling():
        return _rope_fwd_op(q, k, position_ids, inv_freq, scaling, rd, layout)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        # Nothing to differentiate: the launcher alone, without the Function's host time.
        return _rope(q, k, position_ids, inv_freq, scaling, rd, layout, False, None, None)
    return RopeFunction.apply(q, k, position_ids, inv_freq, scaling, rd, layout, False)


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
        oq, ok = RopeCosSinFunction.apply(q, k, cos, sin, False)
    if ud == 2:
        oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
    return oq, ok
