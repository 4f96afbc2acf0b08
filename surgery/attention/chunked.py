"""What Llama 4's attention does beyond RoPE, from the position ids: chunked attention, the query
temperature of the layers without RoPE and the q/k norm after RoPE.

Llama 4 interleaves layers with RoPE, whose attention is chunked (a query attends causally to the
keys of its own chunk of ``config.attention_chunk_size`` positions), with global layers without
RoPE, whose query is scaled by a factor growing with its position (attention temperature tuning).
Both depend on positions, which surgery reads from the position ids, so that a packed batch
(rows holding several documents, ``position_ids`` restarting at each, no attention mask) trains
as the documents alone:

- chunks follow each document's own positions. transformers builds the chunked layers' mask from
  the token's index in its row, so that in a packed row a later document's chunks start where
  the earlier documents leave off (5.17; 5.23 remaps its packed mask to the position ids). On a
  packed batch the base-model forward (``surgery.forwards.base_model``) builds that mask itself
  (``packed_chunked_mask``: causal within the document and within the chunk of the query's
  position), once per forward, and the chunked layers take it in place of transformers'.
  In bf16/fp16 the chunked layers of such a batch run flash attention's varlen kernel over the
  documents' chunks instead (``surgery.attention.varlen``: each chunk of a document is causal
  attention over itself), and the mask serves the layers varlen cannot (fp32, dropout, ...).
  Batches with an attention mask or a KV cache keep transformers' mask: a padded row's chunks
  start at its first real token there, as transformers counts them, and a cached step's keys are
  not in the position ids;
- the temperature is computed from each token's position id; transformers computes it from the
  token's index in its row (plus the cached length), which is the same for a row of one document
  without padding (and for every batch transformers makes position ids for itself), but runs on
  across the documents of a packed row and counts a left-padded row's padding.

Llama 4's decoder layers do not pass ``position_ids`` on to the attention (its RoPE comes as
complex ``freqs_cis``): the base-model forward passes them under ``POSITIONS_KWARG``, the position
ids the base model uses (the caller's, or its default: the cached length onwards).
"""

from __future__ import annotations

import torch
from torch import nn

from surgery.kernels.reduction import sequence_starts
from surgery.models import ArchitectureSpec

__all__ = [
    "CHUNKED_MASK_KWARG",
    "POSITIONS_KWARG",
    "after_rope",
    "chunked_document_mask",
    "chunked_layer_mask",
    "is_chunked_layer",
    "packed_chunk_size",
    "packed_chunked_mask",
    "temperature_scaled_query",
]

POSITIONS_KWARG = "surgery_position_ids"
"""The keyword argument carrying the position ids from the base model through its decoder layers
(which pass their keyword arguments on) to the attention."""
CHUNKED_MASK_KWARG = "surgery_chunked_mask"
"""The keyword argument carrying a packed batch's chunked-attention mask the same way."""

_CHUNKED = "chunked_attention"


def chunked_document_mask(position_ids: torch.Tensor, batch: int, chunk_size: int) -> torch.Tensor:
    """bool (batch, 1, seq, seq), True where query q may attend to key k: k <= q in q's document,
    in the chunk of q's position (``position // chunk_size``). ``position_ids`` (batch, seq) or
    (1, seq); a document starts at each row's first token and wherever the position does not
    continue (transformers' rule for packed rows). Within a document positions count up by one,
    so the keys of q's chunk are the ``position % chunk_size`` tokens before q, and q itself."""
    positions = position_ids.expand(batch, -1)
    seq = positions.shape[-1]
    index = torch.arange(seq, device=positions.device)
    starts = sequence_starts((batch, seq), positions.device, position_ids=positions)
    document_start = torch.where(starts.view(batch, seq), index, 0).cummax(dim=-1).values
    first_key = torch.maximum(index - positions % chunk_size, document_start)
    keys = index[None, None, :]
    queries = index[None, :, None]
    allowed = (keys <= queries) & (keys >= first_key[:, :, None])
    return allowed[:, None]


