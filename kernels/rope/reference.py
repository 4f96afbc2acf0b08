"""The rotary embedding in plain PyTorch: the reference ``apply_rope`` is tested against."""

from __future__ import annotations

import torch

__all__ = ["apply_rope_reference", "multimodal_angles", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (transformers' helper)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def multimodal_angles(
    freqs: torch.Tensor, mrope_section: list[int], interleaved: bool = False
) -> torch.Tensor:
    """(3, ..., n) angles of the temporal, height and width rows -> (..., n): each frequency's
    angle from its section's row. Contiguous: the first ``mrope_section[0]`` frequencies from
    row 0, the next ``mrope_section[1]`` from row 1, the rest from row 2. Interleaved: every
    third frequency from 1 on from row 1 (the first ``mrope_section[1]`` of them), from 2 on from
    row 2 (the first ``mrope_section[2]``), all others from row 0."""
    if not interleaved:
        parts = freqs.split(list(mrope_section), dim=-1)
        return torch.cat([part[row] for row, part in enumerate(parts)], dim=-1)
    out = freqs[0].clone()
    for row in (1, 2):
        picked = slice(row, 3 * mrope_section[row], 3)
        out[..., picked] = freqs[row][..., picked]
    return out


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    rotary_dim: int | None = None,
    layout: str = "half",
    mrope_section: list[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``apply_rope`` in plain PyTorch: angles = position * inv_freq, the first
    ``rotary_dim`` channels rotated in ``layout`` ("half", "interleaved" or
    "interleaved_to_half", as ``apply_rope``) and the rest passed through.

    With ``mrope_section``, ``position_ids`` is (3, B|1, T): the angles of all three rows are
    computed and each frequency's is taken from its section's row (``multimodal_angles``).

    Computed in fp32, or in fp64 when q is fp64 (tests use that as ground truth: the angle
    product is then exact too); differentiable; the result is cast back to q's dtype.
    """
    if layout not in ("half", "interleaved", "interleaved_to_half"):
        raise ValueError(f"apply_rope_reference: unknown layout {layout!r}")
    d = q.shape[-1] if rotary_dim is None else rotary_dim
    ct = torch.promote_types(q.dtype, torch.float32)
    pos = position_ids.to(ct)
    freqs = pos[..., None] * inv_freq.to(ct)  # (B|1, T, d/2), or (3, B|1, T, d/2)
    if mrope_section is not None:
        freqs = multimodal_angles(freqs, mrope_section, mrope_interleaved)
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
