"""Image-chat training batches for the multimodal models of ``train_step.py`` (Qwen2.5-VL,
Gemma 3): what a processor and an SFT collator would hand the wrapper, built without either.

A conversation is ``BOS USER images prompt ASSISTANT response EOS``, then text turns
``USER prompt ASSISTANT response EOS`` until it has the length asked for; the markers are the
convergence suite's (``surgery.convergence.data``), the text uniform over the ids below the
config's special tokens. Every token up to and including each ``ASSISTANT`` (images included) is
labelled -100; the responses and their ``EOS`` are the targets. Each image is laid out as the
wrapper's processor lays it out (``surgery.convergence.multimodal.image_inputs``):

- Qwen2.5-VL: vision start, ``t * h * w / spatial_merge_size**2`` image tokens, vision end; its
  pixel values as (t * h * w, channels * temporal_patch * patch**2) patch rows with
  ``image_grid_thw``; ``mm_token_type_ids`` 1 at image tokens (transformers computes the 3-D
  rotary positions from them). Images of several grids (``QWEN_GRIDS``).
- Gemma 3: begin of image, ``mm_tokens_per_image`` image tokens, end of image; one
  ``image_size`` square image each (its processor resizes every image); ``token_type_ids`` 1 at
  image tokens, which attend to each other both ways.

Layouts (``make_vlm_batch``):

- ``padded``: one conversation per row holding ``IMAGES_PER_ROW`` images, rows of 100%, 87.5%,
  75%, 62.5%, ... of ``seq`` (as the text rows of ``train_step.make_batch``), right-padded,
  ``attention_mask``;
- ``packed``: each row filled exactly by two to four conversations of ``seq / 4`` to ``seq / 2``
  tokens with one image each, as a padding-free collator lays them out (transformers'
  ``DataCollatorWithFlattening``, TRL's ``padding_free``): no mask, each conversation's first
  label -100, the text positions restarting at every conversation; Qwen's position ids are
  (4, batch, seq), the text row then each conversation's own 3-D rotary positions (the model's
  ``get_rope_index`` on it alone). Gemma 3's images attend both ways through ``token_type_ids``:
  patched, such a row runs each conversation's own mask (``surgery.forwards.multimodal``), unpatched
  transformers' mask of the row;
- ``single``: one conversation of ``seq`` tokens with ``IMAGES_PER_ROW`` images, batch 1.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import import_surgery

import_surgery()  # this checkout's surgery, so that the helpers below are the checkout's too

from surgery.convergence.data import (  # noqa: E402
    ASSISTANT,
    BOS,
    EOS,
    FIRST_CONTENT,
    IGNORE_INDEX,
    USER,
)
from surgery.convergence.minis import mini_multimodal_config  # noqa: E402
from surgery.convergence.multimodal import (  # noqa: E402
    MROPE_WRAPPERS,
    MULTIMODAL,
    ImageDocument,
    collate_multimodal,
    image_inputs,
    image_markers,
    image_recipe,
)

__all__ = [
    "IMAGES_PER_ROW",
    "QWEN_GRIDS",
    "conversation",
    "image_token_id",
    "make_vlm_batch",
]

IMAGES_PER_ROW = 3
# Qwen2.5-VL's (t, h, w) patch grids as its processor gives them (sides in multiples of 28 pixels):
# 448 x 448, 336 x 644, 644 x 336 and 532 x 532 pixels, 256 to 361 image tokens each. The smoke
# models' images are 4 x 4 to 8 x 4 patches of their tiny tower.
QWEN_GRIDS = {
    "full": ((1, 32, 32), (1, 24, 46), (1, 46, 24), (1, 38, 38)),
    "smoke": ((1, 4, 4), (1, 4, 8), (1, 8, 4)),
}


def image_token_id(config) -> int:
    return getattr(
        config, mini_multimodal_config(MULTIMODAL[config.model_type][1]).special_tokens[0]
    )


def _text_vocabulary(config) -> int:
    """Text ids are drawn below the lowest special token of the wrapper's config."""
    special = mini_multimodal_config(MULTIMODAL[config.model_type][1]).special_tokens
    return min(getattr(config, name) for name in special)


def _image_sizes(config, smoke: bool) -> Sequence[tuple[int, ...]]:
    if image_recipe(config).layout == "patch_grid":
        return QWEN_GRIDS["smoke" if smoke else "full"]
    return ((),)  # Gemma 3: one size, the processor resizes


def _split(total: int, parts: int, g: torch.Generator) -> list[int]:
    """``total`` as ``parts`` positive sizes, each within about 25% of the mean."""
    jitter = torch.rand(parts, generator=g) * 0.5 + 0.75
    sizes = [max(1, int(total * float(j) / float(jitter.sum()))) for j in jitter]
    sizes[-1] += total - sum(sizes)
    if sizes[-1] < 1:
        raise ValueError(f"cannot split {total} tokens into {parts} parts")
    return sizes


