"""Position-aware rotary embedding (RoPE).

PLACEHOLDER STAGE: the public functions below currently run the fp32 reference; the Triton kernel
(issue 4) replaces the body of ``apply_rope`` without changing its signature.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "apply_rope_reference", "apply_rotary_pos_emb"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(q, k, position_ids, inv_freq, attention_scaling=1.0, rotary_dim=None):
    """fp32 reference: angles = position * inv_freq, rotate-half layout, first ``rotary_dim``
    channels rotated and the rest passed through."""
    d = q.shape[-1] if rotary_dim is None else rotary_dim
    pos = position_ids.to(torch.float32)
    freqs = pos[..., None] * inv_freq.to(torch.float32)[None, None, :]  # (B|1, T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling)[:, None]  # (B|1, 1, T, d)
    sin = (emb.sin() * attention_scaling)[:, None]

    def rot(x):
        xf = x.float()
        xr, xp = xf[..., :d], xf[..., d:]
        out = torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)
        return out.to(x.dtype)

    return rot(q), rot(k)


def apply_rope(q, k, position_ids, inv_freq, attention_scaling=1.0, rotary_dim=None):
    return apply_rope_reference(q, k, position_ids, inv_freq, attention_scaling, rotary_dim)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos + _rotate_half(q) * sin), (k * cos + _rotate_half(k) * sin)
