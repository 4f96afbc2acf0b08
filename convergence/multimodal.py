"""The multimodal mode (``--multimodal``): mini multimodal wrappers (``...ForConditionalGeneration``
of the registry, ``ArchitectureSpec.multimodal``) and chat-like samples with images, for the same
train-and-compare loop as the text models (``train``).

A model is named by its wrapper's ``model_type`` (``qwen2_5_vl``, ``gemma3``, ``mistral3``,
``gemma4``, ``llama4``, ``qwen3_vl_moe``, ...; every wrapper of the registry): the
text model is the spec's mini config at the run's size inside the wrapper's mini config
(``minis.MINI_MULTIMODAL_CONFIGS``: a tiny vision tower, the special tokens at the end of the
vocabulary).

Samples are SFT dialogues whose first user turn holds one or two images:
``BOS USER [begin] IMAGE x n [end] prompt ASSISTANT response EOS`` and maybe more text turns. The
image placeholder is expanded to as many tokens as the wrapper's processor would give the image
(Qwen: its patch grid over the merge size squared, between vision start and end tokens; Gemma 3:
``mm_tokens_per_image`` between begin and end of image; Mistral 3: the merged Pixtral patches;
Gemma 4: its patch grid pooled k x k, every image's patches padded to one budget at position
(-1, -1); Llama 4: one tile's pixel-shuffled patches).
The prompt, images included, is masked (-100); the response starts with a token naming which
pixel pattern the image shows (so the loss needs the vision tower), then the prompt reversed and
permuted, as the text dialogues (``data``). Pixel values are deterministic patterns
(:func:`pattern`) in several sizes where the family takes several (Qwen's grids, Pixtral's image
sizes, Gemma 4's patch grids; Gemma 3's and Llama 4's processors resize every image to one
size). The MoE wrappers (Qwen3-VL-MoE, Qwen3.5-MoE) train the router aux loss their forward
computes from the text config, every side asked for it (``output_router_logits``), with router
replay, as the text mixtures (``train``).

Layouts: padded and packed (one row, text positions restarting at each conversation) for every
family. The Qwen-VL family's packed rows carry transformers' (4, batch, seq) position ids (the text
row, then each document's ``get_rope_index``); the others take 2-D ones. Gemma 3's images (and
Gemma 4's, where its text config says "vision") attend both ways through their token types; a
packed row of them runs surgery's per-conversation masks (``surgery.forwards.multimodal``), which
transformers' mask of the packed row is not: the unpatched reference is always the padded one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS, ArchitectureSpec, MultimodalWrapper
from surgery.models.spec import MiniImages

from .configs import SIZES, Size, condition_attention
from .data import ASSISTANT, BOS, EOS, FIRST_CONTENT, IGNORE_INDEX, USER, Document, SyntheticCorpus
from .data import collate as collate_text
from .minis import mini_config, mini_multimodal_config

__all__ = [
    "IMAGE_LAYOUTS",
    "MROPE_WRAPPERS",
    "MULTIMODAL",
    "ImageDocument",
    "build_multimodal_model",
    "collate_multimodal",
    "image_inputs",
    "image_markers",
    "image_recipe",
    "make_multimodal_config",
    "multimodal_batches",
    "pattern",
    "vision_parameters",
]

# Every wrapper of the registry, by its model_type: (text spec, wrapper). Each needs image inputs
# (``image_inputs``); one without them fails there, and the tests (parametrised over this table)
# fail with it. The MoE ones (Qwen3-VL-MoE, Qwen3.5-MoE) train the router aux loss the wrapper
# computes from its text config, with router replay, as the text mixtures do (``train``).
MULTIMODAL: dict[str, tuple[ArchitectureSpec, MultimodalWrapper]] = {
    wrapper.name: (spec, wrapper)
    for spec in (*SPECS, *MULTIMODAL_ONLY_SPECS)
    for wrapper in spec.multimodal
}
# The wrappers whose packed rows carry 3-D rotary positions (the text row, then each
# conversation's get_rope_index).
MROPE_WRAPPERS = frozenset(name for name, (spec, _) in MULTIMODAL.items() if spec.mrope)

# How many pixel patterns there are (the response's first token names one).
PATTERNS = 8


def pattern(*shape: int, phase: float) -> torch.Tensor:
    """Deterministic pixel values in [0, 1): crossed sine waves, one phase per pattern."""
    index = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    return 0.5 + 0.5 * torch.sin(0.37 * index + phase) * torch.cos(0.11 * index)


def image_recipe(config: transformers.PretrainedConfig) -> MiniImages:
    """How ``config``'s wrapper lays out an image (``MultimodalWrapper.images``); a wrapper
    without one, or with a layout that has no builder here, stops with its name."""
    entry = MULTIMODAL.get(config.model_type)
    recipe = None if entry is None else entry[1].images
    if recipe is None:
        raise NotImplementedError(
            f"the convergence suite has no image inputs for the {config.model_type} wrapper of the "
            "registry: give its MultimodalWrapper images, a MiniImages (models/<family>.py)"
        )
    if recipe.layout not in IMAGE_LAYOUTS:
        raise NotImplementedError(
            f"the {config.model_type} wrapper's image layout {recipe.layout!r} has no builder: "
            "add one to surgery.convergence.multimodal.IMAGE_LAYOUTS"
        )
    return recipe


def image_markers(config: transformers.PretrainedConfig) -> tuple[int, int] | None:
    """The ids of the tokens that open and close an image's tokens in ``config``'s wrapper
    (Qwen: vision start / end), or None where its processor puts none around them (Mistral 3)."""
    names = image_recipe(config).around
    return None if names is None else tuple(getattr(config, name) for name in names)


def image_inputs(config: transformers.PretrainedConfig, size: Sequence[int], phase: float):
    """One image of pattern ``phase`` at ``size`` as ``config``'s processor gives it: (the image's
    inputs, each with a leading image or patch dimension, how many tokens it becomes)."""
    recipe = image_recipe(config)
    return IMAGE_LAYOUTS[recipe.layout](config, recipe, tuple(size), phase)


def _patch_grid(config, recipe: MiniImages, size, phase):
    # (t, h, w) patches of t_patch x p x p x channels pixels, merged spatial_merge_size^2.
    vision = config.vision_config
    t, h, w = size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size
    inputs = {
        "pixel_values": pattern(t * h * w, width, phase=phase),
        "image_grid_thw": torch.tensor([list(size)]),
    }
    return inputs, t * h * w // merge**2


def _pixels(config, recipe: MiniImages, size, phase):
    # (height, width) pixels; patches merged spatial_merge_size^2.
    vision = config.vision_config
    h, w = size
    merge = vision.patch_size * config.spatial_merge_size
    pixels = pattern(1, vision.num_channels, h, w, phase=phase)
    return {"pixel_values": pixels, "image_sizes": torch.tensor([[h, w]])}, (h // merge) * (
        w // merge
    )


def _square(config, recipe: MiniImages, size, phase):
    # One size: the processor resizes.
    side = config.vision_config.image_size
    pixels = pattern(1, config.vision_config.num_channels, side, side, phase=phase)
    return {"pixel_values": pixels}, config.mm_tokens_per_image


def _shuffled_tile(config, recipe: MiniImages, size, phase):
    # One tile (the processor resizes); its patches pixel-shuffled.
    vision = config.vision_config
    side = vision.image_size
    pixels = pattern(1, vision.num_channels, side, side, phase=phase)
    tokens = (side // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2
    return {"pixel_values": pixels}, int(tokens)


def _positioned_patches(config, recipe: MiniImages, size, phase):
    # (h, w) patches at their (x, y) positions, padded to the budget at (-1, -1), pooled k x k.
    vision = config.vision_config
    h, w = size
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    positions = torch.stack([x, y], -1).reshape(h * w, 2)
    pad = recipe.patch_budget - h * w
    positions = F.pad(positions, (0, 0, 0, pad), value=-1)
    pixels = F.pad(pattern(h * w, 3 * vision.patch_size**2, phase=phase), (0, 0, 0, pad))
    k = vision.pooling_kernel_size
    return {"pixel_values": pixels[None], "image_position_ids": positions[None]}, (
        (h // k) * (w // k)
    )


# The processors' image layouts (``MiniImages.layout``), each (config, recipe, size, phase) ->
# (the image's inputs, how many tokens it becomes).
IMAGE_LAYOUTS = {
    "patch_grid": _patch_grid,
    "pixels": _pixels,
    "square": _square,
    "shuffled_tile": _shuffled_tile,
    "positioned_patches": _positioned_patches,
}


@dataclass(frozen=True)
class ImageDocument(Document):
    """A ``Document`` with its images' inputs (``image_inputs``, in order) and, in the Qwen-VL
    family, its own (3, len) multimodal rotary positions."""

    images: tuple[dict[str, torch.Tensor], ...] = ()
    rope: torch.Tensor | None = None


def make_multimodal_config(
    name: str, size: str | Size = "tiny", *, attention: str = "sdpa"
) -> transformers.PretrainedConfig:
    """The config of ``name``'s (a wrapper's model_type) mini model at ``size``."""
    if name not in MULTIMODAL:
        raise ValueError(f"unknown multimodal model {name!r}; expected one of {sorted(MULTIMODAL)}")
    spec, wrapper = MULTIMODAL[name]
    s = SIZES[size] if isinstance(size, str) else size
    text_mini, mini = mini_config(spec), mini_multimodal_config(wrapper)
    text = text_mini.build(
        s,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **mini.text_arguments,
    )
    rope = getattr(text, "rope_parameters", None) or {}
    if "mrope_section" in rope:
        # The mini sections (2, 1, 1) are sized for the tests' 4 rotary frequencies: scaled in
        # proportion to the run's rotary width, as transformers needs them to add up to it.
        rotary = int(s.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        section = rope["mrope_section"]
        if sum(section) != rotary and rotary % sum(section) == 0:
            scale = rotary // sum(section)
            text.rope_parameters = {**rope, "mrope_section": [scale * x for x in section]}
    config = mini.build(text)
    config._attn_implementation = text_mini.attention(attention)
    return config


def build_multimodal_model(
    name: str, size: str | Size = "tiny", *, seed: int = 0
) -> transformers.PreTrainedModel:
    """A freshly initialised fp32 CPU mini wrapper; the same ``seed`` gives the same weights."""
    wrapper = MULTIMODAL[name][1]
    config = make_multimodal_config(name, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = wrapper.wrapper_class()._from_config(
            config, attn_implementation=config._attn_implementation
        )
    condition_attention(model)
    return model.train()


def vision_parameters(model: torch.nn.Module, name: str) -> list[str]:
    """The names of ``model``'s parameters outside its language model and lm_head: the vision
    tower's and the projector's."""
    _, wrapper = MULTIMODAL[name]
    text = wrapper.language_model + "."
    return [n for n, _ in model.named_parameters() if not n.startswith((text, "lm_head."))]


class _Corpus(SyntheticCorpus):
    """Chat samples with images over the text vocabulary of a wrapper's config."""

    def __init__(self, config, size: str, seed: int, rope_model=None):
        self.config = config
        mini = mini_multimodal_config(MULTIMODAL[config.model_type][1])
        self.text_vocab = mini.text_vocabulary(config.text_config)
        super().__init__(self.text_vocab, seed)
        recipe = image_recipe(config)
        self.sizes = recipe.sizes[size] if recipe.sizes else ((),)  # none: the layout's one size
        self.image_token = getattr(config, mini.special_tokens[0])
        self.around = image_markers(config)
        self.rope_model = rope_model

    def image_chat(self, max_prompt: int, g: torch.Generator) -> ImageDocument:
        images, ids = [], [BOS, USER]
        classes = []
        for _ in range(int(torch.randint(1, 3, (), generator=g))):
            kind = int(torch.randint(0, PATTERNS, (), generator=g))
            size = self.sizes[int(torch.randint(0, len(self.sizes), (), generator=g))]
            inputs, n = image_inputs(self.config, size, phase=float(kind))
            images.append(inputs)
            classes.append(FIRST_CONTENT + kind)
            tokens = [self.image_token] * n
            ids += [self.around[0], *tokens, self.around[1]] if self.around else tokens
        prompt = self._markov(int(torch.randint(2, max_prompt + 1, (), generator=g)), g)
        response = classes + [
            int(self._permutation[t - FIRST_CONTENT]) + FIRST_CONTENT for t in reversed(prompt)
        ]
        ids += [*prompt, ASSISTANT]
        labels = [IGNORE_INDEX] * len(ids) + response + [EOS]
        ids += [*response, EOS]
        if float(torch.rand((), generator=g)) < 0.5:  # a text turn after the image turn
            follow = self._markov(int(torch.randint(2, max_prompt + 1, (), generator=g)), g)
            answer = [int(self._permutation[t - FIRST_CONTENT]) + FIRST_CONTENT for t in follow]
            masked = [USER, *follow, ASSISTANT]
            ids += masked + answer + [EOS]
            labels += [IGNORE_INDEX] * len(masked) + answer + [EOS]
        input_ids = torch.tensor(ids)
        rope = None
        if self.rope_model is not None:
            rope, _ = self.rope_model.model.get_rope_index(
                input_ids[None],
                mm_token_type_ids=(input_ids == self.image_token).long()[None],
                image_grid_thw=torch.cat([i["image_grid_thw"] for i in images]),
            )
            rope = rope[:, 0]
        return ImageDocument(input_ids, torch.tensor(labels), "image-sft", tuple(images), rope)


