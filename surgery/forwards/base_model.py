"""The base model's forward (``model.model``), wrapped where the patched layers need something of
the whole batch that transformers does not hand them. The wrapper finds it once per forward and
passes it under keyword arguments of surgery's own; the base model passes its keyword arguments
to the decoder layers, which pass theirs on to the attention and linear-attention layers (each
layer drops those that are not for it). What a spec asks for (``BaseModelNeeds``):

- the position ids (``ArchitectureSpec.positions_to_attention``, Llama 4, whose decoder layers do
  not pass them on): ``POSITIONS_KWARG``, the position ids the base model uses (the caller's, or
  its default: the cached length onwards); on a packed batch (position ids, no attention mask, no
  KV cache yet) of a model with chunked layers (``chunked_attention``) also their mask
  (``CHUNKED_MASK_KWARG``, ``surgery.attention.chunked``);
- the documents of a packed batch (``linear_attention``, hybrid models): ``DOCUMENTS_KWARG``
  (``surgery.attention.linear``), unless the caller found them already: the causal-LM forward of
  a training or loss step does, from the one host read of the position ids that also gives the
  varlen attention its documents (``surgery.forwards.causal_lm``). Where fla runs those layers
  (``surgery.integrations.fla``), a padded batch's real tokens too (``padded_documents``, one host
  read of the 2-D attention mask; not under ``torch.compile``, nor with a KV cache).

Everything else goes to transformers' own forward as given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from surgery.attention.chunked import (
    CHUNKED_MASK_KWARG,
    POSITIONS_KWARG,
    packed_chunked_mask,
)
from surgery.attention.forward import MROPE_POSITIONS_KWARG
from surgery.attention.linear import (
    DOCUMENTS_KWARG,
    fla_kernels,
    packed_documents,
    padded_documents,
)
from surgery.forwards.causal_lm import document_positions
from surgery.models import ArchitectureSpec
from surgery.options import PatchOptions
from surgery.patching.signature import CACHE, cache_argument, in_signature_of

__all__ = [
    "BASE_MODEL_ATTR",
    "BaseModelNeeds",
    "base_model_forward",
    "base_model_forward_for",
    "base_model_needs",
]

BASE_MODEL_ATTR = "_surgery_base_model"
"""Instance attribute of a patched base model: its ``BaseModelNeeds``."""


@dataclass(frozen=True)
class BaseModelNeeds:
    """What the base model's forward hands its layers."""

    positions: bool
    """The position ids, to the attention (``ArchitectureSpec.positions_to_attention``)."""
    chunked_mask: bool
    """On a packed batch, the chunked layers' mask (``ArchitectureSpec.chunked_attention``)."""
    documents: bool
    """On a packed batch, its documents, to the linear-attention layers
    (``ArchitectureSpec.linear_attention``)."""
    rope_positions: bool = False
    """The positions the rotary module takes, to the attention (``ArchitectureSpec.mrope``: the
    decoder layers pass text positions, or none where the positions are 3-D)."""


def base_model_needs(spec: ArchitectureSpec, options: PatchOptions) -> BaseModelNeeds | None:
    """What the base model of a ``spec`` model patched with ``options`` hands its layers, or None
    when nothing (its forward is left alone). The position ids and the chunked mask are for the
    generic attention forward, installed with ``rope``; the documents are for the linear-attention
    layers, always patched."""
    needs = BaseModelNeeds(
        positions=options.rope and spec.positions_to_attention,
        chunked_mask=options.rope and spec.positions_to_attention and spec.chunked_attention,
        documents=spec.linear_attention is not None,
        rope_positions=options.rope and spec.mrope,
    )
    return needs if needs.positions or needs.documents or needs.rope_positions else None


def base_model_forward(
    self: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
):
    """transformers' base-model forward, handing the layers what ``BaseModelNeeds`` asks for
    (see the module docstring)."""
    cache = cache_argument(cache, kwargs)
    needs: BaseModelNeeds = self.__dict__[BASE_MODEL_ATTR]
    tokens = input_ids if input_ids is not None else inputs_embeds
    batch, seq = tokens.shape[:2]
    packed = position_ids is not None and attention_mask is None and cache is None
    if needs.positions or needs.rope_positions:
        positions = position_ids
        if positions is None:  # the base model's own default
            past = cache.get_seq_length() if cache is not None else 0
            positions = torch.arange(seq, device=tokens.device)[None] + past
        elif positions.dim() == 1:
            positions = positions[None]
    if needs.rope_positions:
        # transformers' multimodal text models take (batch, seq) text positions, (3, batch, seq)
        # rotary ones, or both as (4, batch, seq) (the text row first): the rotary module gets
        # the last three rows, or the text row in all three.
        kwargs[MROPE_POSITIONS_KWARG] = positions[-3:] if positions.dim() == 3 else positions
    if needs.positions:
        kwargs[POSITIONS_KWARG] = positions
        if needs.chunked_mask and packed:
            dtype = tokens.dtype if input_ids is None else self.get_input_embeddings().weight.dtype
            mask = packed_chunked_mask(self, positions, batch, dtype)
            if mask is not None:
                kwargs[CHUNKED_MASK_KWARG] = mask
    # The documents: found by the caller already, or here. None (every row one document) is
    # passed as such: the layers then drop the packed layout's arguments (surgery.attention.linear).
    if needs.documents and DOCUMENTS_KWARG not in kwargs:
        if packed and (text := document_positions(position_ids)) is not None:
            kwargs[DOCUMENTS_KWARG] = packed_documents(text, (batch, seq), tokens.device)
        elif (
            attention_mask is not None
            and attention_mask.dim() == 2
            and cache is None
            and fla_kernels(tokens.device) is not None
        ):
            documents = padded_documents(attention_mask)  # fla runs the real tokens only
            if documents is not None:
                kwargs[DOCUMENTS_KWARG] = documents
    return type(self).forward(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **{CACHE: cache},
        **kwargs,
    )


def base_model_forward_for(model: nn.Module) -> Callable:
    """``base_model_forward`` taking its arguments in the order of ``model``'s class forward
    (``surgery.patching.signature.in_signature_of``)."""
    return in_signature_of(base_model_forward, type(model).forward)
