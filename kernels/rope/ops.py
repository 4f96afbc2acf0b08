"""Autograd of the rotary maps: torch.library ops over the launchers, whose registered autograd
is each map's one backward, eager and under torch.compile alike.

Both maps are linear in q and k, and each one's transpose is its partner: ``rope_fwd`` and
``rope_bwd`` (same layout), ``rope_cos_sin_fwd`` and ``rope_cos_sin_bwd``. So each op's backward is
its partner op, and double backward works too.
"""

from __future__ import annotations

import torch

from .launch import rope_bwd, rope_cos_sin_bwd, rope_cos_sin_fwd, rope_fwd

__all__: list[str] = []  # the ops are reached through torch.ops.surgery and ``api``


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
