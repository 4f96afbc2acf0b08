"""``surgery.forwards.layers.projections``: the layers that share an input (the attention's q/k/v,
the MLP's gate/up) run through ``shared_input_linear`` where they are plain ``nn.Linear`` modules,
and are called as modules everywhere else (hooks, adapters, autocast, no gradient).

The kernel's own values are tested in tests/kernels/test_shared_input_linear.py; here: which path
a patched model takes, and that its loss and gradients are those of the model called module by
module.
"""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.forwards import layers
from tests.models.tiny import (
    assert_grads_close,
    loss_and_grads,
    padded_batch,
    sequences,
    tiny_model,
)
from tests.utils import FP32_CLOSE

LENGTHS = [7, 5, 3]


@pytest.fixture
def calls(monkeypatch):
    """The weights of each ``shared_input_linear`` call, in order."""
    seen: list[list[torch.Tensor]] = []
    original = layers.shared_input_linear

    def spy(x, weights, biases=None):
        seen.append(list(weights))
        return original(x, weights, biases)

    monkeypatch.setattr(layers, "shared_input_linear", spy)
    return seen


def batch():
    return padded_batch(sequences(LENGTHS)).kwargs()


def expected(model, skip=()):
    """The weight groups a forward of ``model`` passes, layer by layer: q/k/v then gate/up."""
    groups = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if ("attn", i) not in skip:
            groups.append([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        if ("mlp", i) not in skip:
            groups.append([mlp.gate_proj.weight, mlp.up_proj.weight])
    return groups


def same(got, want) -> bool:
    return len(got) == len(want) and all(
        len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(got, want)
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_plain_projections_share_the_input(arch, calls):
    model = surgery.patch(tiny_model(arch).train())
    model(**batch()).loss.backward()
    assert same(calls, expected(model))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loss_and_gradients_are_the_module_by_module_ones(arch, monkeypatch):
    model = surgery.patch(tiny_model(arch).train())
    loss, grads = loss_and_grads(model, **batch())
    monkeypatch.setattr(layers, "shared_input_linear", None)  # any call would fail
    monkeypatch.setattr(layers, "plain_linear", lambda m, bias=False: False)
    ref_loss, ref_grads = loss_and_grads(model, **batch())
    torch.testing.assert_close(loss, ref_loss, **FP32_CLOSE)
    assert_grads_close(grads, ref_grads, **FP32_CLOSE)


def test_a_hooked_projection_is_called_as_a_module(calls):
    """A forward hook on one q_proj: that layer's q/k/v are called one by one (the hook runs);
    its MLP and the other layers still share their input."""
    model = surgery.patch(tiny_model("llama").train())
    hooked = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: hooked.append(1))
    model(**batch()).loss.backward()
    assert hooked == [1]
    assert same(calls, expected(model, skip={("attn", 0)}))


def test_lora_projections_are_called_as_modules(calls):
    peft = pytest.importorskip("peft")
    model = surgery.patch(tiny_model("llama").train())
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "up_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    model(**batch()).loss.backward()
    inner = model.get_base_model()
    skip = {(kind, i) for i in range(len(inner.model.layers)) for kind in ("attn", "mlp")}
    assert same(calls, expected(inner, skip=skip))


def test_no_gradient_or_autocast_calls_the_modules(calls):
    model = surgery.patch(tiny_model("llama").train())
    with torch.no_grad():
        model(**batch())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch()).loss.backward()
    assert calls == []
