"""transformers' eager attention with less kept for the backward.

With ``eager_attention_recompute`` (the default), ``attn_implementation="eager"`` (Gemma 2's, for
its attention-logit softcap) runs ``lean_eager_attention``: transformers' eager chain, op for op,
but the fp32 softmax output is not kept for the backward. transformers keeps, per layer, the tanh
output (softcap), the fp32 probabilities and their half-precision copy; here only the tanh output
(or, with no softcap, the scores) and the half-precision copy, and the backward recomputes the
softmax from them with the same ops, so gradients are bit for bit transformers'. That is 4 bytes
per attention score less per layer (2 bytes with no softcap): 1 GiB per layer for Gemma-2-2B at
2 x 4096.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from surgery.forwards import recompute

__all__ = ["lean_eager_attention"]


def _probabilities(kept: torch.Tensor, mask: torch.Tensor | None, softcap: float | None):
    # transformers' eager chain after the tanh (softcap) or from the scaled scores (no softcap).
    x = kept * softcap if softcap is not None else kept
    if mask is not None:
        x = x + mask
    return F.softmax(x, dim=-1, dtype=torch.float32).to(kept.dtype)


class _LeanProbabilities(torch.autograd.Function):
    """``softmax(softcap(scores) + mask)`` in fp32, rounded to the scores' dtype, keeping only
    ``tanh(scores / softcap)`` (or the scores) for the backward, which rebuilds the rest with the
    same ops and differentiates them with autograd: the gradient is transformers', bit for bit."""

    @staticmethod
    def forward(ctx, scores, mask, softcap):
        kept = torch.tanh(scores / softcap) if softcap is not None else scores
        ctx.softcap = softcap
        ctx.save_for_backward(kept, mask)
        return _probabilities(kept, mask, softcap)

    @staticmethod
    def backward(ctx, grad):
        kept, mask = ctx.saved_tensors
        with torch.enable_grad():
            leaf = kept.detach().requires_grad_()
            (grad_kept,) = torch.autograd.grad(_probabilities(leaf, mask, ctx.softcap), leaf, grad)
        if ctx.softcap is None:
            return grad_kept, None, None
        # transformers' TanhBackward0 then DivBackward0 (scores / softcap).
        return torch.ops.aten.tanh_backward(grad_kept, kept) / ctx.softcap, None, None


def lean_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    *,
    eager: Callable,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``eager_attention_forward`` (GQA repeat, scaling, optional softcap, additive
    mask, fp32 softmax), keeping less for the backward (see the module docstring). Without
    gradients or with attention dropout in training, ``eager`` (the model's own eager function,
    same signature) runs instead.
    Under ``torch.compile`` the probabilities are an activation-checkpoint region of their own
    (``surgery.forwards.recompute.compiled_recompute``; the autograd.Function's backward cannot be
    traced): the compiled graph keeps the tanh output (or the scores) alone, and rebuilds both
    probability tensors in the backward with one softmax, as the eager backward does."""
    if not torch.is_grad_enabled() or (dropout and module.training):
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     softcap=softcap, **kwargs)  # fmt: skip
    if scaling is None:  # as the models' eager functions do; attention_forward always passes it
        scaling = module.head_dim**-0.5
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if recompute.compiling_with_grad():
        kept = torch.tanh(scores / softcap) if softcap is not None else scores
        probs = recompute.compiled_recompute(_probabilities, kept, attention_mask, softcap)
    else:
        probs = _LeanProbabilities.apply(scores, attention_mask, softcap)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs
