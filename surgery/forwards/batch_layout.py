"""What a training step's batch is, read once where a shortcut needs it: a packed batch's documents
(for the varlen attention, a hybrid's linear attention and the loss's boundaries), a right-padded
batch's real rows (``PatchOptions.causal_right_padding``, ``padding_free``), a multimodal row's
tokens that attend both ways, and the loss's targets. Read by the causal-LM forward
(``surgery.forwards.causal_lm``); under ``torch.compile`` each host read is one deliberate graph
break (``surgery.compiling.host_read``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from surgery.attention.chunked import packed_chunk_size
from surgery.attention.forward import PACKED_KWARG, packed_sequences
from surgery.attention.linear import DOCUMENTS_KWARG, documents_of
from surgery.attention.unpadding import (
    ROLLED_KWARG,
    UNPADDED_KWARG,
    PaddedLayout,
    Rolled,
    Unpadded,
    read_padded_layout,
)
from surgery.compiling import host_read
from surgery.forwards.multimodal import packed_bidirectional_masks
from surgery.kernels.reduction import host_cu_seqlens
from surgery.models import ArchitectureSpec, MultimodalWrapper

__all__ = [
    "Targets",
    "bidirectional",
    "document_positions",
    "laid_out_inputs",
    "packed_inputs",
    "packed_layout",
    "padding_layout",
    "right_padding_applies",
    "unpadded_inputs",
    "whole_rows",
]


_packed_bidirectional_masks = host_read(packed_bidirectional_masks)


@host_read
def _read_packed_layout(
    position_ids: torch.Tensor,
    shape: tuple[int, int],
    device: torch.device,
    varlen: bool,
    chunk_size: int | None,
) -> dict:
    # One device-to-host copy of the position ids for both: the linear-attention layers'
    # documents (None: every row is one document) and, with varlen, the attention's.
    position_ids = position_ids.cpu()
    cu_seqlens = host_cu_seqlens(position_ids, shape)
    layout = {DOCUMENTS_KWARG: documents_of(cu_seqlens, shape, device)}
    if varlen:
        packed = packed_sequences(
            position_ids, shape, device, cu_seqlens=cu_seqlens, chunk_size=chunk_size
        )
        if packed is not None:
            layout[PACKED_KWARG] = packed
    return layout


def packed_layout(
    spec: ArchitectureSpec,
    position_ids: torch.Tensor,
    tokens: torch.Tensor,
    varlen: bool,
    host_reads: bool,
    chunk_size: int | None = None,
) -> dict:
    """The keyword arguments that give the base model a packed step's documents: for the varlen
    attention (``varlen``, see ``PatchOptions.varlen_attention``) and a hybrid model's
    linear-attention layers, both from one read of the position ids on the host. Under
    ``torch.compile`` without graph breaks (``host_reads`` False) the varlen attention reads them
    from an op at run time, and a hybrid's base model finds its documents itself (where
    ``fullgraph=True`` refuses the read). ``chunk_size``: the chunked-attention layers', if any
    (``packed_chunk_size``): their chunks come from the same read."""
    shape, device = tuple(tokens.shape[:2]), tokens.device
    if spec.linear_attention is not None and position_ids.dim() <= 2 and host_reads:
        # Each layout of documents compiles anew anyway: under torch.compile the read is one
        # graph break, and the varlen attention's lengths may be exact.
        return _read_packed_layout(position_ids, shape, device, varlen, chunk_size)
    packed = (
        packed_sequences(position_ids, shape, device, host_reads, chunk_size=chunk_size)
        if varlen
        else None
    )
    return {} if packed is None else {PACKED_KWARG: packed}


def right_padding_applies(options, config, kwargs, attention_mask, position_ids) -> bool:
    """Whether a fused, causal, plain-sdpa step without a cache may drop the attention mask of
    a right-padded batch (``PatchOptions.causal_right_padding``; the mask itself is read after):
    a mask given and no position ids, no hidden states asked for. Where it may, the attention
    layers without a sliding window drop the mask (``CAUSAL_KWARG``); the base model still gets
    it: a multimodal model may read it for more than the attention (Qwen2-VL's 3-D positions), a
    hybrid's linear-attention layers their documents, the sliding-window layers their masks. A
    mask of ones it does not get where the step makes a KV cache: that batch is the one without a
    mask, of which transformers' mask builder then reads nothing on the host (given the mask, it
    reads the mask; given none and no cache, the positions, checking for packed rows)."""
    return (
        options.causal_right_padding
        and attention_mask is not None
        and position_ids is None
        and not kwargs.get("output_hidden_states", config.output_hidden_states)
    )


def packed_inputs(self, state, config, text_positions, tokens, types, varlen, host_reads):
    """A packed step's attention mask for the base model and the keyword arguments that give it
    the documents (``packed_layout``). ``types``: a multimodal row's token types where its
    images attend both ways (else None): transformers' mask of such a packed row is not each
    conversation's own (surgery.forwards.multimodal), so it is built from theirs, each conversation
    alone (with host reads; without, the caller's mask, None)."""
    model_mask = None
    if types is not None and host_reads:
        dtype = (
            tokens.dtype if tokens.is_floating_point() else self.get_input_embeddings().weight.dtype
        )
        model_mask = _packed_bidirectional_masks(self.model, text_positions, types, dtype)
    # A local, so that nothing is on the stack at the host read's graph break (a bound
    # ``kwargs.update`` there is guarded on, and the guard fails every step).
    chunk_size = packed_chunk_size(config, state.spec)
    layout = packed_layout(state.spec, text_positions, tokens, varlen, host_reads, chunk_size)
    return model_mask, layout


def whole_rows(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def unpadded_inputs(unpadded, input_ids, inputs_embeds, targets: Targets):
    """``PatchOptions.padding_free``: the real tokens as one row; each attention layer runs each
    row's tokens alone or pads them again (surgery.attention.unpadding). The loss takes each row's
    end as a sequence boundary from the positions; the load-balancing loss counts every token
    left."""
    if input_ids is not None:
        input_ids = unpadded.take(input_ids)
    else:
        inputs_embeds = unpadded.take(inputs_embeds)
    device = unpadded.index.device
    if targets.shift_labels is not None:
        targets = targets._replace(shift_labels=unpadded.take(targets.shift_labels.to(device)))
    else:
        targets = targets._replace(labels=unpadded.take(targets.labels.to(device)))
    return input_ids, inputs_embeds, targets


class Targets(NamedTuple):
    """What the loss reads besides the hidden states: transformers' labels or shift_labels and
    loss kwargs, and the documents' boundaries of whole rows (None where ``logits_to_keep``
    keeps part of them)."""

    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None
    ignore_index: int
    num_items_in_batch: torch.Tensor | int | None
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None


def padding_layout(attention_mask, targets: Targets, tokens, unpad: bool) -> PaddedLayout:
    """Whether a padded step's mask is right padding that a causal attention may drop, with
    ``unpad`` the layout it runs in (its real tokens alone, right padding: ``Unpadded``; its rows
    rolled, left padding: ``Rolled``; else None), and whether it has padding at all
    (``surgery.attention.unpadding.padded_layout``, on the tokens' device). One device-to-host
    read (``host_read``)."""
    given = targets.labels if targets.shift_labels is None else targets.shift_labels
    return read_padded_layout(attention_mask, given, targets.ignore_index, unpad, tokens.device)


def laid_out_inputs(layout: Unpadded | Rolled, input_ids, inputs_embeds, targets: Targets):
    """The inputs and targets in ``layout``, and the keyword argument that carries the layout to
    the attention layers."""
    if isinstance(layout, Rolled):
        return (*_rolled_inputs(layout, input_ids, inputs_embeds, targets), ROLLED_KWARG)
    return (*unpadded_inputs(layout, input_ids, inputs_embeds, targets), UNPADDED_KWARG)


def _rolled_inputs(rolled, input_ids, inputs_embeds, targets: Targets):
    """A left-padded step run rolled (``surgery.attention.unpadding.Rolled``): the inputs rolled,
    and each token's target (the labels shifted first, as the loss would shift them in the
    caller's layout, or the caller's ``shift_labels``) rolled with it, so that the last padding
    position still predicts its row's first real token, as transformers trains it."""
    if input_ids is not None:
        input_ids = rolled.take(input_ids)
    else:
        inputs_embeds = rolled.take(inputs_embeds)
    shift_labels = targets.shift_labels
    if shift_labels is None:
        labels = targets.labels
        last = labels.new_full((labels.shape[0], 1), targets.ignore_index)
        shift_labels = torch.cat((labels[:, 1:], last), dim=1)
    shift_labels = rolled.take(shift_labels.to(rolled.order.device))
    return input_ids, inputs_embeds, targets._replace(shift_labels=shift_labels)


def document_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The position ids whose restarts mark the documents of a packed row (for the attention,
    a hybrid's linear attention and the loss's sequence boundaries): (batch, seq) ones as they
    are; of multimodal (4, batch, seq) ones (Qwen2-VL and later, packed), the first row, the text
    positions, as transformers builds its packed mask from it: the three rotary rows do not
    count tokens (the temporal row stands still over an image, height and width jump), so the
    restart rule would cut a document inside every image. (3, batch, seq) ones carry no text row:
    None, each row one document, as transformers takes them."""
    if position_ids is None or position_ids.dim() <= 2:
        return position_ids
    return position_ids[0] if position_ids.shape[0] == 4 else None


@host_read
def _any_nonzero(ids: torch.Tensor) -> bool:
    return bool(ids.ne(0).any())


def bidirectional(wrapper: MultimodalWrapper, kwargs: dict, host_reads: bool, config) -> bool:
    """Whether the batch has tokens that may attend both ways (``bidirectional_tokens``, where
    the text config lets them: ``bidirectional_when``). Without host reads
    (``torch.compile(fullgraph=True)``), whenever the token types are given."""
    if wrapper.bidirectional_tokens is None:
        return False
    if wrapper.bidirectional_when is not None:
        attribute, value = wrapper.bidirectional_when
        if getattr(config, attribute, None) != value:
            return False
    ids = kwargs.get(wrapper.bidirectional_tokens)
    return ids is not None and (not host_reads or _any_nonzero(ids))
