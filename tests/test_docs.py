"""What the README and docs/ claim about the code, kept true: every option of ``patch`` documented
with its default, every supported class named, every link to a page that exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import surgery
from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS
from tests.utils import extra_requirements

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def classes() -> list[str]:
    lms = [spec.causal_lm for spec in SPECS]
    wrappers = [w.wrapper for spec in (*SPECS, *MULTIMODAL_ONLY_SPECS) for w in spec.multimodal]
    return sorted(set(lms + wrappers))


def test_every_option_is_documented_with_its_default():
    text = (DOCS / "options.md").read_text()
    for field in dataclasses.fields(surgery.PatchOptions):
        heading = f"### `{field.name}` (default `{field.default!r}`)"
        assert heading in text, f"docs/options.md lacks {heading!r}"
    documented = re.findall(r"^### `(\w+)`", text, re.M)
    assert sorted(documented) == sorted(f.name for f in dataclasses.fields(surgery.PatchOptions))


@pytest.mark.parametrize("page", ["README.md", "docs/support.md"])
def test_every_supported_class_is_named(page):
    text = (ROOT / page).read_text()
    missing = [name for name in classes() if not re.search(rf"\b{name}\b", text)]
    assert not missing, f"{page} does not name {missing}"


def test_every_link_reaches_a_page():
    for page in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links to a missing {target}"


def test_readme_is_a_front_page():
    """A reader takes it in within minutes; the rest lives in docs/."""
    assert len(README.read_text().splitlines()) <= 200


def test_the_train_extra_brings_what_the_trainer_needs():
    """``pip install "transformers-surgery[train]"`` (the README's install) brings accelerate, the
    package transformers' Trainer refuses to run without."""
    assert "accelerate" in extra_requirements("train")
