"""Packed batches through flash attention's variable-length kernel.

With ``varlen_attention`` (the default), a packed batch on sdpa (rows holding several documents,
``position_ids`` restarting at each; see ``surgery.forwards.causal_lm``) runs every layer's
attention through torch's variable-length flash attention
(``torch.nn.attention.varlen.varlen_attn``) over the documents, given as cumulative lengths over the
flattened (batch * seq) tokens: each document attends causally to itself only, exactly what
transformers' block-diagonal mask allows, but the kernel skips every block outside the documents and
needs no mask and no key/value repeat for GQA (sdpa with a mask takes a masked kernel that computes
the whole (seq x seq) square). A layer that varlen cannot serve (fp32, attention dropout in
training, an attention-logit softcap, head_dim over 256) takes the mask transformers built as usual.
Under ``torch.compile`` too: the boundaries then come from an op at run time (``packed_sequences``),
so the graph holds no host read.

Chunked attention (Llama 4's ``attention_chunk_size``: a query attends causally to the keys of its
own chunk of positions) is causal attention over each chunk of each document: its layers take
the documents split further wherever a document's position reaches a multiple of the chunk size
(``PackedSequences.chunks``), found with the documents from the same read of the position ids.

Flash attention reads 16-byte vectors: a head size of whole vectors is required
(``flash_head_size``; callers take the masked path otherwise), and a q/k/v whose strides or start
are not whole vectors (a slice, such as MLA's values) is copied first (``flash_layout``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from surgery.attention.layout import BatchLayout
from surgery.compiling import host_read
from surgery.kernels.packing import (
    host_offsets,
    packed_chunked_cu_seqlens,
    packed_cu_seqlens,
    split_at_chunks,
)

__all__ = [
    "PACKED_KWARG",
    "PackedSequences",
    "flash_head_size",
    "flash_layout",
    "flash_takes_heads",
    "packed_sequences",
    "varlen_attention",
    "varlen_kernel",
]

PACKED_KWARG = "surgery_packed_sequences"
"""The keyword argument that carries ``PackedSequences`` from the causal-LM forward through the
base model and its decoder layers (which pass their keyword arguments on) to the attention."""


@dataclass(frozen=True)
class PackedSequences(BatchLayout):
    """The documents of a packed batch, over its flattened (batch * seq) tokens."""

    cu_seqlens: torch.Tensor
    """int32 (documents + 1,): where each document starts, then the token count; on the device."""
    max_length: int
    """The longest document's length."""
    kernel: Callable
    """``varlen_attn``'s signature (see ``varlen_kernel``)."""
    chunks: PackedSequences | None = None
    """The same batch for the chunked-attention layers (``packed_sequences``' ``chunk_size``):
    each document split at every token whose position is a multiple of the chunk size, as
    ``surgery.attention.chunked.chunked_document_mask`` chunks it. None without chunked layers."""


