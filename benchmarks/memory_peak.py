"""What is alive at a training step's peak of GPU memory: the allocations of one step, recorded by
PyTorch's allocator (``torch.cuda.memory._record_memory_history``), replayed to the moment the
allocated total is highest, and grouped by where each live block was allocated.

``record_step(step)`` runs one step under the recorder and returns the trace and the memory held
before it (weights, AdamW state: allocated before the recording, so not in the trace);
``peak_table(trace, before)`` is the plain-text report; ``train_step.py --profile-only`` writes
it beside the profiler tables (``memory_<model>_<contender>_<scenario>.txt``).

A block is labelled by the innermost frame of its Python stack outside torch itself (the model's
code, surgery's, an Inductor-generated graph file, or the ``loss.backward()`` line for builtin
ops' backward, whose Python stack is the caller's). The report lists the labels by bytes alive at
the peak, the largest blocks, and the allocation that reached the peak. A compiled graph reuses a
dead buffer for a later tensor, so there a block's label says where it was allocated, not what it
holds at the peak (``saved_activations.py`` says what a compiled graph keeps).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

MIB = 1024**2
# Frames from these folders say nothing about the caller (torch's own Python, the allocator).
_INTERNAL = (f"{os.sep}torch{os.sep}", f"{os.sep}contextlib.py", f"{os.sep}functools.py")


def label(frames: Iterable[dict[str, Any]]) -> str:
    """``file:line function`` of the innermost frame outside torch (``?`` if there is none).
    Frames are innermost first, as the allocator records them."""
    for f in frames:
        name = f.get("filename", "")
        if name and not any(part in name for part in _INTERNAL):
            return f"{os.path.basename(name)}:{f.get('line', '?')} {f.get('name', '')}"
    return "?"


def peak_live(trace: Iterable[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]], dict]:
    """Replays ``trace`` (the allocator's events of one device, oldest first): the highest
    running total of bytes allocated (relative to the start; frees of blocks allocated before the
    recording lower it), the blocks alive at that moment by address, and the event that made it.
    Only ``alloc`` and ``free_completed`` move memory (a ``free_requested`` block is still held
    until its streams are done with it)."""
    live: dict[int, dict[str, Any]] = {}
    running = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    peak_event: dict[str, Any] = {}
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            running += event["size"]
            if running > peak:
                peak, at_peak, peak_event = running, dict(live), event
        elif action == "free_completed":
            live.pop(event["addr"], None)
            running -= event["size"]
    return peak, at_peak, peak_event


def peak_table(trace: list[dict[str, Any]], before: int, top: int = 25) -> str:
    """The report of ``peak_live(trace)``: the peak (``before`` + the trace's highest total), the
    labels of the blocks alive then by bytes, the largest blocks, the event that made the peak."""
    peak, live, event = peak_live(trace)
    by_label: dict[str, list[int]] = defaultdict(list)
    for block in live.values():
        by_label[label(block.get("frames", ()))].append(block["size"])
    lines = [
        f"held before the step (weights, optimizer state, ...): {before / MIB:,.0f} MiB",
        f"peak: {(before + peak) / MIB:,.0f} MiB ({peak / MIB:,.0f} MiB allocated in the step and"
        f" alive then, in {len(live)} blocks)",
        f"made by: {event.get('size', 0) / MIB:,.1f} MiB at {label(event.get('frames', ()))}",
        "",
        "== alive at the peak, by where they were allocated",
        f"{'MiB':>10} {'blocks':>7}  where",
    ]
    rows = sorted(by_label.items(), key=lambda kv: -sum(kv[1]))
    lines += [f"{sum(s) / MIB:>10,.1f} {len(s):>7}  {where}" for where, s in rows[:top]]
    if len(rows) > top:
        rest = [x for _, s in rows[top:] for x in s]
        lines.append(f"{sum(rest) / MIB:>10,.1f} {len(rest):>7}  ({len(rows) - top} more places)")
    lines += ["", "== the largest blocks alive at the peak", f"{'MiB':>10}  where"]
    for block in sorted(live.values(), key=lambda b: -b["size"])[:top]:
        lines.append(f"{block['size'] / MIB:>10,.1f}  {label(block.get('frames', ()))}")
    return "\n".join(lines) + "\n"


def record_step(step: Callable[[], Any], device: Any = None) -> tuple[list[dict[str, Any]], int]:
    """Runs ``step()`` once with the allocator's history recorded (Python stacks) on CUDA:
    (the events of ``device``'s trace, the bytes allocated before the step)."""
    import torch

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.cuda._utils._get_device_index(device, optional=True)
    traces = snapshot.get("device_traces", [])
    return (traces[index] if index < len(traces) else []), before
