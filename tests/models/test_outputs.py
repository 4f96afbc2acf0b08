"""The patched causal LM returns what unpatched transformers returns: its own output class (plus
``z_loss``) with every field transformers fills (the loss, a MoE's ``aux_loss`` and
``router_logits``, Gemma 4's ``shared_kv_states``, the cache, the hidden states) holding the same
values. The one documented difference: ``logits`` is None where the loss is fused (training with
labels). Every architecture of the registry, and Gemma 4's mixture-of-experts variant."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

import surgery
from tests.utils import FP32_CLOSE as TOL

from .tiny import ARCHS, SPECS, gemma4_moe_config, padded_batch, sequences, tiny_model, twin

LENGTHS = [7, 5]


def gemma4_moe():
    torch.manual_seed(0)
    config = gemma4_moe_config()
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


MODELS = {arch: lambda arch=arch: tiny_model(arch) for arch in ARCHS}
MODELS["gemma4_text-moe"] = gemma4_moe


def asked_for(output: type) -> dict:
    """The forward arguments that make transformers fill every optional field ``output`` has
    (attentions aside: sdpa returns none)."""
    fields = {field.name for field in dataclasses.fields(output)}
    kwargs = {"output_hidden_states": True}
    if "router_logits" in fields:
        kwargs["output_router_logits"] = True
    if "shared_kv_states" in fields:
        kwargs["return_shared_kv_states"] = True
    return kwargs


def assert_same_value(got, want, where: str) -> None:
    """``got`` holds what ``want`` holds: tensors within fp32's budget, containers and caches
    element by element."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_value(g, w, f"{where}[{i}]")
    elif isinstance(want, Mapping):
        assert type(got) is type(want) and got.keys() == want.keys(), where
        for key in want:
            assert_same_value(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, Cache):
        assert type(got) is type(want) and len(got.layers) == len(want.layers), where
        for i, (g, w) in enumerate(zip(got.layers, want.layers)):
            tensors = {k: v for k, v in vars(w).items() if isinstance(v, torch.Tensor)}
            assert_same_value({k: getattr(g, k) for k in tensors}, tensors, f"{where}.layers[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_carry_transformers_fields(name):
    """A training step with labels, every optional output asked for: the patched output is an
    instance of the unpatched one's class and of ``surgery.ZLossOutput``, with the same fields set
    (``z_loss`` added, ``logits`` None) and the same values."""
    model = MODELS[name]().train()
    reference = twin(model)
    surgery.patch(model)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    with torch.no_grad():
        output = type(reference(**batch))
        kwargs = {**batch, **asked_for(output)}
        want = reference(**kwargs)
        got = model(**kwargs)
    assert isinstance(got, output), f"{type(got).__name__} is not a {output.__name__}"
    assert isinstance(got, surgery.ZLossOutput)
    assert "z_loss" in {field.name for field in dataclasses.fields(got)}
    assert got.logits is None and want.logits is not None
    assert set(got.keys()) == set(want.keys()) - {"logits"}
    for field in want.keys() - {"logits"}:
        assert_same_value(got[field], want[field], field)
    if SPECS[name.removesuffix("-moe")].router_aux_loss:  # the aux loss path was compared
        assert {"aux_loss", "router_logits"} <= set(want.keys())


def test_made_output_classes_pickle():
    """A class made for a model's own output (Gemma 4's) is found again by name when unpickled
    (a Trainer saving outputs, a DataLoader worker returning them)."""
    import pickle

    from transformers.models.gemma4.modeling_gemma4 import Gemma4CausalLMOutputWithPast

    from surgery.outputs import with_z_loss

    made = with_z_loss(Gemma4CausalLMOutputWithPast)
    out = made(loss=torch.tensor(1.0), z_loss=torch.tensor(0.5))
    back = pickle.loads(pickle.dumps(out))
    assert type(back) is made and issubclass(made, Gemma4CausalLMOutputWithPast)
    assert torch.equal(back.z_loss, out.z_loss) and torch.equal(back.loss, out.loss)
