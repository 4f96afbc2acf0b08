"""Autograd of the rotary maps: torch.library ops over the launchers, and one autograd formula
used two ways (``kernels.dispatch``): registered on each op, which torch.compile graphs hold, and
as the eager ``autograd.Function`` over the same launcher (``FUNCTIONS``).

Both maps are linear in q and k, and each one's transpose is its partner: ``rope_fwd`` and
``rope_bwd`` (same layout), ``rope_cos_sin_fwd`` and ``rope_cos_sin_bwd``. So the one formula is
"the backward of a map is its partner on the output grads, with the saved positions (or cos/sin)
and arguments": on an op the partner op, in an eager Function the partner's Function when the
backward is itself recorded (double backward, ``create_graph=True``) and its launcher otherwise.
"""

from __future__ import annotations

import torch

from ..dispatch import eager_function
from .launch import _rope, _rope_cos_sin

__all__ = ["FUNCTIONS", "OPS"]


# ---------------------------------------------------------------------------------------------
# The launchers with the ops' schemas. The op names (``torch.ops.surgery.rope_*``) are stable;
# ``layout`` and the multimodal arguments have defaults so that calls written before they existed
# keep their meaning.


def _section(mrope_section):
    # The schema's int[] arrives as a list; the launcher keys caches on it.
    return None if mrope_section is None else tuple(mrope_section)


def _rope_fwd(
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
    return _rope(q, k, position_ids, inv_freq, attention_scaling, rotary_dim, layout, False, None,
                 None, _section(mrope_section), mrope_interleaved)  # fmt: skip


def _rope_bwd(
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
    return _rope(grad_q, grad_k, position_ids, inv_freq, attention_scaling, rotary_dim, layout,
                 True, None, None, _section(mrope_section), mrope_interleaved)  # fmt: skip


def _rope_cos_sin_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_cos_sin(q, k, cos, sin, False, None, None)


def _rope_cos_sin_bwd(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_cos_sin(grad_q, grad_k, cos, sin, True, None, None)


# ---------------------------------------------------------------------------------------------
# The one formula.


def _save_rope_args(ctx, inputs, output):
    _, _, position_ids, inv_freq, *rope_args = inputs
    ctx.save_for_backward(position_ids, inv_freq)
    ctx.rope_args = tuple(rope_args)  # scaling, rotary_dim, layout[, mrope_section, interleaved]


def _save_cos_sin(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _partner_backward(partner, n_extra):
    def backward(ctx, grad_q, grad_k):
        # Grads reach us as new tensors from autograd; the partner writes new ones again, so
        # nothing autograd still holds is overwritten.
        extra = getattr(ctx, "rope_args", ())
        dq, dk = partner(grad_q, grad_k, *ctx.saved_tensors, *extra)
        return (dq, dk) + (None,) * n_extra

    return backward


# name: (launcher, partner, setup_context, number of inputs after q and k)
_MAPS = {
    "rope_fwd": (_rope_fwd, "rope_bwd", _save_rope_args, 7),
    "rope_bwd": (_rope_bwd, "rope_fwd", _save_rope_args, 7),
    "rope_cos_sin_fwd": (_rope_cos_sin_fwd, "rope_cos_sin_bwd", _save_cos_sin, 2),
    "rope_cos_sin_bwd": (_rope_cos_sin_bwd, "rope_cos_sin_fwd", _save_cos_sin, 2),
}


def _fake_like(x, y, *args):
    return torch.empty_like(x), torch.empty_like(y)


def _eager_partner(name):
    launcher = _MAPS[name][0]

    def partner(*inputs):
        if torch.is_grad_enabled():  # a double backward records this one
            return FUNCTIONS[name].apply(*inputs)
        return launcher(*inputs)

    return partner


# The ops, opaque to torch.compile (fullgraph=True traces through them), and the eager Functions.
OPS: dict[str, torch.library.CustomOpDef] = {}
FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}
for _name, (_launcher, _, _, _) in _MAPS.items():
    OPS[_name] = torch.library.custom_op(f"surgery::{_name}", _launcher, mutates_args=())
    OPS[_name].register_fake(_fake_like)
for _name, (_launcher, _partner, _setup, _n_extra) in _MAPS.items():
    OPS[_name].register_autograd(_partner_backward(OPS[_partner], _n_extra), setup_context=_setup)
    _function_name = "".join(part.title() for part in _name.split("_")) + "Function"
    FUNCTIONS[_name] = eager_function(
        _function_name, _launcher, _setup, _partner_backward(_eager_partner(_partner), _n_extra)
    )
