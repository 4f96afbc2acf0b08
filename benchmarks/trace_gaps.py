"""Where the GPU waits in one profiled step: idle gaps in a gzipped chrome trace, grouped by the
kernel that ends each gap.

    python benchmarks/trace_gaps.py results/profile_<model>_<contender>_<scenario>.trace.json.gz

The traces come from ``train_step.py --profile-only --profile-trace``. The profiler slows the host,
so gaps are larger than in an unprofiled step; what they sit before is what to look at. Prints
the kernels' busy time, the step's span and the idle time, then the gaps over 30 us summed by the
kernel that follows them (the GPU waited for the host to launch it).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
MIN_GAP_US = 30


def gaps(events: list[dict]) -> tuple[float, float, list[tuple[float, str]]]:
    """(busy us, span us, [(gap us, name of the kernel after it)]) of the trace's GPU events."""
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
        key=lambda e: e["ts"],
    )
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    out, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for e in kernels[1:]:
        if e["ts"] - end > MIN_GAP_US:
            out.append((e["ts"] - end, e["name"]))
        end = max(end, e["ts"] + e["dur"])
    return busy, span, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    with gzip.open(args.trace) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    busy, span, found = gaps(events)
    print(
        f"GPU busy {busy / 1e3:.1f} ms, span {span / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms"
    )
    print(f"gaps over {MIN_GAP_US} us: {len(found)}, {sum(g for g, _ in found) / 1e3:.1f} ms")
    by_kernel, count = Counter(), Counter()
    for g, name in found:
        by_kernel[name[:60]] += g
        count[name[:60]] += 1
    print(f"{'ms':>8} {'gaps':>5}  the kernel after them")
    for name, total in by_kernel.most_common(args.top):
        print(f"{total / 1e3:>8.2f} {count[name]:>5}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
