"""Multimodal wrappers split over two GPUs by accelerate (``dispatch_model`` with the keys the
model keeps in place, what ``from_pretrained(device_map=...)`` does after loading): the vision
tower, the embeddings and the
first half of the text layers on ``cuda:0``, the other half, the final norm and an untied head on
``cuda:1``, the inputs moved by accelerate's top-level hook to ``cuda:1`` (the device the
embeddings are not on). Patched, the loss and every gradient equal the unpatched wrapper's on one
GPU, right-padded rows with images and, for Qwen's 3-D positions, packed documents."""

from __future__ import annotations

import copy

import pytest
import torch

import surgery
from surgery.forwards.multimodal import language_model

from .test_multimodal import (
    PAIRS,
    WRAPPERS,
    assert_same_step,
    image_batch,
    packed_image_row,
    step,
    tiny_vlm,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(autouse=True)
def fp32_without_tf32(monkeypatch):
    """fp32 products and convolutions in fp32: cuDNN takes TF32 for convolutions by default, and
    the vision tower's patch convolution then put a weight gradient 2.3e-5 (relative) from the
    one-GPU reference's (Qwen3-VL, H200 x2), over fp32's budget; with TF32 off it is within."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# The hybrid wrappers' text layers need flash-linear-attention on a GPU (the fla stage).
HYBRID = ("qwen3_5", "qwen3_5_moe")
CASES = [p for p in WRAPPERS if PAIRS[p][1].model_type not in HYBRID]
PACKED = ("qwen2_vl_text-qwen2_vl", "qwen3_vl_text-qwen3_vl")


def _path(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def split_map(model, wrapper) -> dict[str, str]:
    """Every top-level part on ``cuda:0`` but the text model's second half of layers, its final
    norm and rotary module, and the head unless it is tied to the embeddings."""
    text = language_model(model, wrapper)
    core = text if hasattr(text, "layers") else text.model  # Llama 4: a causal LM inside
    core_path, head = _path(model, core), model.get_output_embeddings()
    tied = head.weight is core.get_input_embeddings().weight
    head_path, half = _path(model, head), len(core.layers) // 2
    device_map = {}

    def visit(path: str, module) -> None:
        if path == core_path:
            for name, child in module.named_children():
                if name == "layers":
                    for i in range(len(child)):
                        device_map[f"{path}.layers.{i}"] = "cuda:0" if i < half else "cuda:1"
                else:
                    device_map[f"{path}.{name}"] = (
                        "cuda:1" if name in ("norm", "rotary_emb") else "cuda:0"
                    )
        elif path == head_path:
            device_map[path] = "cuda:0" if tied else "cuda:1"
        elif path == "" or any(p.startswith(f"{path}.") for p in (core_path, head_path)):
            assert not list(module.parameters(recurse=False)), path
            for name, child in module.named_children():
                visit(f"{path}.{name}" if path else name, child)
        else:
            device_map[path] = "cuda:0"

    visit("", model)
    return device_map


@pytest.mark.parametrize("pair", CASES)
def test_wrapper_over_two_gpus_matches_unpatched_on_one(pair):
    from accelerate import dispatch_model

    spec, wrapper = PAIRS[pair]
    model = tiny_vlm(spec, wrapper)
    reference = copy.deepcopy(model).to("cuda:0")
    device_map = split_map(model, wrapper)
    # from_pretrained's own call: the inputs a model keeps where they are (Gemma 4's
    # shared_kv_states, which its layers fill and read, must not be copied by the hooks).
    skip_keys = list(model._skip_keys_device_placement or [])
    model = dispatch_model(model, device_map, main_device="cuda:1", skip_keys=skip_keys)
    assert {p.device.index for p in model.parameters()} == {0, 1}
    surgery.patch(model)
    batches = [image_batch(model, wrapper)]
    if pair in PACKED:
        batches.append(packed_image_row(model, wrapper))
    for batch in batches:
        batch = {k: v.to("cuda:0") for k, v in batch.items()}
        out, grads = step(model, batch)
        out.loss = out.loss.to("cuda:0")
        got = (out, {name: g.to("cuda:0") for name, g in grads.items()})
        assert_same_step(got, step(reference, {**batch, "use_cache": False}))
