"""``python -m surgery.convergence``: table, json, png, exit status."""

from __future__ import annotations

import json
import re
import sys

import pytest

from surgery.convergence import __main__ as cli
from surgery.convergence.controls import fake_patch
from tests.utils import extra_requirements


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
    # The patched curves lie on the reference ones: the plot says so, or a reader sees one line.
    from surgery.convergence.report import OVERLAP_NOTE, figure

    assert OVERLAP_NOTE in figure(payload["runs"])._suptitle.get_text()


def test_cli_fails_on_a_bug(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("surgery.convergence.side.default_patch", lambda: fake_patch("token_mean"))
    code = cli.main(
        ["--steps", "2", "--reduction", "sequence", "--packed", "--no-plot", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "patched-packed loss" in out


def test_cli_rejects_unknown_model(capsys):
    assert cli.main(["--model", "gpt2"]) == 2
    assert cli.main(["--model", "llama,gpt2"]) == 2
    assert "'gpt2'" in capsys.readouterr().out


def test_cli_takes_a_comma_list_and_the_registry_keys(tmp_path, capsys):
    """``--model qwen3,gemma3_text`` trains both (a ``surgery.supported()`` key is read as the
    name the CLI lists), in one json named by both."""
    code = cli.main(["--model", "qwen3,gemma3_text", "--steps", "1", "--packed", "--reduction",
                     "mean", "--no-plot", "-q", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    payload = json.loads((tmp_path / "qwen3+gemma3-fp32-tiny.json").read_text())
    assert [run["config"]["model"] for run in payload["runs"]] == ["qwen3", "gemma3"]


def test_help_lists_every_model_and_the_default_folder():
    from surgery.convergence.configs import ARCHITECTURES
    from surgery.convergence.multimodal import MULTIMODAL

    text = " ".join(cli._parser().format_help().split())
    for name in [*ARCHITECTURES, *MULTIMODAL]:
        assert re.search(rf"\b{name}\b", text), name
    assert "default: convergence_out" in text


def test_without_matplotlib_the_cli_names_the_extra_that_brings_it(tmp_path, capsys, monkeypatch):
    """A first run without matplotlib writes its table and json, no png, and says which extra to
    install; that extra of the installed distribution (what pip resolves) brings matplotlib."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code = cli.main(["--steps", "2", "--reduction", "mean", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "llama-fp32-tiny.json").exists()
    assert not list(tmp_path.glob("*.png"))
    extra = re.search(r'pip install "transformers-surgery\[(\w+)\]"', out)
    assert extra, out
    brings = extra_requirements(extra[1])
    assert "matplotlib" in brings, (extra[1], brings)


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
