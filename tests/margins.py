"""How close each test comes to its error budget: run the suite with ``SURGERY_MARGINS=DIR`` set
and every budget check appends (test, what, error, bound) to ``DIR/margins-<pid>.jsonl``;
``python -m tests.margins DIR`` then lists, per test that passed, its worst error as a fraction of
its bound, the tests at half their budget or closer first.

Recorded: ``tests.utils.assert_close_budget``; ``torch.testing.assert_close`` with a tolerance
(the largest ``|actual - expected| / (atol + rtol * |expected|)``; exact comparisons have no
margin to record); the convergence suite's checks (``surgery.convergence.compare.Check``: value
over limit). A test that expects a check to fail (a planted bug) records a ratio above 1.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

__all__ = ["ENV", "record", "recording"]

ENV = "SURGERY_MARGINS"
_current: list[str] = []


def recording() -> bool:
    return bool(os.environ.get(ENV))


def record(what: str, error: float, bound: float) -> None:
    """Append one check of the running test (no-op unless ``SURGERY_MARGINS`` is set)."""
    if not recording() or not _current:
        return
    path = Path(os.environ[ENV]) / f"margins-{os.getpid()}.jsonl"
    with path.open("a") as f:
        line = {"test": _current[-1], "what": what, "error": error, "bound": bound}
        f.write(json.dumps(line) + "\n")


def _assert_close_recorder(original):
    def assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        if (
            rtol
            and isinstance(actual, torch.Tensor)
            and isinstance(expected, torch.Tensor)
            and actual.shape == expected.shape
            and actual.is_floating_point()
        ):
            a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
            diff, allowed = (a - e).abs(), (atol or 0.0) + rtol * e.abs()
            ratio = torch.where(diff == 0, 0.0, diff / allowed).nan_to_num(float("inf"))
            if ratio.numel():
                record(str(kwargs.get("msg", "assert_close")), float(ratio.max()), 1.0)
        return original(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)

    return assert_close


def install(nodeid: str, monkeypatch) -> None:
    """Record the checks of the test ``nodeid`` (called by the harness before each test)."""
    from surgery.convergence import compare

    _current.append(nodeid)
    monkeypatch.setattr(
        torch.testing, "assert_close", _assert_close_recorder(torch.testing.assert_close)
    )
    passed = compare.Check.passed

    def recorded(check):
        record(f"{check.run} {check.side} {check.name}", check.value, check.limit)
        return passed.fget(check)

    monkeypatch.setattr(compare.Check, "passed", property(recorded))


def uninstall() -> None:
    _current.pop()


def summary(folder: Path, outcomes: dict[str, str] | None = None) -> list[tuple[float, str, str]]:
    """(worst error / bound, test, what) per test, worst first."""
    worst: dict[str, tuple[float, str]] = defaultdict(lambda: (0.0, ""))
    for path in folder.glob("margins-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            ratio = (
                0.0
                if r["error"] == 0
                else r["error"] / r["bound"]
                if r["bound"] > 0
                else float("inf")
            )
            if ratio > worst[r["test"]][0]:
                worst[r["test"]] = (ratio, r["what"])
    return sorted(((v[0], t, v[1]) for t, v in worst.items()), reverse=True)


if __name__ == "__main__":
    rows = summary(Path(sys.argv[1]))
    close = [row for row in rows if 0.5 <= row[0] <= 1.0]
    over = [row for row in rows if row[0] > 1.0]
    print(
        f"{len(rows)} tests record a budget; {len(close)} reach half of it or more; {len(over)} "
        "a check past it (a planted bug the test expects to fail, or a failed test):"
    )
    for ratio, test, what in close + over:
        print(f"{ratio:6.2f}  {test}  ({what})")
