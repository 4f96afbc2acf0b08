"""The option table (``surgery.options.OPTIONS``) is the one place an option is written: ``patch``'s
keyword arguments, ``PatchOptions``, the loss-only subset and ``docs/options.md`` follow it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import surgery
from surgery.options import OPTIONS, SECTIONS, PatchOptions, loss_only_options

DOCS = Path(__file__).resolve().parents[2] / "docs" / "options.md"
PATCH_OWN = ("fallback", "strict")  # patch's arguments that are not options


def test_patch_takes_the_table_in_order():
    parameters = inspect.signature(surgery.patch).parameters
    keywords = [p for p in parameters.values() if p.kind is p.KEYWORD_ONLY]
    options = [p for p in keywords if p.name not in PATCH_OWN]
    assert [(p.name, p.default) for p in options] == [(o.name, o.default) for o in OPTIONS]
    assert [p.name for p in keywords[len(options) :]] == list(PATCH_OWN)


def test_patch_options_fields_are_the_table():
    fields = dataclasses.fields(PatchOptions)
    assert [(f.name, f.default) for f in fields] == [(o.name, o.default) for o in OPTIONS]
    assert PatchOptions() == PatchOptions(**{o.name: o.default for o in OPTIONS})


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("rope", 1, TypeError, "rope must be a bool"),
        ("loss_reduction", "sum", ValueError, "loss_reduction must be one of"),
        ("z_loss_scale", -1e-4, ValueError, "z_loss_scale must be >= 0"),
        ("z_loss_scale", True, TypeError, "z_loss_scale must be a number"),
        ("label_smoothing", 1.0, ValueError, r"label_smoothing must be in \[0, 1\)"),
        ("loss_chunk_bytes", 0, ValueError, "loss_chunk_bytes must be > 0"),
        ("loss_chunk_bytes", 2.0**20, TypeError, "loss_chunk_bytes must be an int or None"),
        ("experts_implementation", 3, TypeError, "experts_implementation must be a str or None"),
    ],
)
def test_each_option_refuses_what_it_does_not_take(name, value, error, message):
    with pytest.raises(error, match=message):
        PatchOptions(**{name: value})


def test_numbers_are_kept_as_floats():
    options = PatchOptions(z_loss_scale=1, label_smoothing=0)
    assert isinstance(options.z_loss_scale, float) and options.z_loss_scale == 1.0
    assert isinstance(options.label_smoothing, float)


def test_loss_only_subset():
    """The loss-only fallback keeps the loss options as given and turns every other one off."""
    given = PatchOptions(z_loss_scale=1e-4, loss_reduction="sequence", loss_low_memory=True)
    kept = loss_only_options(given)
    for option in OPTIONS:
        want = getattr(given, option.name) if option.loss_only else False
        assert getattr(kept, option.name) == want, option.name
    assert {o.name for o in OPTIONS if o.loss_only} == {
        "fused_linear_cross_entropy", "loss_reduction", "z_loss_scale", "label_smoothing",
        "return_logits", "loss_low_memory", "loss_chunk_bytes", "loss_skip_ignored",
        "experts_implementation",
    }  # fmt: skip


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_docs_follow_the_table():
    """docs/options.md: the table's sections in order, each option's heading (with its default)
    in its section in the table's order, and its summary as the entry's first paragraph."""
    text = DOCS.read_text()
    sections = re.split(r"^## (.+)\n", text, flags=re.M)
    found = dict(zip(sections[1::2], sections[2::2]))
    assert list(found) == list(SECTIONS)
    for section, body in found.items():
        entries = re.split(r"^### `(\w+)` \(default `([^`]*)`\)\n\n", body, flags=re.M)
        want = [o for o in OPTIONS if o.section == section]
        got = list(zip(entries[1::3], entries[2::3], entries[3::3]))
        assert [(name, default) for name, default, _ in got] == [
            (o.name, repr(o.default)) for o in want
        ], section
        for (name, _, entry), option in zip(got, want):
            first = _flat(entry.split("\n\n")[0])
            assert first == _flat(option.summary), f"{name}: the entry's first paragraph"
