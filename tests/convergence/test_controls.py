"""Negative controls: every planted bug of ``surgery.convergence.controls`` fails the checks, in
fp32 and in bf16, at z-loss scales 1e-2 and 1e-4, from step 0 and from a late step; the same
runs with the bug-free fake patch pass, and so does the real patch."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from surgery.convergence.compare import evaluate
from surgery.convergence.controls import (
    BUGS,
    LATE_ONSET,
    Control,
    controls,
    fake_patch,
    run_config,
)
from surgery.convergence.train import Variant, train_and_compare

CONTROLS = controls()


@functools.cache
def _correct(cfg):
    return train_and_compare(cfg, patch=fake_patch())


def _failed(record):
    return [c for c in evaluate(record) if not c.passed]


@pytest.mark.parametrize("control", CONTROLS, ids=[c.name for c in CONTROLS])
def test_planted_bug_fails_and_correct_fake_passes(control):
    cfg = run_config(control)
    failed = _failed(_correct(cfg))
    assert not failed, [f"{c.side}:{c.name} {c.value:.2e} > {c.limit:.2e}" for c in failed]
    failed = _failed(train_and_compare(cfg, patch=fake_patch(control.bug, control.onset)))
    assert failed, f"{control.name}: {BUGS[control.bug].description} passed every check"
    if control.onset:
        # Caught after the start, by a check that looks past step 0.
        early = [c.name for c in failed if c.name.endswith("@0") or c.name.startswith("eval_")]
        assert not early, early
        assert all(f"step {s}" not in c.detail for c in failed for s in range(LATE_ONSET))


def test_every_bug_runs_in_both_dtypes_at_both_z_scales_early_and_late():
    assert {(c.bug, c.dtype, c.z) for c in CONTROLS} == {
        (b, d, z) for b in BUGS for d in ("fp32", "bf16") for z in (1e-2, 1e-4)
    }
    assert {c.bug for c in CONTROLS if c.onset} == {b for b, s in BUGS.items() if s.late}
    with pytest.raises(ValueError, match="unknown bug"):
        fake_patch("nonexistent")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_real_patch_passes_the_controls_configs(dtype):
    """``surgery.patch`` itself (Triton kernels through the interpreter) on what the controls
    run: past the late onset, z-loss 1e-4, label smoothing, the per-sequence mean, both layouts
    (shift_labels on padded rows, unmasked document starts on packed ones); and dynamic RoPE on
    packed rows."""
    base = run_config(Control("ls_dropped", dtype, 1e-4))
    cfg = dataclasses.replace(base, variant=Variant("sequence", 1e-4, 0.1))
    failed = _failed(train_and_compare(cfg))
    assert not failed, [f"{c.side}:{c.name} {c.value:.2e} > {c.limit:.2e}" for c in failed]
    cfg = run_config(Control("rope_no_restart", dtype, 1e-4), steps=3)
    assert json.loads(cfg.config_overrides)["rope_parameters"]["rope_type"] == "dynamic"
    failed = _failed(train_and_compare(cfg))
    assert not failed, [f"{c.side}:{c.name} {c.value:.2e} > {c.limit:.2e}" for c in failed]
