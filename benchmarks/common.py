"""Helpers shared by the benchmark scripts: importing ``surgery`` from a checkout, the environment
record written into every result file, and plain-text tables.

Nothing here imports torch at module level, so a script can set ``TRITON_INTERPRET`` (which must be
set before triton is first imported) after parsing its arguments.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
GIB = 1024**3


def import_surgery():
    """Import ``surgery`` from THIS checkout, installed or not: a benchmark measures the code
    beside it, never another copy on ``sys.path`` (e.g. a wheel installed into PYTHONPATH).

    pyproject maps the top-level folders ``kernels``, ``models``, ``convergence`` under
    ``surgery`` (setuptools ``package-dir``). An editable install of this checkout has that
    mapping and a plain import is used. Otherwise the package is loaded from
    ``surgery/__init__.py`` with both ``surgery/`` and the repo root as its search path, so that
    ``surgery.kernels`` resolves to ``kernels/`` exactly as the installed mapping does.
    """
    try:
        spec = importlib.util.find_spec("surgery")
    except (ImportError, ValueError):
        spec = None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is not None and origin.is_relative_to(REPO_ROOT):
        try:
            import surgery
            import surgery.kernels

            return surgery
        except ImportError:
            pass
    elif origin is not None:
        print(f"note: ignoring the surgery at {origin.parent}; loading {REPO_ROOT}", flush=True)
    for name in [n for n in sys.modules if n == "surgery" or n.startswith("surgery.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "surgery",
        REPO_ROOT / "surgery" / "__init__.py",
        submodule_search_locations=[str(REPO_ROOT / "surgery"), str(REPO_ROOT)],
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load surgery from {REPO_ROOT}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["surgery"] = module
    spec.loader.exec_module(module)
    importlib.import_module("surgery.kernels")
    return module


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    # --no-optional-locks: a read-only look that never rewrites the index.
    dirty = subprocess.run(
        ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def environment() -> dict[str, Any]:
    """What a reader needs to know to trust or reproduce a result file."""
    import torch

    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "surgery_loaded_from": str(REPO_ROOT),  # import_surgery() always loads this checkout
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_memory_gib": (
            round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
            if torch.cuda.is_available()
            else None
        ),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    for pkg in (
        "triton",
        "transformers",
        "liger-kernel",
        "cut-cross-entropy",
        "peft",
        "accelerate",
    ):
        env[pkg] = package_version(pkg)
    return env


def write_json(path: Path, obj: Any) -> None:
    """Write atomically, so a run cut off by a time limit leaves the last complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def gib(n_bytes: float | None) -> float | None:
    return None if n_bytes is None else n_bytes / GIB


def fmt(value: Any, spec: str = ".3g") -> str:
    """Format a table cell: numbers with ``spec``, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A fixed-width text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        parts = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def short_error(exc: BaseException, limit: int = 300) -> str:
    """One line for the result file: the exception type and the start of its message."""
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def save_figure(fig, path: Path) -> str:
    """Lay out, write (png, 120 dpi) and close a matplotlib figure; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
