"""The four packages import only the layers before them (``docs/architecture.md``): ``kernels``
imports torch and triton, ``models`` nothing of surgery's, ``surgery`` not the convergence suite.
Read from the source (every import statement, relative ones resolved), not from what happens to be
imported at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # folder -> the name it is installed as
    "kernels": "surgery.kernels",
    "models": "surgery.models",
    "surgery": "surgery",
    "convergence": "surgery.convergence",
}
# What each layer may not import (a prefix of the module's absolute name).
FORBIDDEN = {
    "kernels": ("transformers", "surgery.models", "surgery.convergence", "surgery."),
    "models": ("surgery.kernels", "surgery.convergence", "surgery."),
    "surgery": ("surgery.convergence",),
}
ALLOWED_INSIDE = {folder: PACKAGES[folder] for folder in FORBIDDEN}


def imports(folder: str) -> list[tuple[str, str]]:
    """(file, absolute module name) of every import in ``folder``'s Python files."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        package = [*PACKAGES[folder].split("."), *parts[:-1]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(str(path), alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    name = ".".join([*base, node.module] if node.module else base)
                else:
                    name = node.module
                found.append((str(path), name))
    return found


@pytest.mark.parametrize("folder", list(FORBIDDEN))
def test_no_import_runs_upward(folder):
    own = ALLOWED_INSIDE[folder]
    bad = [
        (path, name)
        for path, name in imports(folder)
        if not (name == own or name.startswith(own + "."))
        and any(name == f.rstrip(".") or name.startswith(f) for f in FORBIDDEN[folder])
    ]
    assert not bad, f"{folder}/ imports a later layer: {bad}"


def test_the_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """A planted upward import is caught (relative, from kernels into models)."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "bad.py").write_text("from ..models import SPECS\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="kernels/ imports a later layer"):
        test_no_import_runs_upward("kernels")
