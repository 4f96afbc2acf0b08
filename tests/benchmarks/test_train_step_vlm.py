"""The multimodal models of ``benchmarks/train_step.py`` at their smoke sizes: the image-chat
batches of ``benchmarks/vlm_inputs.py`` are laid out as the processors lay them out (image
tokens per image, begin / end of image, token types), prompts and images are masked, packed rows
restart their positions at every conversation, and one fp32 step of ``surgery.patch`` gives
transformers' loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from surgery.convergence.data import ASSISTANT, BOS, IGNORE_INDEX, USER
from surgery.convergence.multimodal import image_markers
from surgery.forwards.multimodal import packed_bidirectional_masks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import train_step
import vlm_inputs

SEQ = train_step.SMOKE_VLM_SEQ
CPU = torch.device("cpu")
CASES = [("qwen2_5_vl", "padded"), ("qwen2_5_vl", "packed"), ("gemma3", "padded"),
         ("gemma3", "packed")]  # fmt: skip
IDS = [f"{name}-{kind}" for name, kind in CASES]


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return train_step.build_model(name, True, CPU, dtype=torch.float32)


def _runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a 1-D bool tensor."""
    edges = torch.diff(flags.int(), prepend=torch.zeros(1, dtype=torch.int32))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (torch.diff(flags.int(), append=torch.zeros(1, dtype=torch.int32)) == -1).nonzero()
    return list(zip(starts, (ends.flatten() + 1).tolist()))


def _conversation_starts(data, row: int) -> list[int]:
    if "position_ids" in data:
        positions = data["position_ids"]
        text = positions[0] if positions.dim() == 3 else positions  # Qwen: the text row first
        return (text[row] == 0).nonzero().flatten().tolist()
    return [0]


@pytest.mark.parametrize(("name", "kind"), CASES, ids=IDS)
def test_image_chat_layout(name, kind):
    model = _model(name)
    config = model.config
    data, real, info = train_step.make_inputs(name, model, kind, 2, SEQ, CPU, 3, smoke=True)
    image = vlm_inputs.image_token_id(config)
    begin, end = image_markers(config)
    ids, labels = data["input_ids"], data["labels"]
    assert ids.shape == labels.shape == (2, SEQ)

    # Every image becomes as many tokens as its processor gives it, between begin and end: Qwen
    # its patch grid over the merge size squared, Gemma 3 mm_tokens_per_image.
    if "image_grid_thw" in data:
        merge = config.vision_config.spatial_merge_size
        expected = [int(grid.prod()) // merge**2 for grid in data["image_grid_thw"]]
    else:
        expected = [config.mm_tokens_per_image] * data["pixel_values"].shape[0]
    runs = [(row, a, b) for row in range(2) for a, b in _runs(ids[row] == image)]
    assert [b - a for _, a, b in runs] == expected
    assert info["images"] == len(expected) and info["image_tokens"] == sum(expected)
    for row, a, b in runs:
        assert ids[row, a - 1] == begin and ids[row, b] == end
    types = data["mm_token_type_ids" if "qwen" in name else "token_type_ids"]
    assert torch.equal(types, (ids == image).long())
    if kind == "padded":
        per_row = [len(_runs(ids[row] == image)) for row in range(2)]
        assert per_row == [vlm_inputs.IMAGES_PER_ROW] * 2
        assert real == int(data["attention_mask"].sum()) < 2 * SEQ

    # Prompts (images, markers) are masked; responses and their EOS are the targets.
    for row in range(2):
        length = int(data["attention_mask"][row].sum()) if "attention_mask" in data else SEQ
        starts = _conversation_starts(data, row)
        assert all(int(ids[row, s]) == BOS for s in starts)
        prompt = False
        for t in range(length):
            token = int(ids[row, t])
            if t in starts or token == USER:
                prompt = True
            if prompt or t in starts:
                assert labels[row, t] == IGNORE_INDEX, (row, t)
            else:
                assert labels[row, t] == token, (row, t)
            if token == ASSISTANT:
                prompt = False
        assert (labels[row, length:] == IGNORE_INDEX).all()
    assert (labels[ids == image] == IGNORE_INDEX).all()
    assert info["label_tokens"] == int((labels != IGNORE_INDEX).sum()) > 0

    if kind == "packed":
        assert "attention_mask" not in data
        assert _conversation_starts(data, 0)[0] == 0 and len(_conversation_starts(data, 1)) >= 2
    if kind == "packed" and "image_grid_thw" in data:
        # Text positions restart at every conversation; each conversation's own 3-D positions
        # start at 0 with it and equal get_rope_index on the conversation alone.
        positions = data["position_ids"]
        assert positions.shape == (4, 2, SEQ)
        grids = iter(data["image_grid_thw"])
        conversations = 0
        for row in range(2):
            starts = _conversation_starts(data, row)
            conversations += len(starts)
            assert len(starts) >= 2
            for a, b in zip(starts, [*starts[1:], SEQ]):
                assert torch.equal(positions[0, row, a:b], torch.arange(b - a))
                doc = ids[row, a:b]
                grid = torch.stack([next(grids) for _ in _runs(doc == image)])
                rope, _ = model.model.get_rope_index(
                    doc[None], mm_token_type_ids=(doc == image).long()[None], image_grid_thw=grid
                )
                assert torch.equal(positions[1:, row, a:b], rope[:, 0])
        assert conversations == info["conversations"]
        assert "attention_mask" not in data


@pytest.mark.parametrize(("name", "kind"), CASES, ids=IDS)
def test_patched_step_matches_unpatched(name, kind):
    """One fp32 forward+backward: the worker's surgery contender against transformers. Packed
    Gemma 3 rows: transformers given each conversation's own masks (its mask of the packed row
    lets tokens see later ones; ``surgery.forwards.multimodal``)."""
    losses = []
    for contender in ("unpatched", "surgery"):
        model = _model(name)
        train_step.apply_contender(model, contender)
        data, _, _ = train_step.make_inputs(name, model, kind, 2, SEQ, CPU, 5, smoke=True)
        if contender == "unpatched" and kind == "packed" and "token_type_ids" in data:
            data["attention_mask"] = packed_bidirectional_masks(
                model.model, data["position_ids"], data["token_type_ids"], torch.float32
            )
        out = model(**data)
        loss = out.loss
        loss.backward()
        assert torch.isfinite(loss)
        # The patched wrapper runs the fused loss: it returns no logits.
        assert (out.logits is None) == (contender == "surgery")
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
