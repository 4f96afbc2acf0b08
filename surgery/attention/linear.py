"""The linear-attention layers of hybrid models, given the documents of a batch.

Hybrid models (Qwen3-Next, Qwen3.5) interleave attention layers with linear-attention layers
(Gated DeltaNet): projections, a causal 1-D convolution over the last few tokens, a recurrence that
carries a state from token to token, a gated RMSNorm and an output projection. A packed batch
(rows holding several documents, ``position_ids`` restarting at each, no attention mask) keeps
documents apart in transformers' attention layers only: its linear-attention layers run over the
whole row, so the convolution window and the recurrent state of one document flow into the next
(``README.md``, Hybrid models, measures where). surgery gives each layer the documents:

- the documents of a packed batch are found from its position ids once per forward
  (``packed_documents``: a document starts at each row's first token and wherever the position
  does not continue, the rule of transformers' packed mask and of the loss), by the causal-LM
  forward in a training or loss step (from the one host read that also serves the varlen
  attention, ``surgery.forwards.causal_lm``) or else by the base model's forward
  (``surgery.forwards.base_model``), and handed to the base model under the keyword argument
  ``DOCUMENTS_KWARG``. The base model passes its keyword arguments to the decoder layers, which pass
  theirs to the linear attention (and to the attention, which drops this one). Where fla runs the
  layers, a right-padded (or left-padded) batch's real tokens are documents too
  (``padded_documents``, the base model's forward, from one host read of the attention mask);
- with flash-linear-attention on CUDA (``surgery.integrations.fla``), each layer's forward
  (``linear_attention_forward``) runs the batch's tokens as one row: a packed batch as it lies,
  a padded one's real tokens gathered, and a batch of whole rows as it is. The projections are the
  layer's own modules; the convolution, the recurrence and the gated norm are fla's, given the
  documents' ``cu_seqlens``; the output goes back to the batch's layout (zeros at the padding,
  whose outputs no real token reads: the attention masks them and the loss ignores them). The
  math is transformers' forward's (``tests/surgery/test_linear_attention_fla.py`` checks it
  against transformers' layers run on each document alone, on CPU through a stand-in with fla's
  signature, on the GPU through fla);
- without fla (on CPU, or not installed), or under ``torch.compile``, a packed batch's tokens are
  gathered into a (documents, longest) right-padded batch, transformers' own forward runs it with
  the matching 2-D attention mask (the mask transformers builds for a right-padded batch), and the
  output is scattered back to the packed layout. Right padding is exact for a causal layer: a
  document's tokens come first in its row, so the padding after them reaches none of them. That
  costs what the same documents cost padded (documents x longest tokens), plus one gather and
  one scatter of the hidden states per layer. Other batches run transformers' forward as they are.

A forward with a KV cache (generation) is left to transformers as it is: its cache holds one
state per row, not per document. Under ``torch.compile`` the boundaries are a host read with
data-dependent shapes: a packed batch graph-breaks there (``fullgraph=True`` refuses it), and
each layout of documents compiles anew; padded batches never reach it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from surgery.attention.layout import BatchLayout
from surgery.integrations import fla
from surgery.kernels.reduction import host_cu_seqlens
from surgery.patching.signature import cache_argument

__all__ = [
    "DOCUMENTS_KWARG",
    "Documents",
    "documents_of",
    "fla_kernels",
    "fla_ready",
    "linear_attention_forward",
    "packed_documents",
    "padded_documents",
]

DOCUMENTS_KWARG = "surgery_documents"
"""The keyword argument that carries ``Documents`` from the base model through its decoder layers
to the linear-attention layers."""
LINEAR_ATTENTION_ATTR = "_surgery_linear_attention"
"""Instance attribute of a patched linear-attention module: whether fla may run it
(``fla_ready``, decided at patch time)."""

# Keyword arguments describing a packed layout: flash attention's, and the convolution's seq_idx
# (TRL's padding-free collator passes them all); the layers take the documents instead, and
# transformers' own layers refuse them without the kernels of flash-linear-attention.
_PACKED_LAYOUT_KWARGS = (
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"
)  # fmt: skip
# The activations fla's convolution and gated norm apply (transformers' names for SiLU).
_SILU = ("silu", "swish")


@dataclass(frozen=True)
class Documents(BatchLayout):
    """The documents of a (batch, seq) batch: as one row of tokens for fla (``tokens``,
    ``cu_seqlens``) and, for a packed batch, as the rows of a right-padded batch for transformers'
    forward (``gather``, ``scatter``, ``mask``). Every tensor on the batch's device but
    ``cu_seqlens_cpu``."""

    HOST_FIELDS = ("cu_seqlens_cpu",)

    cu_seqlens: torch.Tensor
    """int64 (documents + 1,): where each document starts in the row of ``tokens``, then their
    count."""
    cu_seqlens_cpu: torch.Tensor
    """The same on the host (fla reads its chunk layout from it without a device sync)."""
    tokens: torch.Tensor | None
    """int64 (real tokens,): the flat (batch * seq) index of each token of the documents, in
    order; None when every token is one (a packed batch)."""
    gather: torch.Tensor | None = None
    """int64 (documents * longest,): the flat (batch * seq) index of each padded slot's token;
    ``batch * seq`` for a padding slot (a zero row past the last token). None for a padded batch
    (its documents are for fla only)."""
    scatter: torch.Tensor | None = None
    """int64 (batch * seq,): the flat (documents * longest) slot of each token."""
    mask: torch.Tensor | None = None
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
    """``Documents`` of a packed (batch, seq) batch on ``device`` from its ``host_cu_seqlens``
    (read on the host already: this reads nothing from the device), or None when every row holds
    one document."""
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
    return Documents(
        cu_seqlens=cu_seqlens.to(device),
        cu_seqlens_cpu=cu_seqlens,
        tokens=None,
        gather=gather.to(device),
        scatter=scatter.to(device),
        mask=mask.to(device),
    )


@_host_read
def padded_documents(attention_mask: torch.Tensor) -> Documents | None:
    """For fla: ``Documents`` of a padded batch from its (batch, seq) attention mask, each row's
    real tokens one document; None when nothing is padding, or when a row's real tokens are not
    one run (left or right padding): transformers runs such a row with zeros in the gaps, which
    decay the recurrent state, so only its own forward is exact for it. One device-to-host copy
    of the mask."""
    real = attention_mask.detach().cpu().bool()
    lengths = real.sum(1)
    if bool(real.all()):
        return None
    first = real.int().argmax(1)
    run = torch.arange(real.shape[1])[None] - first[:, None]
    if not bool(torch.equal((run >= 0) & (run < lengths[:, None]), real)):
        return None
    lengths = lengths[lengths > 0]
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    tokens = torch.nonzero(real.flatten()).flatten()
    device = attention_mask.device
    return Documents(cu_seqlens.to(device), cu_seqlens, tokens.to(device))


def fla_kernels(device: torch.device) -> fla.LinearAttentionKernels | None:
    """fla's kernels where they run a layer on ``device`` (``fla.linear_attention_kernels``),
    None under ``torch.compile``, where the layers take the padded path. What the causal-LM
    forward (no KV cache), the base model (a padded batch's documents) and each layer ask."""
    if torch.compiler.is_compiling():
        return None
    return fla.linear_attention_kernels(device)


def fla_ready(module: nn.Module) -> bool:
    """Whether ``linear_attention_forward`` can run ``module`` through fla: a Gated DeltaNet
    layer laid out as transformers' Qwen3.5 (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``) or Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba`` and its
    ``fix_query_key_value_ordering``), with SiLU activations, a gated RMSNorm and no
    accelerate hook moving its convolution's or its norm's weight."""
    names = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim",
             "key_dim", "value_dim")  # fmt: skip
    layouts = (
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"),
    )
    norm = getattr(module, "norm", None)
    return (
        all(hasattr(module, name) for name in names)
        and any(all(hasattr(module, name) for name in layout) for layout in layouts)
        and getattr(module, "activation", None) in _SILU
        and getattr(norm, "activation", None) in _SILU
        and hasattr(norm, "variance_epsilon")
        and not any(hasattr(m, "_hf_hook") for m in (module.conv1d, norm))
    )


