"""``benchmarks/scale.py`` end to end on two CPU ranks (gloo, tiny shapes): every engine that runs
on CPU (FSDP2, tensor parallelism with FSDP2 on a 1 x 2 mesh, and transformers' own tensor
parallelism, ``tp_plan="auto"``) trains every contender that runs there, surgery's head is fused
under each, and its losses equal the unpatched model's; so do those of torch's ``loss_parallel``
over the vocabulary-sharded head (torchtitan's loss), which only the ``tp`` engine has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"


def test_scale_benchmark_runs_fsdp2_and_tensor_parallel_on_cpu(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(SCRIPT), "--cpu", "--tiny", "--models", "llama3_8b", "--engines", "fsdp2,tp,tp_plan",
        "--contenders", "unpatched,surgery,surgery_noac,loss_parallel", "--seq", "32",
        "--warmup", "0",
        "--steps", "2", "--max-seq-doublings", "1", "--out", str(tmp_path),
        "--checkpoint-dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "scale.json").read_text())["runs"]
    assert [(r["engine"], r["contender"]) for r in runs] == [
        (e, c) for e in ("fsdp2", "tp", "tp_plan")
        for c in ("unpatched", "surgery", "surgery_noac", "loss_parallel")
    ]  # fmt: skip
    elsewhere = [r for r in runs if r["contender"] == "loss_parallel" and r["engine"] != "tp"]
    assert [r.get("status") for r in elsewhere] == ["unavailable"] * 2, elsewhere
    runs = [r for r in runs if r not in elsewhere]
    for engine in ("fsdp2", "tp", "tp_plan"):
        by = {r["contender"]: r for r in runs if r["engine"] == engine}
        assert not by["unpatched"]["fused"]
        if engine == "tp":
            assert not by["loss_parallel"]["fused"]
            for got, want in zip(by["loss_parallel"]["losses"], by["unpatched"]["losses"],
                                 strict=True):  # fmt: skip
                assert abs(got - want) <= 1e-5 * want, (got, want)
        for contender in ("surgery", "surgery_noac"):
            assert by[contender]["fused"], (engine, contender)
            for got, want in zip(by[contender]["losses"], by["unpatched"]["losses"], strict=True):
                assert abs(got - want) <= 1e-3 * want, (engine, contender, got, want)
        assert all(r["tokens_per_s_per_gpu"] > 0 and r["max_seq"] >= 32 for r in by.values())


def test_transformers_tensor_parallelism_with_its_fsdp2_on_four_cpu_ranks(tmp_path):
    """``--engines tp_plan --tp 2`` on four ranks: transformers' tensor parallelism over pairs,
    its FSDP2 over the two pairs, each pair its own batch; surgery's head fused, its losses the
    unpatched model's."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
        str(SCRIPT), "--cpu", "--tiny", "--models", "llama3_8b", "--engines", "tp_plan",
        "--contenders", "unpatched,surgery", "--tp", "2", "--seq", "32", "--warmup", "0",
        "--steps", "2", "--max-seq-doublings", "0", "--out", str(tmp_path),
        "--checkpoint-dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["contender"]: r for r in json.loads((tmp_path / "scale.json").read_text())["runs"]}
    assert runs["surgery"]["fused"] and not runs["unpatched"]["fused"]
    for got, want in zip(runs["surgery"]["losses"], runs["unpatched"]["losses"], strict=True):
        assert abs(got - want) <= 1e-3 * want, (got, want)
    # Two data-parallel pairs of 32 tokens over four GPUs: 16 tokens a GPU a step.
    for r in runs.values():
        assert r["tokens_per_s_per_gpu"] * r["step_s"] == pytest.approx(16)


def test_profile_writes_rank_zeros_tables_of_one_more_step(tmp_path):
    """``--profile``: one more step of each run under torch.profiler on every rank (its
    collectives need them all), rank 0's tables in ``profile_{model}_{engine}_{contender}.txt``;
    the step recorded is a training step (the head's fused loss, the optimizer)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(SCRIPT), "--cpu", "--tiny", "--models", "llama3_8b", "--engines", "tp",
        "--contenders", "surgery", "--seq", "32", "--warmup", "0", "--steps", "1",
        "--max-seq-doublings", "0", "--profile", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("profile_*")) == [
        "profile_llama3_8b_tp_surgery.txt"
    ]
    text = (tmp_path / "profile_llama3_8b_tp_surgery.txt").read_text()
    assert text.startswith("one step of llama3_8b_tp_surgery on rank 0 of 2, 1 x 32 tokens")
    assert "== top ops by host time (self)" in text
    assert "Optimizer.step#AdamW.step" in text
    assert "VocabParallel" in text, text[:3000]


def test_a_liger_run_leaves_transformers_modeling_module_as_it_was(monkeypatch):
    """Liger's instance patch swaps the classes of transformers' modeling file for the whole
    process: the runner puts them back after a Liger run, so the contenders after it build
    transformers' own modules (surgery refuses a model built with Liger's, and an unpatched
    run would time Liger)."""
    import importlib

    import pytest
    import torch

    liger = pytest.importorskip("liger_kernel.transformers")
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    scale = importlib.import_module("scale")
    module = importlib.import_module(scale.modeling_module("llama3_8b"))
    before = dict(vars(module))

    def run(self, name, engine, contender):
        model = scale.build_model(name, True, torch.device("cpu"))
        liger._apply_liger_kernel_to_instance(model=model)
        assert dict(vars(module)) != before  # the premise: Liger changed the module
        return {}

    monkeypatch.setattr(scale.Runner, "_run", run)
    runner = object.__new__(scale.Runner)
    assert runner.run("llama3_8b", "fsdp2", "liger") == {}
    assert dict(vars(module)) == before
