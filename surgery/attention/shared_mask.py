"""One sdpa mask shared by every layer of a forward.

With ``share_attention_mask`` (the default), a boolean 4-D mask bound for sdpa is converted to an
additive one (0 where attended, the dtype's lowest finite value elsewhere, in the query dtype) once
per forward, and every layer gets that one tensor. sdpa converts a boolean mask itself on every
call, and its masked backends (cuDNN on sm90, memory-efficient elsewhere) keep the converted copy
for the backward: one (batch, 1, seq, seq) tensor per layer, 64 MiB per layer at 2 x 4096 in bf16
(1 GiB for a 16-layer model). The lowest finite value rather than -inf, as transformers' own eager
masks and sdpa's cuDNN conversion use, so that no backend meets a row of -inf: every query row
with at least one attended key gets exactly the weights it gets with -inf (exp underflows to 0).
A query row that attends to no key (every left-pad position; a pad position whose sliding window
holds only padding) is where the two differ: sdpa's convention (torch >= 2.5) gives it zeros, and
its query, key and value no gradient from it, while the finite mask gives it an even spread over
every key on some backends (math, and on CPU). So the rows that attend to nothing are found once
per forward too, and each layer sets them in o_proj's output to what o_proj makes of a zero row
(zeros, or its bias): the forward and every gradient are then those of sdpa's convention on every
backend. (torch 2.11 hands cuDNN a boolean mask with -65504 for False, so that there, on the
boolean mask itself, such a row attends to every key.) Both are cached on the boolean mask tensor
itself, so they live exactly as long as the mask transformers built for this forward (and any
autograd graph that saved it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from surgery.forwards.tensor_parallel import local_tensor

__all__ = ["SharedMask", "shared_sdpa_mask", "tensor_version", "zero_unattended_rows"]

SHARED_MASK_ATTR = "_surgery_shared_mask"


@dataclass(frozen=True)
class SharedMask:
    """A boolean attention mask in the form every sdpa layer of one forward is given."""

    additive: torch.Tensor
    """(batch, 1, q, kv) in the query dtype: 0 where the boolean mask is True, the dtype's lowest
    finite value where it is False."""
    unattended: torch.Tensor
    """bool (batch, q, 1): the query rows that attend to no key, laid out like o_proj's output."""


def shared_sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> SharedMask | None:
    """The ``SharedMask`` of a boolean (batch, 1, q, kv) attention mask, built once per mask tensor,
    its version and ``dtype``, and cached on the mask; None for anything else (no mask, an additive
    one, one mask per head), which goes to sdpa as is, and under ``torch.compile`` (the compiler
    sees the whole graph).

    With ``additive`` in place of the boolean mask, sdpa gives every row that attends to some key
    the same attention, bit for bit (the masked weights underflow to exactly 0); the rows in
    ``unattended`` are finite there, where the boolean mask gives zeros
    (``zero_unattended_rows`` makes them so).
    """
    if (
        mask is None
        or mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[1] != 1
        or torch.compiler.is_compiling()
    ):
        return None
    version = tensor_version(mask)
    cached = getattr(mask, SHARED_MASK_ATTR, None)
    if cached is not None and cached[0] == version and cached[1].additive.dtype == dtype:
        return cached[1]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    additive.masked_fill_(mask.logical_not(), torch.finfo(dtype).min)
    unattended = mask.any(dim=-1).logical_not_().transpose(1, 2)
    shared = SharedMask(additive, unattended)
    setattr(mask, SHARED_MASK_ATTR, (version, shared))
    return shared


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by each in-place change), for a cache kept on the tensor
    to tell a refilled tensor from the one it was built from; None for an inference-mode tensor,
    which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def zero_unattended_rows(
    output: torch.Tensor, unattended: torch.Tensor, o_proj: nn.Module
) -> torch.Tensor:
    """o_proj's ``output`` (batch, q, hidden) with the ``unattended`` rows set to what o_proj
    gives a zero row: zeros, or o_proj's bias. What sdpa gives those rows on the boolean mask,
    forward and backward: the rows pass no gradient back, so the attention's query, key and value
    get none from them, and o_proj's weight none either (as from a zero input row).

    Set here rather than on o_proj's input, because o_proj keeps its input for the backward and
    sdpa its output: a changed copy of the input would be one more (batch, q, hidden) tensor kept
    per layer, as large as the mask copy the shared mask saves when seq is near hidden. With a
    bias, the bias's gradient sums the same terms in another order (the unattended rows' apart).
    """
    # A row-wise tensor-parallel o_proj's bias is replicated: every rank's output is the whole.
    bias = local_tensor(getattr(o_proj, "bias", None))
    # torch.where rather than masked_fill: a third less time forward and backward on CUDA.
    return torch.where(unattended, 0.0 if bias is None else bias.to(output.dtype), output)