def _partitioned(self: nn.Module) -> bool:
    """Whether the weights the fla path reads without calling their modules (the convolution's,
    the gated norm's) are DeepSpeed ZeRO-3 partitions, gathered only around their modules'
    own forwards."""
    return any(hasattr(p, "ds_id") for p in (self.conv1d.weight, self.norm.weight))


def _projections(self: nn.Module, hidden: torch.Tensor):
    """The layer's projections of (b, t, hidden): the convolution's input (b, t, conv dim), the
    gate z (b, t, hv, dv), and b, a (b, t, hv), as transformers' forward lays them out."""
    batch, seq, _ = hidden.shape
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: grouped per key head
        query, key, value, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden), self.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(batch, seq, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, b, a
    z = self.in_proj_z(hidden).reshape(batch, seq, -1, self.head_v_dim)
    return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)


def _fla_forward(
    self: nn.Module,
    hidden: torch.Tensor,
    kernels: fla.LinearAttentionKernels,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
) -> torch.Tensor:
    """The layer on (b, t, hidden) through fla's kernels, ``cu_seqlens`` (with b 1) its
    documents: transformers' forward's math (no cache)."""
    batch, seq, _ = hidden.shape
    varlen = {"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu}
    mixed, z, b, a = _projections(self, hidden)
    mixed, _ = kernels.conv(
        x=mixed,
        weight=self.conv1d.weight.squeeze(1),
        bias=self.conv1d.bias,
        activation=self.activation,
        **varlen,
    )
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    core, _ = kernels.delta_rule(
        q=query.reshape(batch, seq, -1, self.head_k_dim),
        k=key.reshape(batch, seq, -1, self.head_k_dim),
        v=value.reshape(batch, seq, -1, self.head_v_dim),
        g=-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias),
        beta=b.sigmoid(),
        use_qk_l2norm_in_kernel=True,
        **varlen,
    )
    core = kernels.gated_norm(
        x=core.reshape(-1, self.head_v_dim),
        g=z.reshape(-1, self.head_v_dim),
        weight=self.norm.weight,
        bias=None,
        activation="swish",
        eps=self.norm.variance_epsilon,
    )
    return self.out_proj(core.reshape(batch, seq, -1))