def packed_sequences(
    position_ids: torch.Tensor,
    shape: tuple[int, int],
    device: torch.device,
    read_on_host: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> PackedSequences | None:
    """``PackedSequences`` of a (batch, seq) batch on ``device`` from its position ids, or None
    when every row holds one document (causal attention over the row is then already exact) or
    ``device`` has no varlen kernel.

    A document starts at each row's first token and wherever the position does not continue
    (``pos[t] != pos[t - 1] + 1``): transformers' rule for its packed mask, and the loss's
    (``surgery.kernels.reduction.sequence_starts``). Labels play no part: a run of ignored labels
    (a masked prompt) is not a boundary. One device-to-host copy of the position ids.

    Under ``torch.compile`` the row length stands for the longest document (flash attention only
    sizes its grid from it: an upper bound is exact, blocks past a document's end return at once),
    so no graph depends on it, and the boundaries are read (see ``surgery.compiling``):
    ``read_on_host`` (graph breaks allowed): on the host, as one graph break, their count a dynamic
    size of the rest of the forward; otherwise from an op at run time (their count an unbacked
    size) and every row is taken as packed (varlen over rows of one document each is exact too).

    ``cu_seqlens``: the batch's ``host_cu_seqlens``, where the caller has read them already for
    another use (a hybrid model's documents): not read again. Eager only.

    ``chunk_size``: the model's chunked-attention layers' ``attention_chunk_size``, if it has such
    layers: ``PackedSequences.chunks`` is then filled from the same read (a chunk's longest
    length: the chunk size, or the exact one eagerly). Under ``torch.compile`` without graph
    breaks one op returns both boundaries (each count an unbacked size).
    """
    kernel = varlen_kernel(device)
    if kernel is None:
        return None
    if torch.compiler.is_compiling():
        if read_on_host:
            read = _read_cu_seqlens(position_ids, shape, device, chunk_size)
            if read is None:
                return None
            cu_seqlens, chunked = read
        elif chunk_size is None:
            cu_seqlens = packed_cu_seqlens(position_ids, shape[0], shape[1])
            chunked = None
        else:
            cu_seqlens, chunked = packed_chunked_cu_seqlens(
                position_ids, shape[0], shape[1], chunk_size
            )
        chunks = None
        if chunked is not None:
            chunks = PackedSequences(chunked, min(chunk_size, shape[1]), kernel)
        return PackedSequences(cu_seqlens, shape[1], kernel, chunks)
    if cu_seqlens is None:
        cu_seqlens, chunked = host_offsets(position_ids, shape, chunk_size)
    elif chunk_size is not None:
        chunked = split_at_chunks(position_ids.cpu(), shape, cu_seqlens, chunk_size)
    if cu_seqlens.numel() == shape[0] + 1:
        return None
    chunks = None
    if chunk_size is not None:
        chunks = PackedSequences(
            chunked.to(device=device, dtype=torch.int32), int(chunked.diff().max()), kernel
        )
    max_length = int(cu_seqlens.diff().max())
    return PackedSequences(
        cu_seqlens.to(device=device, dtype=torch.int32), max_length, kernel, chunks
    )


@host_read
def _read_cu_seqlens(
    position_ids: torch.Tensor,
    shape: tuple[int, int],
    device: torch.device,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    # Eager inside a compiled forward; the counts of documents and chunks are marked dynamic, so
    # that batches with other counts reuse the graph compiled after this read.
    cu_seqlens, chunked = host_offsets(position_ids, shape, chunk_size)
    if cu_seqlens.numel() == shape[0] + 1:
        return None
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    if chunked is not None:
        chunked = chunked.to(device=device, dtype=torch.int32)
        torch._dynamo.maybe_mark_dynamic(chunked, 0)
    return cu_seqlens, chunked


def varlen_kernel(device: torch.device) -> Callable | None:
    """torch's ``varlen_attn`` when it can run on ``device`` (CUDA, flash attention: sm80+,
    torch 2.10+), else None. torch.compile traces it: the kernel is resolved at import, and the
    device check runs as a constant of the device (whose tensors' guards hold it)."""
    if _VARLEN_ATTN is None or device.type != "cuda" or not _flash_capable(device):
        return None
    return _VARLEN_ATTN


@torch.compiler.assume_constant_result
def _flash_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params:  # torch 2.10 had only is_causal
        return None
    # torch 2.13 asks for enable_gqa=True when key/value have fewer heads; earlier releases hand
    # them to flash attention (which groups the heads itself) without the flag.
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    return functools.partial(varlen_attn, **gqa)


_VARLEN_ATTN = _varlen_attn()


def flash_head_size(*tensors: torch.Tensor) -> bool:
    """Whether flash attention's varlen kernel takes heads of these tensors' last size
    (``flash_takes_heads``). Callers take the masked path otherwise."""
    return all(flash_takes_heads(x.shape[-1], x.element_size()) for x in tensors)


def flash_takes_heads(head_dim: int, element_size: int = 2) -> bool:
    """Whether flash attention's varlen kernel takes heads of ``head_dim`` channels of
    ``element_size`` bytes: whole 16-byte vectors (8 bf16/fp16 channels). The form for callers
    that decide before the tensors exist."""
    return head_dim * element_size % 16 == 0


def flash_layout(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where flash attention would read it at a misaligned address:
    its kernels load 16-byte vectors, so besides the head size every stride but the last (which
    must be 1) and the start must be whole vectors. Projections' views always are; a slice such
    as MLA's values (a part of ``kv_b_proj``'s output) may not be (flash attention then fails
    with "misaligned address": seen on a tiny Mistral 4)."""
    if torch.compiler.is_compiling():
        # The start is not traceable (``storage_offset``); a copy only where not contiguous.
        return x.contiguous()
    vector = 16 // x.element_size()
    aligned = (
        x.stride(-1) == 1
        and all(s % vector == 0 for s in x.stride()[:-1])
        and x.storage_offset() % vector == 0
    )
    return x if aligned else x.contiguous()


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedSequences,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention within each document of ``packed``. query (B, Hq, T, D), key and value
    (B, Hk, T, D), any strides; returns (B, T, Hq, D) like transformers' attention functions.

    ``sliding_window`` has transformers' meaning: a query attends to the keys less than
    ``sliding_window`` positions before it (flash attention's left window is one less).
    """
    B, H, T, D = query.shape
    # (B, H, T, D) views of (B, T, H, D) projections: these reshapes are free.
    q, k, v = (
        flash_layout(x.transpose(1, 2).reshape(B * T, x.shape[1], D)) for x in (query, key, value)
    )
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    cu, n = packed.cu_seqlens, packed.max_length
    out = packed.kernel(q, k, v, cu, cu, n, n, scale=scaling, window_size=window)
    return out.view(B, T, H, D)
