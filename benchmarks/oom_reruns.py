"""The tests of a GPU suite run that failed for want of GPU memory, as pytest node ids.

    python benchmarks/oom_reruns.py OUT/suite_compile.xml OUT/suite_rest.xml

On one GPU, ``gpu_suite.sh``'s stage 1 runs the compile tests and the rest side by side (14
workers on one H200): a test or two of a run can find the memory taken by its neighbours. The
script rereads the runs' JUnit reports and prints, one per line, the tests whose failure or error
is a ``torch.OutOfMemoryError`` or a CUDA "out of memory" error (a kernel launch's, cuBLAS',
Triton's); ``gpu_suite.sh`` reruns those alone, after the runs, into a log of its own (the first
failure stays in its run's log). Any other failure is not rerun. A report that is missing (a run
killed by its time limit writes none) or unreadable is named on stderr: its failures are not
rerun.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OOM = ("OutOfMemoryError", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def node_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit test case: module ``tests.a.test_b`` -> ``tests/a/test_b.py``
    (the suite has no test classes)."""
    return f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"


def oom_failures(reports: list[Path]) -> list[str]:
    """Node ids, in report order, of the test cases whose failure or error names one of ``OOM``."""
    found = []
    for report in reports:
        try:
            cases = list(ET.parse(report).iter("testcase"))
        except (OSError, ET.ParseError) as e:
            print(f"oom_reruns: no report read from {report}: {e}", file=sys.stderr)
            continue
        for case in cases:
            text = "".join(b.get("message", "") + (b.text or "")
                           for b in (*case.iter("failure"), *case.iter("error")))  # fmt: skip
            if any(marker in text for marker in OOM):
                found.append(node_id(case))
    return list(dict.fromkeys(found))


if __name__ == "__main__":
    for test in oom_failures([Path(p) for p in sys.argv[1:]]):
        print(test)  # none: no line at all (an empty one would rerun the whole suite)