def linear_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cache=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """The linear-attention forward on the batch's documents (see the module docstring): through
    fla where it runs (``fla_ready`` at patch time, CUDA, no cache, not compiling, weights not
    ZeRO-3 partitions), else a packed batch's documents as a right-padded batch through
    transformers' forward, else transformers' forward as it is."""
    cache = cache_argument(cache, kwargs)
    # Present: the batch's documents were read from its position ids (None: whole rows).
    read = DOCUMENTS_KWARG in kwargs
    documents: Documents | None = kwargs.pop(DOCUMENTS_KWARG, None)
    # transformers' own forward (the patch checked that the class's is); an instance forward
    # (accelerate's hook) has already run around this one.
    forward = type(self).forward
    if cache is not None:
        return forward(self, hidden_states, cache, attention_mask, **kwargs)
    ready = self.__dict__.get(LINEAR_ATTENTION_ATTR) and not _partitioned(self)
    kernels = fla_kernels(hidden_states.device) if ready else None
    if kernels is not None and (documents is not None or attention_mask is None):
        if documents is None:  # whole rows
            return _fla_forward(self, hidden_states, kernels, None, None)
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.reshape(batch * seq, hidden)
        row = flat if documents.tokens is None else flat[documents.tokens]
        output = _fla_forward(
            self, row[None], kernels, documents.cu_seqlens, documents.cu_seqlens_cpu
        )[0]
        if documents.tokens is not None:
            output = output.new_zeros(batch * seq, output.shape[-1]).index_copy(
                0, documents.tokens, output
            )
        return output.view(batch, seq, -1)
    if documents is None or documents.gather is None:
        # Whole rows, or a padded batch's (for fla only): transformers' forward, mask and all;
        # rows found whole without the packed layout's arguments, which describe the same rows.
        if read and documents is None:
            _drop_packed_layout(kwargs)
        return forward(self, hidden_states, cache, attention_mask, **kwargs)
    _drop_packed_layout(kwargs)
    batch, seq, hidden = hidden_states.shape
    flat = hidden_states.reshape(batch * seq, hidden)
    flat = torch.cat([flat, flat.new_zeros(1, hidden)])
    padded = flat[documents.gather].view(*documents.mask.shape, hidden)
    output = forward(self, padded, None, documents.mask, **kwargs)
    output = output.reshape(-1, output.shape[-1])[documents.scatter]
    return output.view(batch, seq, -1)


def _drop_packed_layout(kwargs: dict) -> None:
    for name in _PACKED_LAYOUT_KWARGS:
        kwargs.pop(name, None)
