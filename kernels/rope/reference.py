"""The rotary embedding in plain PyTorch: the reference ``apply_rope`` is tested against."""

from __future__ import annotations

import torch

__all__ = ["apply_rope_reference", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (transformers' helper)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    rotary_dim: int | None = None,
    layout: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``apply_rope`` in plain PyTorch: angles = position * inv_freq, the first
    ``rotary_dim`` channels rotated in ``layout`` ("half", "interleaved" or
    "interleaved_to_half", as ``apply_rope``) and the rest passed through.

    Computed in fp32, or in fp64 when q is fp64 (tests use that as ground truth: the angle
    product is then exact too); differentiable; the result is cast back to q's dtype.
    """
    if layout not in ("half", "interleaved", "interleaved_to_half"):
        raise ValueError(f"apply_rope_reference: unknown layout {layout!r}")
    d = q.shape[-1] if rotary_dim is None else rotary_dim
    ct = torch.promote_types(q.dtype, torch.float32)
    pos = position_ids.to(ct)
    freqs = pos[..., None] * inv_freq.to(ct)[None, None, :]  # (B|1, T, d/2)
    if layout == "half":
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * attention_scaling)[:, None]  # (B|1, 1, T, d)
        sin = (emb.sin() * attention_scaling)[:, None]
    else:
        cos = (freqs.cos() * attention_scaling)[:, None]  # (B|1, 1, T, d/2)
        sin = (freqs.sin() * attention_scaling)[:, None]

    def rotate(xr):
        if layout == "half":
            return xr * cos + rotate_half(xr) * sin
        pairs = xr.unflatten(-1, (d // 2, 2))  # pair j = channels (2j, 2j + 1)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if layout == "interleaved":
            return torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((o1, o2), dim=-1)

    def rot(x):
        xf = x.to(ct)
        out = torch.cat((rotate(xf[..., :d]), xf[..., d:]), dim=-1)
        return out.to(x.dtype)

    return rot(q), rot(k)
