"""Side by side, the outcome of every test of a peer's suite run twice from JUnit XML files: once
against the peer's own kernels (the control) and once against surgery's.

    python3 benchmarks/peer_suites/summary.py CONTROL.xml SURGERY.xml [--json OUT.json]

Prints the counts of each run, the skip reasons of ours, every test that fails with ours, saying
whether it passes in the control (a failure of ours) or fails there too (of the test), and every
test of the control that our run does not have (a file that did not load, say)."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, message)}``, outcome one of passed, failed, skipped."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (
                    (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                )
                break
        found[test_id] = (outcome, message)
    return found


def compare(control: dict, ours: dict) -> dict:
    """Counts of both runs, our skip reasons counted, our failures with the control's outcome
    of the same test, and the control's tests missing from ours."""
    failures = [
        {"test": t, "message": m, "control": control.get(t, ("absent", ""))[0]}
        for t, (o, m) in sorted(ours.items())
        if o == "failed"
    ]
    return {
        "control": dict(Counter(o for o, _ in control.values())),
        "surgery": dict(Counter(o for o, _ in ours.values())),
        "skip_reasons": dict(Counter(m for o, m in ours.values() if o == "skipped")),
        "failures": failures,
        "missing": sorted(set(control) - set(ours)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("control")
    p.add_argument("surgery")
    p.add_argument("--json")
    args = p.parse_args()
    result = compare(outcomes(args.control), outcomes(args.surgery))
    print(f"control (the peer's kernels): {result['control']}")
    print(f"surgery:                      {result['surgery']}")
    for reason, n in sorted(result["skip_reasons"].items(), key=lambda kv: -kv[1]):
        print(f"  skipped {n:4d}: {reason}")
    for f in result["failures"]:
        where = "fails in the control too" if f["control"] == "failed" else "passes in the control"
        print(f"  FAILED ({where}): {f['test']}\n      {f['message']}")
    for test in result["missing"]:
        print(f"  MISSING from ours (in the control): {test}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
