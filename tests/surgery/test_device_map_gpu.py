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


def split_map(arch: str) -> dict[str, str]:
    # A tied head (Gemma) must sit with the embedding it shares its weight with.
    head = "cuda:0" if arch.startswith("gemma") else "cuda:1"
    return {
        "model.embed_tokens": "cuda:0",
        "model.layers.0": "cuda:0",
        "model.layers.1": "cuda:1",
        "model.norm": "cuda:1",
        "model.rotary_emb": "cuda:1",
        "lm_head": head,
    }


@pytest.mark.parametrize("how", ["from_pretrained", "dispatch_model"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_two_gpu_device_map_matches_unpatched(tmp_path, arch, how):
    tiny_model(arch).save_pretrained(tmp_path / "model")
    device_map = split_map(arch)

    def load():
        if how == "from_pretrained":
            model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map)
        else:  # what from_pretrained does after loading: accelerate's own dispatch
            from accelerate import dispatch_model

            model = dispatch_model(tiny_model(arch), device_map=device_map)
        return model.train()

    model, reference = load(), load()
    devices = {p.device for p in model.parameters()}
    where = getattr(model, "hf_device_map", None)
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}, (devices, where)
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
