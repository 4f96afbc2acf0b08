"""``benchmarks/train_step.py``'s command line: ``--scenarios`` takes any batch of either layout
(the hybrid's unpatched step fits the H100 at batch 1 only) and refuses anything else; each
surgery contender patches with its own options."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import train_step


def test_scenarios_take_any_batch_of_either_layout():
    assert train_step.parse_scenarios("padded1,packed1,padded8") == [
        ("padded", 1),
        ("packed", 1),
        ("padded", 8),
    ]


def test_quick_drops_batch_4_from_the_defaults_only():
    asked = train_step.parse_scenarios("padded4,packed2")
    assert train_step.scenarios_to_run(asked, quick=True) == [("padded", 4), ("packed", 2)]
    assert ("padded", 4) not in train_step.scenarios_to_run(None, quick=True)
    assert train_step.scenarios_to_run(None, quick=False) == train_step.SCENARIOS


@pytest.mark.parametrize("text", ["padded", "packed0", "varlen2", "padded2,", "padded-1"])
def test_scenarios_refuse_what_is_not_a_layout_and_a_batch(text):
    with pytest.raises(argparse.ArgumentTypeError):
        train_step.parse_scenarios(text)


@pytest.mark.parametrize(
    ("contender", "options"),
    [
        ("surgery", {}),
        ("surgery_masked", {"causal_right_padding": False}),
        ("surgery_every_token", {"loss_skip_ignored": False}),
        ("surgery_inductor_norm", {"rms_norm": False}),
        ("surgery_inductor_mlp", {"gated_mlp": False}),
        ("surgery_no_recompute", {"recompute_mlp_product": False, "recompute_norm_output": False}),
    ],
)
def test_surgery_contenders_patch_with_their_options(contender, options):
    import surgery

    model = train_step.build_model("llama", True, torch.device("cpu"), dtype=torch.float32)
    train_step.apply_contender(model, contender)
    assert surgery.patch_options(model) == surgery.PatchOptions(**options)
