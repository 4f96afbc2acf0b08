"""``python -m surgery.convergence``: table, json, png, exit status."""

from __future__ import annotations

import json

import pytest

from surgery.convergence import __main__ as cli
from surgery.convergence import train
from surgery.convergence.controls import fake_patch


def test_cli_passes_and_writes_outputs(tmp_path, capsys):
    code = cli.main(["--steps", "2", "--reduction", "mean", "--packed", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Triton kernels through the interpreter" in out
    assert "PASS" in out and "llama" in out
    payload = json.loads((tmp_path / "llama-fp32-tiny.json").read_text())
    assert payload["passed"] and payload["runs"][0]["config"]["steps"] == 2
    pytest.importorskip("matplotlib")
    assert (tmp_path / "llama-fp32-tiny.png").stat().st_size > 0


def test_cli_fails_on_a_bug(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "_default_patch", lambda: fake_patch("token_mean"))
    code = cli.main(
        ["--steps", "2", "--reduction", "sequence", "--packed", "--no-plot", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "patched-packed loss" in out


def test_cli_rejects_unknown_model(capsys):
    assert cli.main(["--model", "gpt2"]) == 2


def test_readme_main_command_installs_what_the_plot_needs():
    """The README's first command (the main job) must bring matplotlib, or a new user's first run
    writes no loss-curve png."""
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", readme.split("## The two commands", 1)[1], re.S)
    main = commands[0]
    assert "python -m surgery.convergence" in main
    extras = re.findall(r'-e "\.\[([a-z,]+)\]"', main)
    assert extras, f"the main command installs no extra: {main!r}"
    optional = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    needs = [dep for extra in extras[0].split(",") for dep in optional[extra]]
    assert any(dep.startswith("matplotlib") for dep in needs), needs


def test_cli_controls_table_and_json(tmp_path, capsys, monkeypatch):
    """``--controls``: a line per planted bug saying what caught it, a json, exit 0; exit 1 when
    a planted bug passes every check (here: a "bug" that changes nothing)."""
    from surgery.convergence import controls

    monkeypatch.setattr(controls, "BUGS", {"lm_head_grad": controls.BUGS["lm_head_grad"]})
    code = cli.main(["--controls", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "lm_head_grad/fp32/z0.0001" in out and "caught by" in out
    payload = json.loads((tmp_path / "controls-fp32-tiny.json").read_text())
    assert payload["passed"] and len(payload["controls"]) == 4
    caught_by = {c["name"] for row in payload["controls"] for c in row["caught_by"]}
    assert "probe_lm_head_grad" in caught_by
    monkeypatch.setattr(controls, "BUGS", {"harmless": controls.Bug("changes nothing")})
    assert cli.main(["--controls", "--out", str(tmp_path)]) == 1
    assert "MISSED" in capsys.readouterr().out


def test_cli_multimodal(tmp_path, capsys):
    """``--multimodal``: one wrapper, one step, the table and the json named after it, exit 0.
    Qwen3-VL-MoE, padded: every side trains the router aux loss the wrapper computes from its
    text config (asked for with ``output_router_logits``), compared with router replay."""
    code = cli.main(["--multimodal", "--model", "qwen3_vl_moe", "--steps", "1", "--padded",
                     "--reduction", "mean", "--no-plot", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "qwen3_vl_moe+images/tiny/fp32/mean: PASS" in out and "chat samples with images" in out
    payload = json.loads((tmp_path / "qwen3_vl_moe-fp32-tiny-multimodal.json").read_text())
    assert payload["passed"]
    run = payload["runs"][0]
    assert run["config"]["multimodal"] and run["vision_parameters"] > 0 and run["routing"]
    assert all(len(side["aux_loss"]) == 1 for side in run["sides"].values())
    assert cli.main(["--multimodal", "--model", "llama", "--steps", "1"]) == 2
