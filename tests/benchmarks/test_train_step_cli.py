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


def test_every_input_structure_is_a_scenario():
    """Issue 33's input structures: each kind parses, and each batch holds what its name says
    (a tiny one, on CPU)."""
    assert train_step.parse_scenarios("plain2,ones1,prompts2,leftpadded4,packedcu2") == [
        ("plain", 2), ("ones", 1), ("prompts", 2), ("leftpadded", 4), ("packedcu", 2),
    ]  # fmt: skip
    cpu = torch.device("cpu")
    batches = {kind: train_step.make_batch(kind, 4, 32, 101, cpu, 0) for kind in train_step.KINDS}
    assert set(batches["plain"][0]) == {"input_ids", "labels"} and batches["plain"][1] == 128
    assert (batches["plain"][0]["labels"] != -100).all()
    ones = batches["ones"][0]
    assert ones["attention_mask"].all() and torch.equal(ones["labels"], ones["input_ids"])
    assert (batches["prompts"][0]["labels"][:, :8] == -100).all()
    assert (batches["prompts"][0]["labels"][:, 8:] != -100).all()
    left, right = batches["leftpadded"][0]["attention_mask"], batches["padded"][0]["attention_mask"]
    assert torch.equal(left, right.flip(1)) and batches["leftpadded"][1] == int(right.sum())
    packed, cu = batches["packed"][0], batches["packedcu"][0]
    assert torch.equal(packed["position_ids"], cu["position_ids"])
    starts = (cu["position_ids"].flatten() == 0).nonzero().flatten().tolist()
    assert (
        cu["cu_seq_lens_q"].tolist() == [*starts, 128]
        and cu["cu_seq_lens_q"] is cu["cu_seq_lens_k"]
    )
    assert cu["max_length_q"] == max(torch.tensor([*starts, 128]).diff().tolist())


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
