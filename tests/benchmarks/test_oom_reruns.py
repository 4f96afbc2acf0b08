"""``benchmarks/oom_reruns.py``: from pytest's own JUnit report, the out-of-memory failures only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import oom_reruns

CASES = """
import pytest

def test_fine():
    pass

@pytest.mark.parametrize("n", [1, 2, 3])
def test_oom(n):
    class OutOfMemoryError(RuntimeError):
        pass
    if n == 2:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if n == 3:
        raise RuntimeError("CUDA error: out of memory")

def test_wrong():
    assert 1 == 2
"""


def test_only_the_out_of_memory_failures_are_named_by_their_node_ids(tmp_path, capsys):
    folder = tmp_path / "tests" / "sub"
    folder.mkdir(parents=True)
    (folder / "test_cases.py").write_text(CASES)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "no:xdist", f"--junitxml={report}", "tests/sub/test_cases.py"],
                   cwd=tmp_path, capture_output=True, check=False)  # fmt: skip
    assert oom_reruns.oom_failures([report, tmp_path / "missing.xml"]) == [
        "tests/sub/test_cases.py::test_oom[2]",
        "tests/sub/test_cases.py::test_oom[3]",
    ]
    assert "missing.xml" in capsys.readouterr().err  # a killed run's absent report is named


def test_the_script_prints_nothing_without_an_out_of_memory_failure(tmp_path):
    """gpu_suite.sh reads its lines into a list and reruns them: an empty line would rerun the
    whole suite (pytest given an empty argument)."""
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "no:xdist", f"--junitxml={report}", "test_fine.py"],
                   cwd=tmp_path, capture_output=True, check=False)  # fmt: skip
    script = Path(oom_reruns.__file__)
    out = subprocess.run([sys.executable, str(script), str(report)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout == ""
