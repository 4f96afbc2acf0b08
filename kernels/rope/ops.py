"""Autograd of the rotary maps: torch.library ops (what torch.compile sees) and the eager
``torch.autograd.Function``s over the same launchers.

Both maps are linear in q and k, and each one's transpose is its partner: ``rope_fwd`` and
``rope_bwd`` (same layout), ``rope_cos_sin_fwd`` and ``rope_cos_sin_bwd``. So each op's backward is
its partner op, and double backward works too.
"""

from __future__ import annotations

import torch

from .launch import _rope, _rope_cos_sin, rope_bwd, rope_cos_sin_bwd, rope_cos_sin_fwd, rope_fwd

__all__ = ["RopeCosSinFunction", "RopeFunction"]


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (fullgraph=True traces through them). The op names
# (``torch.ops.surgery.rope_*``) are stable; ``layout`` and the multimodal arguments have
# defaults so that calls written before they existed keep their meaning.


def _section(mrope_section):
    # The schema's int[] arrives as a list; the launcher keys caches on it.
    return None if mrope_section is None else tuple(mrope_section)


@torch.library.custom_op("surgery::rope_fwd", mutates_args=())
def _rope_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    layout: str = "half",
    mrope_section: list[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    section = _section(mrope_section)
    return rope_fwd(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, layout,
                  mrope_section=section, mrope_interleaved=mrope_interleaved)  # fmt: skip


@torch.library.custom_op("surgery::rope_bwd", mutates_args=())
def _rope_bwd_op(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    layout: str = "half",
    mrope_section: list[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    section = _section(mrope_section)
    return rope_bwd(grad_q, grad_k, position_ids, inv_freq, attention_scaling, rotary_dim, layout,
                  mrope_section=section, mrope_interleaved=mrope_interleaved)  # fmt: skip


@torch.library.custom_op("surgery::rope_cos_sin_fwd", mutates_args=())
def _rope_cos_sin_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_fwd(q, k, cos, sin)


@torch.library.custom_op("surgery::rope_cos_sin_bwd", mutates_args=())
def _rope_cos_sin_bwd_op(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_bwd(grad_q, grad_k, cos, sin)


def _fake_like(x, y, *args):
    return torch.empty_like(x), torch.empty_like(y)


for _op in (_rope_fwd_op, _rope_bwd_op, _rope_cos_sin_fwd_op, _rope_cos_sin_bwd_op):
    _op.register_fake(_fake_like)


def _save_rope_args(ctx, inputs, output):
    _, _, position_ids, inv_freq, *rope_args = inputs
    ctx.save_for_backward(position_ids, inv_freq)
    ctx.rope_args = tuple(rope_args)  # scaling, rotary_dim, layout, mrope_section, interleaved


def _save_cos_sin(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _partner_backward(partner_op, n_extra):
    def backward(ctx, grad_q, grad_k):
        # Grads reach us as new tensors from autograd; the partner op writes new ones again, so
        # nothing autograd still holds is overwritten.
        extra = getattr(ctx, "rope_args", ())
        dq, dk = partner_op(grad_q, grad_k, *ctx.saved_tensors, *extra)
        return (dq, dk) + (None,) * n_extra

    return backward


_rope_fwd_op.register_autograd(_partner_backward(_rope_bwd_op, 7), setup_context=_save_rope_args)
_rope_bwd_op.register_autograd(_partner_backward(_rope_fwd_op, 7), setup_context=_save_rope_args)
_rope_cos_sin_fwd_op.register_autograd(
    _partner_backward(_rope_cos_sin_bwd_op, 2), setup_context=_save_cos_sin
)
_rope_cos_sin_bwd_op.register_autograd(
    _partner_backward(_rope_cos_sin_fwd_op, 2), setup_context=_save_cos_sin
)


# ---------------------------------------------------------------------------------------------
# Eager autograd.


class RopeFunction(torch.autograd.Function):
    """Eager autograd over the launchers, for the same maps as the ops above. The ops carry the
    autograd torch.compile sees; in eager mode their Python dispatch costs several times this
    Function's host time, which shows when the GPU work is a tenth of a millisecond."""

    @staticmethod
    def forward(ctx, q, k, position_ids, inv_freq, attention_scaling, rotary_dim, layout, inverse,
                mrope_section=None, mrope_interleaved=False):  # fmt: skip
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.rope_args = (attention_scaling, rotary_dim, layout, inverse, mrope_section,
                         mrope_interleaved)  # fmt: skip
        return _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, layout, inverse,
                     None, None, mrope_section, mrope_interleaved)  # fmt: skip

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        scaling, rotary_dim, layout, inverse, section, interleaved = ctx.rope_args
        args = (grad_q, grad_k, *ctx.saved_tensors, scaling, rotary_dim, layout, not inverse)
        # Only a double backward (create_graph=True) needs this backward to be differentiable;
        # otherwise the launcher runs directly, without a second Function's host cost.
        if torch.is_grad_enabled():
            dq, dk = RopeFunction.apply(*args, section, interleaved)
        else:
            dq, dk = _rope(*args, None, None, section, interleaved)
        return dq, dk, None, None, None, None, None, None, None, None


class RopeCosSinFunction(torch.autograd.Function):
    """Eager autograd of the cos/sin map (see ``RopeFunction``)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, transpose):
        ctx.save_for_backward(cos, sin)
        ctx.transpose = transpose
        return _rope_cos_sin(q, k, cos, sin, transpose, None, None)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward
            dq, dk = RopeCosSinFunction.apply(grad_q, grad_k, cos, sin, not ctx.transpose)
        else:
            dq, dk = _rope_cos_sin(grad_q, grad_k, cos, sin, not ctx.transpose, None, None)
        return dq, dk, None, None, None