def packed_chunked_mask(
    model: nn.Module, positions: torch.Tensor, batch: int, embeddings_dtype: torch.dtype
) -> torch.Tensor | None:
    """The mask the chunked layers of base model ``model`` attend with on a packed batch (position
    ids, no attention mask, no KV cache yet), from its (batch, seq) or (1, seq) ``positions``:
    ``chunked_document_mask``, boolean for sdpa, additive in ``embeddings_dtype`` for eager (as
    transformers' eager masks). None when the model has no chunked layers or attends with another
    implementation (flash attention reads the documents from the position ids itself)."""
    config = model.config
    implementation = config._attn_implementation
    chunked = _CHUNKED in (getattr(config, "layer_types", None) or ())
    if not chunked or implementation not in ("sdpa", "eager"):
        return None
    allowed = chunked_document_mask(positions, batch, config.attention_chunk_size)
    if implementation == "sdpa":
        return allowed
    mask = torch.zeros(allowed.shape, dtype=embeddings_dtype, device=allowed.device)
    return mask.masked_fill_(allowed.logical_not(), torch.finfo(embeddings_dtype).min)


def packed_chunk_size(config, spec: ArchitectureSpec) -> int | None:
    """The ``attention_chunk_size`` of a ``spec`` model whose text ``config`` has chunked layers,
    else None: on a packed batch the varlen attention splits the documents into its chunks
    (``surgery.attention.varlen.PackedSequences.chunks``), once per forward."""
    if not spec.chunked_attention or _CHUNKED not in (getattr(config, "layer_types", None) or ()):
        return None
    return config.attention_chunk_size


def is_chunked_layer(module: nn.Module, spec: ArchitectureSpec) -> bool:
    """Whether ``module`` is a chunked-attention layer (``ArchitectureSpec.chunked_attention``)."""
    if not spec.chunked_attention:
        return False
    layer_types = getattr(module.config, "layer_types", None) or ()
    return layer_types[module.layer_idx] == _CHUNKED


def chunked_layer_mask(
    chunked: bool, attention_mask: torch.Tensor | None, cache, kwargs: dict
) -> torch.Tensor | None:
    """The mask a layer attends with: a chunked layer's mask from ``packed_chunked_mask`` when
    there is one (a packed batch) and no KV cache exists (with one, transformers' mask treats the
    row as one sequence in every layer, and so must this one), else ``attention_mask``. Takes the
    mask's keyword argument out of ``kwargs`` in every layer."""
    mask = kwargs.pop(CHUNKED_MASK_KWARG, None)
    if chunked and mask is not None and cache is None:
        return mask
    return attention_mask


def temperature_scaled_query(
    module: nn.Module, query: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """(B, H, T, D) ``query`` times ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``
    of each token's position (``position_ids`` (B, T) or (1, T)), computed in fp32 and the product
    rounded to the query's dtype, with transformers' ops in transformers' order."""
    positions = position_ids.float()
    scales = torch.log1p(torch.floor((positions + 1.0) / module.floor_scale)) * module.attn_scale
    scales = scales + 1.0
    return (query * scales[:, None, :, None]).to(query.dtype)


def after_rope(
    module: nn.Module,
    spec: ArchitectureSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    position_ids: torch.Tensor | None,
    rotated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, T, D) ``query`` and ``key`` after what follows RoPE: the q/k norm of
    ``ArchitectureSpec.post_rope_qk_norm`` where the module has one, and on a layer without RoPE
    (``rotated`` False) the query temperature of ``ArchitectureSpec.attention_temperature``."""
    norm = getattr(module, spec.post_rope_qk_norm, None) if spec.post_rope_qk_norm else None
    if norm is not None:  # over the head dim: the same before or after the transpose
        query, key = norm(query), norm(key)
    if spec.attention_temperature and not rotated and module.attn_temperature_tuning:
        if position_ids is None:
            raise RuntimeError(
                f"surgery: {type(module).__name__} scales its query by position and was called "
                "without position ids; call it through its base model"
            )
        query = temperature_scaled_query(module, query, position_ids.to(query.device))
    return query, key
