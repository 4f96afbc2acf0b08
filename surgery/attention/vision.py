"""The Qwen-VL vision towers' attention as one variable-length flash attention call per layer.

The vision tower of the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and
Qwen3.5-MoE: ``MultimodalWrapper.vision_attention``) flattens the patches of every image and video
frame of a batch into one sequence and attends within segments of it, given as ``cu_seqlens``:
each image (or frame) in its full-attention blocks and, in Qwen2.5-VL, each window of 8 x 8
merged patches in the others. With flash attention transformers hands ``cu_seqlens`` to the
varlen kernel; with sdpa (the default) or eager it splits the sequence and calls the attention
once per segment: a Qwen2.5-VL step over a few images runs thousands of small attention calls
forward and backward, and the step waits on the host.

With ``varlen_attention`` (on by default), ``vision_attention_forward`` runs transformers' forward
(its qkv projection and its own ``apply_rotary_pos_emb_vision``, then the output projection)
with the attention of every segment in one ``varlen_attn`` call over ``cu_seqlens``, both
directions (``window_size=(-1, -1)``). It is the attention each segment gets alone: sdpa takes the
same flash kernel for a bf16 segment. It applies in half precision (16-bit weights, or
fp32 ones under a 16-bit autocast) on a CUDA GPU with flash attention
(``surgery.attention.varlen.varlen_kernel``) and a head size of whole 16-byte vectors (Qwen2.5-VL's
80, Qwen3-VL's 72); elsewhere (fp32, CPU, or a flash implementation, which is varlen already)
transformers' forward runs as it is.

The longest segment sizes the kernel's grid: eagerly it is read once per layer from
``cu_seqlens`` (transformers' sdpa path reads all the lengths per layer) unless the tower passed
it; under ``torch.compile`` the token count stands for it (an upper bound is exact: blocks past a
segment's end return at once), so nothing is read on the host.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.utils.generic import is_flash_attention_requested

from surgery.attention.varlen import flash_layout, flash_takes_heads, varlen_kernel

__all__ = ["VISION_ATTENTION_ATTR", "vision_attention_forward"]

VISION_ATTENTION_ATTR = "_surgery_vision_attention"
"""Instance attribute of a patched vision attention module (True)."""

_HALF = (torch.float16, torch.bfloat16)


def _half_precision(x: torch.Tensor) -> bool:
    """Whether the projections of ``x`` come out in 16 bits: ``x`` is, or autocast (mixed
    precision over fp32 weights, as the Trainer's ``bf16=True`` runs it) casts them."""
    device = x.device.type
    if x.dtype in _HALF:
        return True
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _HALF


def vision_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' vision attention forward (hidden_states (tokens, dim), ``cu_seqlens`` int32
    (segments + 1,)) with every segment's attention in one ``varlen_attn`` call; transformers'
    forward itself where that kernel does not apply (see the module docstring)."""
    kernel = varlen_kernel(hidden_states.device)
    head_dim = self.head_dim
    if (
        kernel is None
        or not _half_precision(hidden_states)
        or is_flash_attention_requested(self.config)
        or (self.training and self.attention_dropout > 0.0)
        or not flash_takes_heads(head_dim)  # 16-bit channels
    ):
        return type(self).forward(
            self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs
        )
    tokens = hidden_states.shape[0]
    query, key, value = self.qkv(hidden_states).view(tokens, 3, self.num_heads, head_dim).unbind(1)
    cos, sin = position_embeddings
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
    query, key = rotate(query, key, cos, sin)
    if max_seqlen is None:
        max_seqlen = tokens if torch.compiler.is_compiling() else int(cu_seqlens.diff().max())
    q, k, v = (flash_layout(x) for x in (query, key, value))
    cu = cu_seqlens.to(torch.int32)
    out = kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=self.scaling, window_size=(-1, -1))
    return self.proj(out.reshape(tokens, -1))
