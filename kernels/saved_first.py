"""A custom autograd node whose tensors are saved before its output is computed, as autograd's
own products save their inputs.

A ``torch.autograd.Function`` packs what its forward saved only once the forward has returned:
its output is computed first. Non-reentrant checkpointing (``torch.utils.checkpoint`` with
``use_reentrant=False``: FSDP2's and accelerate's activation checkpointing, transformers'
``gradient_checkpointing_enable`` asked for it) stops recomputing a layer in the backward as soon
as every tensor the layer saved is back. A product that ends a layer inside a Function is then
recomputed for nothing, where ``nn.Linear``'s is not: on a Llama-3-8B-shaped model under FSDP2,
one (tokens x 14336) x (14336 x 4096) product per layer and step.

So such a node is two Functions: the first saves its tensors and returns ``stand_in`` in place of
the output (a zero-strided tensor of the output's shape and dtype: no memory) and keeps the
backward; the second, an ``OutputNode``, saves nothing, computes the output from the first's
inputs, checks it against the stand-in (``checked_output``) and hands the output's gradient back
to the first whole. Recomputation stops at the first's save, before the second's product.
"""

from __future__ import annotations

import torch

__all__ = ["OutputNode", "checked_output", "stand_in"]


def stand_in(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What the saving Function returns for the output the second Function computes: a tensor of
    ``shape`` and ``dtype`` with every stride 0 (one element of memory)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def checked_output(out: torch.Tensor, standing_in: torch.Tensor) -> torch.Tensor:
    """``out``, the second Function's output, after checking it has the stand-in's shape and dtype
    (its gradient reaches the saving Function as the stand-in's, which autograd would otherwise
    cast or reject)."""
    if out.shape != standing_in.shape or out.dtype != standing_in.dtype:
        raise RuntimeError(
            f"internal error: output {tuple(out.shape)} {out.dtype} does not match its stand-in "
            f"{tuple(standing_in.shape)} {standing_in.dtype}"
        )
    return out


class OutputNode(torch.autograd.Function):
    """The second Function: a subclass's ``forward(ctx, standing_in, *inputs)`` computes the
    output for ``standing_in`` (returning ``checked_output(out, standing_in)``); the backward
    hands the output's gradient to the stand-in whole, and none to the other inputs, whose
    gradients the saving Function gives."""

    @staticmethod
    def backward(ctx, grad):
        return grad, *(None,) * (len(ctx.needs_input_grad) - 1)
