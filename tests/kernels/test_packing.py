"""A packed batch's boundaries as ops (``surgery.kernels.packing``) against the token-by-token
reference: documents, and chunked attention's chunks."""

from __future__ import annotations

import torch
from torch.library import opcheck

from surgery.kernels.packing import cu_seqlens_reference, packed_chunked_cu_seqlens


def test_packed_cu_seqlens_op():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [4, 5, 0, 1, 2, 3]])
    cu = torch.ops.surgery.packed_cu_seqlens(pos, 2, 6)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 8, 12]
    assert cu.tolist() == cu_seqlens_reference(pos, (2, 6))
    one_row = torch.ops.surgery.packed_cu_seqlens(torch.tensor([[0, 1, 0, 1]]), 2, 4)
    assert one_row.tolist() == [0, 2, 4, 6, 8]  # (1, T) position ids shared by every row
    assert one_row.tolist() == cu_seqlens_reference(torch.tensor([[0, 1, 0, 1]]), (2, 4))
    opcheck(torch.ops.surgery.packed_cu_seqlens.default, (pos, 2, 6))


def test_packed_chunked_cu_seqlens_op_splits_documents_at_chunks():
    """Chunks of 3: a row starting mid-chunk (position 4), documents longer than a chunk."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1], [4, 5, 6, 7, 0, 1, 2]])
    documents, chunks = packed_chunked_cu_seqlens(pos, 2, 7, 3)
    assert documents.dtype == chunks.dtype == torch.int32
    assert documents.tolist() == cu_seqlens_reference(pos, (2, 7))
    assert chunks.tolist() == cu_seqlens_reference(pos, (2, 7), chunk_size=3)
    assert chunks.tolist() == [0, 3, 5, 7, 9, 11, 14]
