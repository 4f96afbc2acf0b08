"""``benchmarks/trace_gaps.py``: GPU idle gaps of a chrome trace, by the kernel after them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_gaps


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gaps_are_the_idle_time_before_each_kernel():
    events = [
        _kernel("a", 0, 10),
        _kernel("b", 15, 10),  # a 5 us gap: under the threshold
        _kernel("c", 100, 10),  # 75 us
        _kernel("memset", 110, 5, cat="gpu_memset"),
        {"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 500},  # not GPU work
        _kernel("d", 200, 20),  # 85 us
    ]
    busy, span, found = trace_gaps.gaps(events)
    assert (busy, span) == (55, 220)
    assert found == [(75, "c"), (85, "d")]
