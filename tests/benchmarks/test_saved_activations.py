"""``benchmarks/saved_activations.py``: a graph's outputs grouped by the op that computed them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import saved_activations


def test_outputs_are_counted_at_the_op_behind_views_and_items():
    def graph(a, b):
        product = torch.mm(a, b)
        values, _ = torch.sort(a, dim=-1)
        return (product.view(-1), product.t(), values, a)

    gm = make_fx(graph)(torch.randn(4, 8), torch.randn(8, 16))
    rows = {op: (n, mib) for op, n, mib in saved_activations.saved_by_op(gm)}
    assert rows["aten.mm.default"] == (2, 2 * 4 * 16 * 4 / 2**20)
    assert rows["aten.sort.default"] == (1, 4 * 8 * 4 / 2**20)
    assert rows["placeholder"] == (1, 4 * 8 * 4 / 2**20)
