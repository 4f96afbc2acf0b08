"""``benchmarks/trl_step.py``'s contenders: ``trl_surgery``'s GRPO pass keeps the head's logits
for the backward on every call, ``trl_surgery_recompute``'s on none, and the contenders that run
one objective only are skipped on the other (CPU, tiny model, each worker in its own process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trl_step

pytest.importorskip("trl")


@pytest.mark.parametrize(
    "contender, kept", [("trl_surgery", True), ("trl_surgery_recompute", False)]
)
def test_grpo_contenders_keep_or_recompute(contender, kept):
    job = dict(model="llama", contender=contender, objective="grpo", kind="padded", smoke=True)
    row = trl_step.run_job(job, timeout=600)
    assert "error" not in row, row
    assert row["served_by_surgery"]
    calls = trl_step.WARMUP + trl_step.TIMED
    assert row["kept_calls"] == (calls if kept else 0)


def test_kept_calls_are_surgery_contenders_only():
    job = dict(model="llama", contender="trl", objective="grpo", kind="padded", smoke=True)
    row = trl_step.run_job(job, timeout=600)
    assert "error" not in row, row
    assert row["kept_calls"] is None and not row["served_by_surgery"]


def test_one_objective_contenders_are_skipped_on_the_other(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(trl_step, "run_job", lambda job, timeout: ran.append(job) or dict(job))
    monkeypatch.setattr(trl_step, "environment", lambda: {})
    trl_step.main(["--smoke", "--models", "llama", "--out", str(tmp_path),
                   "--contenders", "trl_surgery_options,trl_surgery_recompute"])  # fmt: skip
    assert {(j["contender"], j["objective"]) for j in ran} == {
        ("trl_surgery_options", "sft"),
        ("trl_surgery_recompute", "grpo"),
    }


def test_profile_writes_one_steps_tables(tmp_path):
    job = dict(model="llama", contender="trl_surgery", objective="grpo", kind="padded", smoke=True,
               profile=True, out=str(tmp_path))  # fmt: skip
    row = trl_step.run_job(job, timeout=600)
    assert "error" not in row, row
    text = (tmp_path / "profile_llama_trl_surgery_grpo_padded.txt").read_text()
    assert "no optimizer step" in text.splitlines()[0]
    assert "top ops by host time" in text and "linear_cross_entropy" in text
    # the profiled steps are not counted with the timed ones
    assert row["kept_calls"] == trl_step.WARMUP + trl_step.TIMED
