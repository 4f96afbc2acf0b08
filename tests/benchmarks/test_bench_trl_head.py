"""``benchmarks/bench_trl_head.py``: its CPU smoke run (TRL's head, surgery's, the loss alone) and
the profile's summary of where the GPU idles."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_trl_head


@pytest.fixture(autouse=True)
def _trl_trainer_modules_restored():
    """``bench_trl_head.trl_function`` stands a stub in for ``trl.trainer.utils`` (and an empty
    ``trl.trainer``) where TRL's trainers are not imported yet: afterwards the process's modules
    are put back, or a later test in the same worker would find TRL without its trainers."""
    names = ("trl.trainer", "trl.trainer.utils")
    saved = {name: sys.modules.get(name) for name in names}
    yield
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_idle_summary_counts_the_gaps_per_step_by_the_kernel_after_them():
    # two steps over a 2000 us span: gaps of 200 and 100 us before "gemm", 50 before "scale"
    events = [
        _kernel("gemm", 0, 600),
        _kernel("scale", 650, 10),  # a 50 us gap: counted (over 30)
        _kernel("gemm", 860, 600),  # 200 us
        _kernel("tiny", 1470, 5),  # 10 us: under the threshold
        _kernel("gemm", 1575, 425),  # 100 us
    ]
    text = bench_trl_head.idle_summary(events, 2, 12.5, "head sft surgery")
    lines = text.splitlines()
    assert lines[0] == ("== head sft surgery: wall 12.50 ms a step; GPU span 1.00 ms, "
                        "idle in gaps 0.17 ms a step")  # fmt: skip
    assert lines[1].split() == ["150", "us", "a", "step", "before", "gemm"]
    assert lines[2].split() == ["25", "us", "a", "step", "before", "scale"]
    assert len(lines) == 3


def test_smoke_run_writes_every_contender(tmp_path):
    pytest.importorskip("trl")
    assert bench_trl_head.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "trl_head_smoke.json").read_text())["rows"]
    assert {(r["case"], r["objective"]) for r in rows} == {
        (c, o) for c in bench_trl_head.SMOKE for o in bench_trl_head.OBJECTIVES
    }
    for r in rows:  # the same inputs, TRL's mathematics: within bf16's rounding of TRL's
        assert r["rel_diff_log_probs"] < 5e-3, r
        other = "rel_diff_dw_lce" if r["objective"] == "sft" else "rel_diff_dw_recompute"
        assert r["rel_diff_dw"] < 2e-2 and r[other] < 2e-2, r


def test_grpo_contenders_take_their_schedules(monkeypatch):
    """``surgery`` keeps the unit gradient (from its second step: the first teaches the hint),
    ``surgery_kept_logits`` the logits (its backward sweeps them), ``surgery_recompute`` runs
    the four-product backward."""
    pytest.importorskip("trl")
    import torch

    api = importlib.import_module("surgery.kernels.linear_cross_entropy.api")
    ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    calls = []

    def spy(module, name, label):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, **k: calls.append(label) or fn(*a, **k))  # fmt: skip

    spy(api, "lce_bwd_kept", "kept")
    spy(api, "lce_bwd_recompute", "recompute")
    spy(ops, "_kept_q_backward", "unit")
    spy(ops, "_gradient_in_place", "sweep")
    x, w, labels, advantage = bench_trl_head.make_inputs(64, 32, 300, "cpu")
    fns = bench_trl_head.contenders("grpo", None, advantage)
    wants = {"surgery": ["kept", "unit"], "surgery_kept_logits": ["kept", "sweep"],
             "surgery_recompute": ["recompute"]}  # fmt: skip
    for who, want in wants.items():
        for _ in range(2):
            calls.clear()
            _, loss = fns[who](x, w, labels)
            torch.autograd.grad(loss, (x, w))
        assert calls == want, (who, calls)


def test_profile_refuses_the_smoke_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_trl_head.main(["--smoke", "--profile", "--out", str(tmp_path)])
    assert "--profile needs the CUDA run" in capsys.readouterr().err
