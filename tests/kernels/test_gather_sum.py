"""``surgery.kernels.gather_sum``: rows gathered in groups, weighted and summed, against an fp64
reference.

CPU: the kernel runs through the Triton interpreter (small shapes); ``gpu``-marked tests run a
mixture-of-experts layer's real shape on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from surgery.kernels import gather_sum, gather_sum_reference
from surgery.kernels.gather_sum import _gather_sum_torch

MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def case(rows: int, width: int, group: int, dtype, device, weighted: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=g).to(device, dtype)
    index = torch.randint(0, rows, (rows // group * group,), generator=g)
    index[:group] = 0  # output row 0: source row 0, group times
    weights = torch.rand(rows, generator=g).to(device) if weighted else None
    return values, index.to(device), weights


def assert_rounded_once(got, values, index, group, weights) -> None:
    """``got`` is the exact weighted sum, up to fp32's error on the sum of the terms' magnitudes
    (group terms) and one rounding to the output dtype (half an ulp)."""
    want = gather_sum_reference(values, index, group, weights)
    magnitude = gather_sum_reference(
        values.abs(), index, group, None if weights is None else weights.abs()
    )
    half_ulp = want.abs() * 2.0 ** -(MANTISSA[got.dtype] + 1)
    bound = half_ulp + group * 2.0**-24 * magnitude + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("width", [37, 256], ids=["W37", "W256"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_matches_the_reference(dtype, group, width, weighted, device):
    values, index, weights = case(48, width, group, dtype, device, weighted)
    got = gather_sum(values, index, group, weights)
    assert got.shape == (48 // group, width) and got.dtype == dtype and got.is_contiguous()
    assert_rounded_once(got, values, index, group, weights)
    if not weighted and dtype != torch.float32:  # group copies of one row: exact in fp32
        assert torch.equal(got[0], (values[0].double() * group).to(dtype))


def test_int32_index_strided_rows_and_the_pytorch_path(device):
    """int32 indices; rows further apart than their width (a slice of a wider tensor) read where
    they are; the PyTorch path (CPU without the interpreter) within the same bound."""
    wide, index, weights = case(40, 64, 4, torch.bfloat16, device, weighted=True)
    values = wide[:, 5:45]
    got = gather_sum(values, index.int(), 4, weights)
    assert_rounded_once(got, values, index, 4, weights)
    assert_rounded_once(_gather_sum_torch(values, index, 4, weights), values, index, 4, weights)


def test_empty():
    out = gather_sum(torch.randn(5, 8), torch.empty(0, dtype=torch.long), 2)
    assert out.shape == (0, 8)


def test_compiled_graph_keeps_the_op():
    """Under ``torch.compile`` the op is one node that the compiler calls, not a gather and a
    reduction it would lower itself."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    values, index, weights = case(24, 16, 4, torch.float32, "cpu", weighted=True)
    backend = AotEagerAndRecordGraphs()
    fn = torch.compile(lambda v, i, w: gather_sum(v, i, 4, w), backend=backend, fullgraph=True)
    got = fn(values, index, weights)
    ops = [str(n.target) for n in backend.fw_graphs[0].graph.nodes if n.op == "call_function"]
    assert ops == ["surgery.gather_sum.default"]
    assert_rounded_once(got, values, index, 4, weights)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_gpu_moe_layer_shape(weighted):
    """8192 tokens x top 8 rows of width 2048 in bf16 (a Qwen3-MoE layer's expert outputs)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    values = torch.randn(65536, 2048, device="cuda", generator=g).to(torch.bfloat16)
    index = torch.randperm(65536, device="cuda", generator=g)
    weights = torch.rand(65536, device="cuda", generator=g) if weighted else None
    assert_rounded_once(gather_sum(values, index, 8, weights), values, index, 8, weights)
