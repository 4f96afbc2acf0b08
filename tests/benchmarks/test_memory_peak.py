"""The memory-peak report of ``benchmarks/memory_peak.py`` on hand-made allocator traces."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import memory_peak

MIB = memory_peak.MIB


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


TORCH = ("/site/torch/nn/functional.py", 10, "linear")
MODEL = ("/site/transformers/models/llama/modeling_llama.py", 42, "forward")
HEAD = ("/repo/surgery/forwards/head.py", 7, "head_forward")


def _trace():
    return [
        {"action": "free_completed", "addr": 1, "size": 8 * MIB},  # allocated before recording
        {"action": "alloc", "addr": 2, "size": 100 * MIB, "frames": _frames(TORCH, MODEL)},
        {"action": "alloc", "addr": 3, "size": 30 * MIB, "frames": _frames(HEAD)},
        {"action": "free_requested", "addr": 2, "size": 100 * MIB},  # still held
        {"action": "alloc", "addr": 4, "size": 20 * MIB, "frames": _frames(HEAD)},
        {"action": "free_completed", "addr": 2, "size": 100 * MIB},
        {"action": "alloc", "addr": 5, "size": 90 * MIB, "frames": _frames(TORCH)},
    ]


def test_the_peak_is_the_highest_running_total_and_what_is_alive_then():
    peak, live, event = memory_peak.peak_live(_trace())
    assert peak == (100 + 30 + 20 - 8) * MIB  # the early free counts; free_requested does not
    assert sorted(live) == [2, 3, 4] and event["addr"] == 4


def test_blocks_are_labelled_by_their_innermost_frame_outside_torch():
    assert memory_peak.label(_frames(TORCH, MODEL)) == "modeling_llama.py:42 forward"
    assert memory_peak.label(_frames(TORCH)) == "?"


def test_the_report_groups_the_live_bytes_by_place():
    text = memory_peak.peak_table(_trace(), before=1000 * MIB)
    assert "peak: 1,142 MiB" in text
    assert "made by: 20.0 MiB at head.py:7 head_forward" in text
    grouped = text.split("== alive at the peak")[1].split("==")[0].splitlines()
    assert grouped[2].split() == ["100.0", "1", "modeling_llama.py:42", "forward"]
    assert grouped[3].split() == ["50.0", "2", "head.py:7", "head_forward"]