def conversation(
    config,
    length: int,
    sizes: Sequence[tuple[int, ...]],
    g: torch.Generator,
    *,
    first_phase: int = 0,
    turn_tokens: int = 512,
    rope_model=None,
) -> ImageDocument:
    """One image chat of exactly ``length`` tokens with one image per entry of ``sizes`` (module
    docstring); the images' pixels are patterns of phase ``first_phase``, ``first_phase + 1``, ...
    Text turns hold about ``turn_tokens`` tokens each, a third of them prompt. ``rope_model``: the
    wrapper whose ``model.get_rope_index`` gives the conversation its own multimodal positions
    (for packed rows)."""
    image = image_token_id(config)
    begin, end = image_markers(config)
    vocab = _text_vocabulary(config)
    images = [image_inputs(config, s, phase=float(first_phase + i)) for i, s in enumerate(sizes)]
    head = [BOS, USER]
    for _, n in images:
        head += [begin, *[image] * n, end]
    # The first turn's prompt and response, then text turns: 3 markers each (the first turn's
    # USER is in ``head``, with BOS).
    text = length - len(head) - 2  # the first turn's ASSISTANT and EOS
    turns = max(1, text // (turn_tokens + 3))
    text -= 3 * (turns - 1)
    if text < 2 * turns:
        raise ValueError(f"{len(images)} images and {turns} turns do not fit in {length} tokens")
    ids, labels = list(head), [IGNORE_INDEX] * len(head)
    for i, size in enumerate(_split(text, turns, g)):
        prompt = max(1, min(size - 1, size // 3))
        words = torch.randint(FIRST_CONTENT, vocab, (size,), generator=g).tolist()
        asked = ([] if i == 0 else [USER]) + words[:prompt] + [ASSISTANT]
        answer = [*words[prompt:], EOS]
        ids += asked + answer
        labels += [IGNORE_INDEX] * len(asked) + answer
    assert len(ids) == length, (len(ids), length)
    input_ids = torch.tensor(ids)
    rope = None
    if rope_model is not None:
        rope, _ = rope_model.model.get_rope_index(
            input_ids[None],
            mm_token_type_ids=(input_ids == image).long()[None],
            image_grid_thw=torch.cat([i["image_grid_thw"] for i, _ in images]),
        )
        rope = rope[:, 0]
    return ImageDocument(
        input_ids, torch.tensor(labels), "image-sft", tuple(i for i, _ in images), rope
    )


def _packed_lengths(seq: int, g: torch.Generator) -> list[int]:
    """Conversation lengths of ``seq / 4`` to ``seq / 2`` that add up to ``seq``."""
    lo, hi = seq // 4, seq // 2
    lengths: list[int] = []
    while (rest := seq - sum(lengths)) > hi:
        n = int(torch.randint(lo, hi + 1, (), generator=g))
        lengths.append(min(n, rest - lo))  # leave at least ``lo`` for the last one
    return [*lengths, rest]


def _cat_rows(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows collated one by one (packed, one row each) as one batch: position ids ((4, 1, seq)
    for Qwen, (1, seq) for the others) along their batch dimension, the one before the
    sequence's, every other input along its first."""
    return {
        key: torch.cat([r[key] for r in rows], dim=-2 if key == "position_ids" else 0)
        for key in rows[0]
    }


def make_vlm_batch(
    model, kind: str, batch: int, seq: int, seed: int, *, smoke: bool = False
) -> tuple[dict[str, torch.Tensor], int, dict[str, Any]]:
    """The inputs of one scenario for ``model`` (a Qwen2.5-VL or Gemma 3 wrapper), on the CPU:
    (the wrapper's keyword arguments with ``labels``, the tokens that are not padding, a record of
    what the batch holds: conversations, images, image tokens, vision patches, label tokens).
    Deterministic in ``seed``; ``kind``: ``padded``, ``packed`` or ``single`` (module
    docstring)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    sizes = _image_sizes(config, smoke)
    turn_tokens = max(8, seq // 8)
    # The image grids cycle over the batch, so that neighbouring images differ.
    picks = itertools.count()

    def next_sizes(n: int) -> list[tuple[int, ...]]:
        return [sizes[next(picks) % len(sizes)] for _ in range(n)]

    if kind in ("padded", "single"):
        if kind == "single" and batch != 1:
            raise ValueError("single: batch 1")
        docs = []
        for r in range(batch):
            length = seq - (r % 4) * seq // 8
            docs.append(
                conversation(
                    config,
                    length,
                    next_sizes(IMAGES_PER_ROW),
                    g,
                    first_phase=r * IMAGES_PER_ROW,
                    turn_tokens=turn_tokens,
                )
            )
        data = collate_multimodal(docs, "padded", config)
        if kind == "single":
            del data["attention_mask"]
        conversations = len(docs)
    elif kind == "packed":
        rows, conversations, phase = [], 0, 0
        for _ in range(batch):
            row = []
            for length in _packed_lengths(seq, g):
                row.append(
                    conversation(
                        config,
                        length,
                        next_sizes(1),
                        g,
                        first_phase=phase,
                        turn_tokens=turn_tokens,
                        rope_model=model if config.model_type in MROPE_WRAPPERS else None,
                    )
                )
                phase += 1
            rows.append(collate_multimodal(row, "packed", config))
            conversations += len(row)
        data = _cat_rows(rows)
    else:
        raise ValueError(f"unknown layout {kind!r}")
    assert data["input_ids"].shape == (batch, seq), data["input_ids"].shape
    is_image = data["input_ids"] == image_token_id(config)
    mask = data.get("attention_mask")
    info = {
        "conversations": conversations,
        "images": int(
            data["image_grid_thw"].shape[0]
            if "image_grid_thw" in data
            else data["pixel_values"].shape[0]
        ),
        "image_tokens": int(is_image.sum()),
        "vision_patches": int(
            data["image_grid_thw"].prod(-1).sum()
            if "image_grid_thw" in data
            else data["pixel_values"].shape[0]
            * (config.vision_config.image_size // config.vision_config.patch_size) ** 2
        ),
        "label_tokens": int((data["labels"] != IGNORE_INDEX).sum()),
    }
    real = int(mask.sum()) if mask is not None else batch * seq
    return data, real, info
