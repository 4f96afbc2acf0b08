"""The output classes of the patched forwards: the model's own output class plus ``z_loss``.

transformers' causal LMs (and multimodal wrappers) each return a ``ModelOutput`` dataclass:
``CausalLMOutputWithPast``, ``MoeCausalLMOutputWithPast`` (``aux_loss``, ``router_logits``) or a
class of their own (``Gemma4CausalLMOutputWithPast``: ``shared_kv_states``; Gemma 3's wrapper:
``image_hidden_states``). The patched forward returns that class (read from the forward's return
annotation, ``causal_lm_output_class``) plus a ``z_loss`` field (``with_z_loss``): the loss
fields it computes itself (``COMPUTED_FIELDS``), every other field copied from the base model's
output as transformers' forward copies it. Every such class is a ``ZLossOutput``: the one class a
caller can test a patched model's output against.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import ModelOutput

from surgery.models import ArchitectureSpec, MultimodalWrapper

__all__ = [
    "COMPUTED_FIELDS",
    "CausalLMOutputWithZLoss",
    "MoeCausalLMOutputWithZLoss",
    "ZLossOutput",
    "causal_lm_output_class",
    "with_z_loss",
]


class ZLossOutput:
    """The base of every output class a patched forward returns (``CausalLMOutputWithZLoss``,
    ``MoeCausalLMOutputWithZLoss``, and those made for other transformers classes by
    ``with_z_loss``, e.g. ``Gemma4CausalLMOutputWithZLoss``): ``isinstance(out, ZLossOutput)``
    holds for all of them, and each has the field ``z_loss``."""

    z_loss: torch.Tensor | None


@dataclass
class CausalLMOutputWithZLoss(CausalLMOutputWithPast, ZLossOutput):
    """``CausalLMOutputWithPast`` plus ``z_loss``: the z-loss term already inside ``loss`` (same
    reduction, detached, for logging); None unless ``z_loss_scale > 0`` and a loss was computed."""

    z_loss: torch.Tensor | None = None


@dataclass
class MoeCausalLMOutputWithZLoss(MoeCausalLMOutputWithPast, ZLossOutput):
    """transformers' ``MoeCausalLMOutputWithPast`` (``aux_loss``, ``router_logits``) plus
    ``z_loss``, as in ``CausalLMOutputWithZLoss``."""

    z_loss: torch.Tensor | None = None


_Z_LOSS_OUTPUTS: dict[type, type] = {
    CausalLMOutputWithPast: CausalLMOutputWithZLoss,
    MoeCausalLMOutputWithPast: MoeCausalLMOutputWithZLoss,
}
# Fields of the output that the causal-LM forward computes; transformers' causal LMs copy every
# other field from their base model's output.
COMPUTED_FIELDS = ("loss", "logits", "aux_loss", "z_loss")


def with_z_loss(output: type) -> type:
    """``output`` (a ``ModelOutput`` dataclass) plus ``z_loss``: ``CausalLMOutputWithZLoss`` and
    ``MoeCausalLMOutputWithZLoss`` for transformers' two common classes, else a subclass made once
    (``Gemma4CausalLMOutputWithPast`` -> ``Gemma4CausalLMOutputWithZLoss``)."""
    found = _Z_LOSS_OUTPUTS.get(output)
    if found is None:
        name = output.__name__.removesuffix("WithPast") + "WithZLoss"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"transformers' ``{output.__name__}`` plus ``z_loss``, as in "
            "``CausalLMOutputWithZLoss``.",
            "__annotations__": {"z_loss": "torch.Tensor | None"},
            "z_loss": None,
        }
        found = _Z_LOSS_OUTPUTS[output] = dataclass(type(name, (output, ZLossOutput), namespace))
        globals().setdefault(name, found)  # found by name, as pickle looks it up
    return found


def causal_lm_output_class(
    spec: ArchitectureSpec, wrapper: MultimodalWrapper | None = None
) -> type:
    """The output class of ``spec``'s causal LM (or of its multimodal ``wrapper``): the
    ``ModelOutput`` its forward's return annotation names (``Llama4ForCausalLM``: ``tuple |
    MoeCausalLMOutputWithPast`` in 5.23, ``tuple | CausalLMOutputWithPast`` in 5.17;
    ``Gemma3ForConditionalGeneration``: ``Gemma3CausalLMOutputWithPast``), else transformers'
    ``CausalLMOutputWithPast``, or ``MoeCausalLMOutputWithPast`` for a router aux loss (also where
    the annotated class has no ``aux_loss``)."""
    moe = spec.router_aux_loss
    default = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    try:
        cls = spec.causal_lm_class() if wrapper is None else wrapper.wrapper_class()
        annotation = typing.get_type_hints(cls.forward).get("return")
    except (AttributeError, ImportError, NameError, TypeError):  # unresolvable annotations
        return default
    found = [
        t
        for t in typing.get_args(annotation) or (annotation,)
        if isinstance(t, type) and issubclass(t, ModelOutput)
    ]
    if len(found) != 1:
        return default
    if moe and "aux_loss" not in {field.name for field in dataclasses.fields(found[0])}:
        return default
    return found[0]
