"""The registry (``surgery.models.SPECS``) is the one list of supported architectures: every spec
has a mini config that builds transformers' own causal LM and exercises what the spec declares,
and everything else that lists architectures (``surgery.supported()``, ``apply_<name>``, the tests'
tiny models, the convergence suite) lists exactly the registry. A new spec is thereby tested and
proven with no other edit."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

import surgery
from surgery.attention import _read_path
from surgery.convergence.configs import ARCHITECTURES, FALLBACK_SPECS, SIZES, make_config
from surgery.models import SPECS

from .tiny import ARCHS, attn_for, tiny_config


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.model_type)
def test_every_registered_model_is_tested(spec):
    config = tiny_config(spec.model_type)
    assert type(config).__name__ == spec.mini_config.config_class
    assert config.model_type == spec.model_type
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_for(spec.model_type))
    assert type(model) is spec.causal_lm_class()

    # The mini model holds every class the spec names and exercises every feature it declares:
    # otherwise a feature of the spec would go untested (a mini config that leaves it off).
    def instances(name):
        return [m for m in model.modules() if spec.is_instance(m, name)]

    attentions = instances(spec.attention)
    assert len(attentions) == config.num_hidden_layers
    assert isinstance(getattr(model.model, spec.rotary_attr), torch.nn.Module)
    if spec.rms_norm is not None:
        assert instances(spec.rms_norm)
    if spec.mlp is not None:
        # every layer's MLP; a mixture of experts holds its gated MLPs beside or instead of them
        mlps = instances(spec.mlp)
        assert len(mlps) == config.num_hidden_layers or (spec.router_aux_loss and mlps)
        assert spec.gated_activation(config) is not None, "the mini MLP has no fused activation"
    if spec.router_aux_loss:
        assert config.output_router_logits, "the mini config leaves the router's aux loss out"
    for name, path in spec.attention_kwargs:
        values = [_read_path(module, path) for module in attentions]
        assert any(v is not None for v in values), f"no layer of the mini model sets {name}"
    if spec.qk_norm:
        assert all(hasattr(m, "q_norm") and hasattr(m, "k_norm") for m in attentions)
    if spec.logit_softcap is not None:
        assert getattr(config, spec.logit_softcap) is not None
    if spec.rope_per_layer_type:
        assert len(set(config.layer_types)) > 1, "one layer type: one set of RoPE frequencies"
    if spec.tied_lm_head:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.model_type)
def test_mini_models_are_deterministic_and_independent(spec):
    """Same seed, same weights; two configs share no nested argument (RoPE parameters)."""
    first, second = tiny_config(spec.model_type), tiny_config(spec.model_type)
    assert first.to_dict() == second.to_dict()
    for key, value in vars(first).items():
        if isinstance(value, (dict, list)):
            assert value is not getattr(second, key), key
    models = []
    for config in (first, second):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(config))
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.model_type)
def test_spec_survives_copy_and_pickle(spec):
    """A patched model holds its spec: deepcopy and pickle must give an equal one."""
    assert copy.deepcopy(spec) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    hash(spec)


def test_everything_that_lists_architectures_lists_the_registry():
    assert list(surgery.supported().values()) == list(SPECS)  # no two specs share a model_type
    assert [spec.model_type for spec in SPECS] == ARCHS
    # the convergence suite's --model all: the registry, then the fallback's models
    assert list(ARCHITECTURES.values()) == list(SPECS + FALLBACK_SPECS)
    assert not {spec.model_type for spec in FALLBACK_SPECS} & set(surgery.supported())
    for spec in SPECS:
        assert callable(getattr(surgery, spec.apply_name)), spec.apply_name
        assert callable(getattr(surgery.api, spec.apply_name)), spec.apply_name


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_convergence_configs_build(name, size):
    spec = ARCHITECTURES[name]
    config = make_config(name, size)
    assert type(config).__name__ == spec.mini_config.config_class
    assert config._attn_implementation == spec.mini_config.attention("sdpa")
    assert config.hidden_size == SIZES[size].hidden_size
