"""The linear-attention layers of hybrid models, given the documents of a packed batch.

Hybrid models (Qwen3-Next, Qwen3.5) interleave attention layers with linear-attention layers
(GatedDeltaNet): a causal 1-D convolution over the last few tokens, then a recurrence that carries
a state from token to token. A packed batch (rows holding several documents, ``position_ids``
restarting at each, no attention mask) keeps documents apart in transformers' attention layers
only: its linear-attention layers run over the whole row, so the convolution window and the
recurrent state of one document flow into the next. surgery leaves their math to transformers and
changes what they are given:

- the documents of a packed batch are found from its position ids once per forward
  (``packed_documents``: a document starts at each row's first token and wherever the position
  does not continue, the rule of transformers' packed mask and of the loss), by the causal-LM
  forward in a training or loss step (from the one host read that also serves the varlen
  attention, ``surgery.forward``) or else by the base model's forward (``surgery.base_model``),
  and handed to the base model under the keyword argument ``DOCUMENTS_KWARG``. The base model
  passes its keyword arguments to the decoder layers, which pass theirs to the linear attention
  (and to the attention, which drops this one);
- each linear-attention module's forward (``linear_attention_forward``) gathers the packed tokens
  into a (documents, longest) right-padded batch, runs transformers' own forward on it with the
  matching 2-D attention mask (the mask transformers builds for a right-padded batch), and
  scatters the output back to the packed layout. Right padding is exact for a causal layer: a
  document's tokens come first in its row, so the padding after them reaches none of them. Only
  the hidden states are moved; each document gets what it gets alone.

The padded batch costs the linear-attention layers what the same documents cost padded
(documents x longest tokens), plus one gather and one scatter of the hidden states per layer.
A forward with a KV cache (generation) is left to transformers as it is: its cache holds one
state per row, not per document. Under ``torch.compile`` the boundaries are a host read with
data-dependent shapes: a packed batch graph-breaks there (``fullgraph=True`` refuses it), and
each layout of documents compiles anew; padded batches never reach it.
"""

# TODO: on CUDA with flash-linear-attention installed, hand its kernels the documents' cu_seqlens
# (transformers passes ``cu_seq_lens_q`` on) instead of padding; needs a GPU test against this path.

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from surgery.kernels.reduction import host_cu_seqlens

from .signature import cache_argument

__all__ = [
    "DOCUMENTS_KWARG",
    "Documents",
    "documents_of",
    "linear_attention_forward",
    "packed_documents",
]

DOCUMENTS_KWARG = "surgery_documents"
"""The keyword argument that carries ``Documents`` from the base model through its decoder layers
to the linear-attention layers."""
LINEAR_ATTENTION_ATTR = "_surgery_linear_attention"
"""Instance attribute of a patched linear-attention module (True)."""

# Keyword arguments describing the packed layout for flash attention; the padded batch has none.
_PACKED_LAYOUT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class Documents:
    """The documents of a packed (batch, seq) batch laid out as the rows of a right-padded one,
    every tensor on the batch's device."""

    gather: torch.Tensor
    """int64 (documents * longest,): the flat (batch * seq) index of each padded slot's token;
    ``batch * seq`` for a padding slot (a zero row past the last token)."""
    scatter: torch.Tensor
    """int64 (batch * seq,): the flat (documents * longest) slot of each token."""
    mask: torch.Tensor
    """int64 (documents, longest): 1 for a token, 0 for padding."""


def _host_read(fn):
    # A graph break under torch.compile; the reason is what fullgraph=True's error shows.
    reason = (
        "surgery reads the documents of a packed batch (position ids, no attention mask) on the "
        "host for a hybrid model's linear-attention layers: compile with graph breaks allowed "
        "(fullgraph=False) or pass padded batches"
    )
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch before the reason argument
        return torch.compiler.disable(fn)


@_host_read
def packed_documents(
    position_ids: torch.Tensor, shape: tuple[int, int], device: torch.device
) -> Documents | None:
    """``Documents`` of a (batch, seq) batch from its (batch, seq) or (seq,) position ids, or None
    when every row holds one document. One device-to-host copy of the position ids."""
    return documents_of(host_cu_seqlens(position_ids, shape), shape, device)


def documents_of(
    cu_seqlens: torch.Tensor, shape: tuple[int, int], device: torch.device
) -> Documents | None:
    """``Documents`` of a (batch, seq) batch on ``device`` from its ``host_cu_seqlens`` (read on
    the host already: this reads nothing from the device), or None when every row holds one
    document."""
    batch, seq = shape
    first, tokens = cu_seqlens[:-1], batch * seq
    if first.numel() == batch:
        return None
    lengths = cu_seqlens.diff()
    longest = int(lengths.max())
    document = torch.repeat_interleave(torch.arange(first.numel()), lengths)
    offset = torch.arange(tokens) - first[document]
    scatter = document * longest + offset
    gather = torch.full((first.numel() * longest,), tokens, dtype=torch.long)
    gather[scatter] = torch.arange(tokens)
    mask = (gather != tokens).long().view(first.numel(), longest)
    return Documents(gather.to(device), scatter.to(device), mask.to(device))


def linear_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cache=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' linear-attention forward, run per document on a packed batch: the tokens
    gathered into the right-padded batch of ``Documents``, the output scattered back. Without
    documents, or with a KV cache, transformers' forward as it is."""
    cache = cache_argument(cache, kwargs)
    documents: Documents | None = kwargs.pop(DOCUMENTS_KWARG, None)
    # transformers' own forward (the patch checked that the class's is); an instance forward
    # (accelerate's hook) has already run around this one.
    forward = type(self).forward
    if documents is None or cache is not None:
        return forward(self, hidden_states, cache, attention_mask, **kwargs)
    for name in _PACKED_LAYOUT_KWARGS:
        kwargs.pop(name, None)
    batch, seq, hidden = hidden_states.shape
    flat = hidden_states.reshape(batch * seq, hidden)
    flat = torch.cat([flat, flat.new_zeros(1, hidden)])
    padded = flat[documents.gather].view(*documents.mask.shape, hidden)
    output = forward(self, padded, None, documents.mask, **kwargs)
    output = output.reshape(-1, output.shape[-1])[documents.scatter]
    return output.view(batch, seq, -1)
