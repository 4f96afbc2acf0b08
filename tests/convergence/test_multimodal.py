"""The multimodal mode (``surgery.convergence.multimodal``): chat samples with synthetic images,
masked prompts, padded and packed (Qwen-VL with (4, 1, seq) positions); the real patch passes the
same checks as the text models plus the vision tower's own gradients, and a planted bug in the
image features fails them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import surgery
from surgery.convergence.compare import evaluate
from surgery.convergence.configs import SIZES
from surgery.convergence.data import IGNORE_INDEX
from surgery.convergence.multimodal import (
    IMAGE_LAYOUTS,
    MULTIMODAL,
    build_multimodal_model,
    collate_multimodal,
    image_inputs,
    multimodal_batches,
)
from surgery.convergence.train import RunConfig, Variant, train_and_compare
from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS
from tests.utils import expect_transformers_failure


def _failed(record):
    return sorted(
        f"{c.side}:{c.name} {c.value:.2e} > {c.limit:.2e}" for c in evaluate(record) if not c.passed
    )


def test_image_chats_are_masked_and_collated():
    model = build_multimodal_model("qwen2_5_vl")
    train, _ = multimodal_batches(model, "tiny", 2)
    image = model.config.image_token_id
    docs = train[0]
    for d in docs:
        assert d.images and d.rope is not None and d.rope.shape == (3, len(d))
        # Images sit inside the prompt: every image token is masked.
        assert (d.labels[d.input_ids == image] == IGNORE_INDEX).all()
        assert (d.labels != IGNORE_INDEX).any()
    sizes = {tuple(i["image_grid_thw"][0].tolist()) for b in train for d in b for i in d.images}
    assert len(sizes) > 1  # several image sizes
    packed = collate_multimodal(docs, "packed", model.config)
    assert packed["position_ids"].shape == (4, 1, sum(len(d) for d in docs))
    assert (packed["position_ids"][0] == 0).sum() == len(docs)  # the text row restarts
    padded = collate_multimodal(docs, "padded", model.config)
    assert torch.equal(padded["mm_token_type_ids"], (padded["input_ids"] == image).long())
    gemma = build_multimodal_model("gemma3")
    docs = multimodal_batches(gemma, "tiny", 1)[0][0]
    packed = collate_multimodal(docs, "packed", gemma.config)
    assert packed["position_ids"].shape == (1, sum(len(d) for d in docs))  # text positions
    assert (packed["position_ids"] == 0).sum() == len(docs)


def test_every_wrapper_of_the_registry_is_trained_and_one_without_image_inputs_fails():
    """The mode trains every wrapper the registry holds (the tests below are parametrised over
    it), and a wrapper it has no image inputs for stops with its name, not silently left out."""
    wrappers = {w.name for spec in (*SPECS, *MULTIMODAL_ONLY_SPECS) for w in spec.multimodal}
    assert set(MULTIMODAL) == wrappers
    new = SimpleNamespace(model_type="new_vlm", vision_config=SimpleNamespace())
    with pytest.raises(NotImplementedError, match="new_vlm wrapper"):
        image_inputs(new, (1, 4, 4), phase=0.0)


@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_every_wrapper_spec_says_how_its_images_are_laid_out(name, monkeypatch):
    """The image inputs come from the wrapper's spec (``MultimodalWrapper.images``): a layout
    the suite builds, sizes for every mini size or none (the layout's one size); a spec whose
    layout has no builder stops with its name and the layout's."""
    spec, wrapper = MULTIMODAL[name]
    recipe = wrapper.images
    assert recipe.layout in IMAGE_LAYOUTS
    assert set(recipe.sizes) in (set(), set(SIZES))
    config = build_multimodal_model(name).config
    inputs, tokens = image_inputs(config, recipe.sizes.get("tiny", ((),))[0], phase=0.0)
    assert tokens > 0 and inputs["pixel_values"].numel() > 0
    odd = dataclasses.replace(wrapper, images=dataclasses.replace(recipe, layout="hexagons"))
    monkeypatch.setitem(MULTIMODAL, name, (spec, odd))
    with pytest.raises(NotImplementedError, match=f"{name} wrapper's image layout 'hexagons'"):
        image_inputs(config, (1, 4, 4), phase=0.0)


@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_every_wrapper_packs_its_conversations(name):
    """Every wrapper trains packed rows (the CLI's default layouts): one row holding each
    conversation whole, its text positions restarting at 0, its images' inputs all there, and
    the Qwen-VL family's rows carrying each conversation's own 3-D positions."""
    model = build_multimodal_model(name)
    docs = multimodal_batches(model, "tiny", 1)[0][0]
    assert len(docs) > 1
    packed = collate_multimodal(docs, "packed", model.config)
    padded = collate_multimodal(docs, "padded", model.config)
    lengths = [len(d) for d in docs]
    assert packed["input_ids"].shape == (1, sum(lengths))
    assert torch.equal(packed["input_ids"][0], torch.cat([d.input_ids for d in docs]))
    positions = packed["position_ids"]
    text = positions[0] if positions.dim() == 3 else positions  # Qwen-VL: the text row first
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    assert text.shape == (1, sum(lengths)) and (text[0, starts] == 0).all()
    assert int((text == 0).sum()) == len(docs)
    real = padded["attention_mask"].bool()
    for key in ("mm_token_type_ids", "token_type_ids"):  # per token: the padded batch's tokens
        if key in padded:
            assert torch.equal(packed[key][0], padded[key][real]), key
    images = set(padded) - {"input_ids", "labels", "position_ids", "attention_mask",
                            "mm_token_type_ids", "token_type_ids"}  # fmt: skip
    assert images and all(torch.equal(packed[k], padded[k]) for k in images)
    if positions.dim() == 3:  # (4, 1, seq): each conversation's own rope index
        assert torch.equal(positions[1:, 0], torch.cat([d.rope for d in docs], -1))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_every_wrapper_trains_like_original(name, dtype, request):
    """Every wrapper, tiny, fp32 and bf16, one step padded and packed (Qwen-VL rows with their
    multimodal positions), the per-sequence mean with z-loss, against the padded unpatched run:
    every check passes, the vision tower's and projector's gradients among them. Packed Gemma 3
    with transformers' own mask of the packed row instead of surgery's per-conversation masks
    (``packed_bidirectional_masks``) fails here: step-0 gradients 0.26 off, the final eval
    logits 0.40."""
    expect_transformers_failure(request, MULTIMODAL[name][1].wrapper_class())
    cfg = RunConfig(model=name, steps=1, dtype=dtype, variant=Variant("sequence", 1e-2),
                    multimodal=True)  # fmt: skip
    record = train_and_compare(cfg)
    assert not _failed(record)
    assert record["vision_parameters"] > 0
    names = {c.name for c in evaluate(record)}
    assert {"vision_grad@0", "vision_grad@0:accuracy", "probe_vision_grad", "eval_logits"} <= names


def _scale_image_features(model, **options):
    """The real patch, plus a bug: the projected image features 1% too large."""
    surgery.patch(model, **options)
    model.model.multi_modal_projector.register_forward_hook(lambda module, args, out: out * 1.01)
    return model


def test_planted_image_feature_bug_is_caught():
    """Gemma 3, padded: the image features 1% off fail the vision tower's own gradient check
    (the bug-free patch passes the same run in ``python -m surgery.convergence --multimodal``)."""
    cfg = RunConfig(model="gemma3", steps=1, layouts=("padded",), multimodal=True)
    failed = _failed(train_and_compare(cfg, patch=_scale_image_features))
    assert any(f.startswith("patched-padded:vision_grad@0") for f in failed), failed
    assert any(f.startswith("patched-padded:eval_") for f in failed), failed


def _text_row_rope(model, **options):
    """The real patch, plus a bug: the language model's attention rotates every token with the
    text row of packed (4, 1, seq) position ids in all three sections (temporal, height, width),
    image tokens included, instead of their multimodal positions."""
    surgery.patch(model, **options)

    def hook(module, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is not None and positions.dim() == 3 and positions.shape[0] == 4:
            kwargs["position_ids"] = positions[:1].expand(4, -1, -1)
        return args, kwargs

    model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def test_planted_text_row_rope_bug_is_caught():
    """Qwen2.5-VL, packed: image tokens rotated by their text positions fail the packed side's
    gradient, eval and probe checks against the padded reference (the bug-free patch passes the
    same run, above). The step-0 loss moves by less than its 1e-5 limit (images and prompts are
    masked): the gradients are what catch it."""
    cfg = RunConfig(model="qwen2_5_vl", steps=1, variant=Variant("sequence", 1e-2),
                    layouts=("packed",), multimodal=True)  # fmt: skip
    failed = _failed(train_and_compare(cfg, patch=_text_row_rope))
    for check in ("grad@0", "vision_grad@0", "eval_logits", "probe_grad", "probe_vision_grad"):
        assert any(f.startswith(f"patched-packed:{check} ") for f in failed), (check, failed)
