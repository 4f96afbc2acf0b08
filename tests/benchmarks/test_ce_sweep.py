"""``benchmarks/ce_sweep.py``: its minimal sweep, in both orders of the second pass, computes what
torch does (the benchmark's A/B of the order measures the same work)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ce_sweep


@pytest.mark.skipif(ce_sweep.triton is None, reason="needs triton")
def test_the_minimal_sweep_in_either_order_matches_torch():
    lines = ce_sweep.smoke()
    assert len(lines) == 2 * len(ce_sweep.SMOKE)
