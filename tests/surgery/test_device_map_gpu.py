"""``from_pretrained(..., device_map=...)`` across two GPUs (skipped with fewer): the model is split
over the devices by accelerate's hooks, which move activations between them; the patched forwards
run inside those hooks. Loss and every gradient equal the unpatched model's with the same map."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import surgery
from tests.models.tiny import (
    assert_grads_close,
    loss_and_grads,
    padded_batch,
    sequences,
    tiny_model,
)
from tests.utils import TOLERANCES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TOL = {k: TOLERANCES[torch.float32][k] for k in ("rtol", "atol")}


def split_map(arch: str) -> dict[str, int]:
    # A tied head (Gemma) must sit with the embedding it shares its weight with.
    head = 0 if arch.startswith("gemma") else 1
    return {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "model.rotary_emb": 1,
        "lm_head": head,
    }


@pytest.mark.parametrize("device_map", ["split", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_two_gpu_device_map_matches_unpatched(tmp_path, arch, device_map):
    tiny_model(arch).save_pretrained(tmp_path / "model")

    def load():
        kwargs = {"device_map": split_map(arch)}
        if device_map == "auto":  # small budgets so that "auto" really splits the tiny model
            kwargs = {"device_map": "auto", "max_memory": {0: "40KiB", 1: "10GiB"}}
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", **kwargs).train()

    model, reference = load(), load()
    devices = {p.device for p in model.parameters()}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}, devices
    surgery.patch(model)
    batch = padded_batch(sequences([37, 20, 9])).to("cuda:0")

    want_loss, want_grads = loss_and_grads(reference, **batch.kwargs())
    loss, grads = loss_and_grads(model, **batch.kwargs())
    assert model.lm_head._hf_hook is not None
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)

    surgery.unpatch(model)
    unpatched_loss, _ = loss_and_grads(model, **batch.kwargs())
    torch.testing.assert_close(unpatched_loss, want_loss, rtol=0, atol=0)
