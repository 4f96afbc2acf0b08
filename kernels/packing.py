"""A packed batch's document boundaries as ops: ``packed_cu_seqlens`` (each document's start over
the flattened (batch, seq) tokens) and ``packed_chunked_cu_seqlens`` (the same, split further into
chunked attention's chunks, ``split_at_chunks``), for a compiled forward that may not read the
position ids on the host itself.

Each op reads the position ids once on the host (``host_cu_seqlens``: a document starts wherever a
row's position does not continue the previous one by one) and returns int32 offsets on their
device; under ``torch.compile`` each count is an unbacked size (at least one document per row), so
the graph holds no host read and batches with other counts reuse it. Plain PyTorch;
``cu_seqlens_reference`` walks the positions token by token.
"""

from __future__ import annotations

import torch

from .reduction import host_cu_seqlens

__all__ = [
    "cu_seqlens_reference",
    "host_offsets",
    "packed_chunked_cu_seqlens",
    "packed_cu_seqlens",
    "split_at_chunks",
]


def split_at_chunks(
    position_ids: torch.Tensor,
    shape: tuple[int, int],
    cu_seqlens: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """int64 ``cu_seqlens`` (a (batch, seq) batch's documents, ``host_cu_seqlens``) split further
    at every token whose position is a multiple of ``chunk_size``: the chunks of chunked
    attention, each attending causally to itself. ``position_ids`` (batch, seq), (1, seq) or
    (seq,), on ``cu_seqlens``' device. Within a document positions count up by one, so the chunk
    of a query at position p starts ``p % chunk_size`` tokens before it or at the document's
    start (a row's first document may start mid-chunk, at any position)."""
    positions = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
    positions = positions.expand(shape).reshape(-1).to(cu_seqlens.device)
    starts = positions % chunk_size == 0
    starts[cu_seqlens[:-1]] = True
    first = torch.nonzero(starts).flatten()
    return torch.cat([first, first.new_tensor([starts.numel()])])


def host_offsets(
    position_ids: torch.Tensor, shape: tuple[int, int], chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """On the host, from one device-to-host copy of the position ids: int64 ``host_cu_seqlens``
    of a (batch, seq) batch's documents and, given ``chunk_size``, their chunks
    (``split_at_chunks``; else None)."""
    host_positions = position_ids.cpu()
    cu_seqlens = host_cu_seqlens(host_positions, shape)
    if chunk_size is None:
        return cu_seqlens, None
    return cu_seqlens, split_at_chunks(host_positions, shape, cu_seqlens, chunk_size)


@torch.library.custom_op("surgery::packed_cu_seqlens", mutates_args=())
def packed_cu_seqlens(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """int32 ``(documents + 1,)`` offsets of a (batch, seq) batch's documents (then the token
    count), on the position ids' device."""
    cu_seqlens = host_cu_seqlens(position_ids, (batch, seq))
    return cu_seqlens.to(device=position_ids.device, dtype=torch.int32)


@packed_cu_seqlens.register_fake
def _(position_ids, batch, seq):
    # documents + 1 entries, at least one document per row (the bound must be a plain int: with
    # dynamic shapes the batch may not be).
    least = batch + 1 if isinstance(batch, int) else 2
    size = torch.library.get_ctx().new_dynamic_size(min=least)
    return position_ids.new_empty(size, dtype=torch.int32)


@torch.library.custom_op("surgery::packed_chunked_cu_seqlens", mutates_args=())
def packed_chunked_cu_seqlens(
    position_ids: torch.Tensor, batch: int, seq: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed_cu_seqlens`` and its chunks' (``split_at_chunks``) of a (batch, seq) batch, on the
    position ids' device, from one read of the position ids."""
    offsets = host_offsets(position_ids, (batch, seq), chunk_size)
    return tuple(x.to(device=position_ids.device, dtype=torch.int32) for x in offsets)


@packed_chunked_cu_seqlens.register_fake
def _(position_ids, batch, seq, chunk_size):
    least = batch + 1 if isinstance(batch, int) else 2
    ctx = torch.library.get_ctx()
    documents = position_ids.new_empty(ctx.new_dynamic_size(min=least), dtype=torch.int32)
    chunks = position_ids.new_empty(ctx.new_dynamic_size(min=least), dtype=torch.int32)
    return documents, chunks


def cu_seqlens_reference(
    position_ids: torch.Tensor, shape: tuple[int, int], chunk_size: int | None = None
) -> list[int]:
    """The offsets ``packed_cu_seqlens`` (given ``chunk_size``: the chunks of
    ``packed_chunked_cu_seqlens``) returns, token by token: a segment starts at each row's first
    token, where the position does not continue the previous one by one, and (chunked) where the
    position is a multiple of ``chunk_size``."""
    batch, seq = shape
    rows = position_ids.view(-1, position_ids.shape[-1]).expand(batch, seq).tolist()
    offsets = []
    for r, row in enumerate(rows):
        for t, p in enumerate(row):
            new_document = t == 0 or p != row[t - 1] + 1
            if new_document or (chunk_size is not None and p % chunk_size == 0):
                offsets.append(r * seq + t)
    return [*offsets, batch * seq]