def multimodal_batches(
    model: transformers.PreTrainedModel, size: str, steps: int, *, seed: int = 0
) -> tuple[list[list[ImageDocument]], list[ImageDocument]]:
    """``steps`` training batches of image chats and one eval batch for ``model`` (a wrapper of
    ``MULTIMODAL``), deterministic in ``seed``; the Qwen-VL family's documents carry their
    multimodal positions."""
    s = SIZES[size]
    mrope = model.config.model_type in MROPE_WRAPPERS
    corpus = _Corpus(model.config, size, seed, model if mrope else None)
    g = torch.Generator().manual_seed(seed + 1)
    max_prompt = max(2, s.max_doc_len // 4)

    def batch():
        return [corpus.image_chat(max_prompt, g) for _ in range(s.docs_per_step)]

    train = [batch() for _ in range(steps)]
    return train, batch()


def _cat_images(images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The images' inputs of one batch, in order; pixel values zero-padded to the largest image
    (Pixtral's processor does so; ``image_sizes`` says what is real)."""
    out = {}
    for key in images[0]:
        parts = [i[key] for i in images]
        if key == "pixel_values" and parts[0].dim() == 4:
            h = max(p.shape[-2] for p in parts)
            w = max(p.shape[-1] for p in parts)
            parts = [F.pad(p, (0, w - p.shape[-1], 0, h - p.shape[-2])) for p in parts]
        out[key] = torch.cat(parts)
    return out


def collate_multimodal(
    docs: Sequence[ImageDocument], layout: str, config: transformers.PretrainedConfig
) -> dict[str, Any]:
    """``docs`` collated as the text documents are (``data.collate``), with their images' inputs
    and the token types the wrapper reads (Qwen's ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``: 1 at image tokens); the Qwen-VL family's packed rows get (4, 1, seq)
    position ids, the text row first."""
    model_type = config.model_type
    batch = collate_text(docs, layout)
    wrapper = MULTIMODAL[model_type][1]
    batch.update(_cat_images([i for d in docs for i in d.images]))
    image_token = getattr(config, mini_multimodal_config(wrapper).special_tokens[0])
    is_image = batch["input_ids"] == image_token
    token_types = wrapper.images.token_types
    if token_types is not None:
        batch[token_types] = is_image.long()
    if wrapper.bidirectional_tokens is not None:
        batch[wrapper.bidirectional_tokens] = is_image.long()
    if layout == "packed" and model_type in MROPE_WRAPPERS:
        rope = torch.cat([d.rope for d in docs], dim=-1)
        batch["position_ids"] = torch.cat([batch["position_ids"][None], rope[:, None]])
    return batch
