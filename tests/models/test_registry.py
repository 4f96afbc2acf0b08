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

import surgery
from surgery.attention.forward import mrope_layout, read_path
from surgery.convergence.configs import (
    ARCHITECTURES,
    FALLBACK_SPECS,
    SIZES,
    architecture_mini_config,
    make_config,
)
from surgery.convergence.minis import mini_config
from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS

from .tiny import ARCHS, TINY, attn_for, causal_lm_from_config, tiny_config


@pytest.mark.parametrize("spec", MULTIMODAL_ONLY_SPECS, ids=lambda spec: spec.model_type)
def test_multimodal_only_text_specs_are_reached_through_a_wrapper(spec):
    """A text spec outside ``SPECS`` (a language model transformers gives no causal-LM class of
    its own: Qwen2-VL's and later) is patched and tested through its wrappers only
    (tests/models/test_multimodal.py iterates over them): it must name one, and not be in
    ``SPECS`` too."""
    assert spec.causal_lm is None and spec.multimodal
    assert spec.model_type not in {s.model_type for s in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.model_type)
def test_every_registered_model_is_tested(spec):
    config = tiny_config(spec.model_type)
    assert type(config).__name__ == mini_config(spec).config_class
    assert config.model_type == spec.model_type
    torch.manual_seed(0)
    model = causal_lm_from_config(config, attn_implementation=attn_for(spec.model_type))
    assert type(model) is spec.causal_lm_class()

    # The mini model holds every class the spec names and exercises every feature it declares:
    # otherwise a feature of the spec would go untested (a mini config that leaves it off).
    def instances(name):
        return [m for m in model.modules() if spec.is_instance(m, name)]

    attentions = instances(spec.attention)
    if spec.linear_attention is None:
        assert len(attentions) == config.num_hidden_layers
    else:  # a hybrid: both kinds of layer, one of them in each
        linear = instances(spec.linear_attention)
        assert attentions and linear
        assert len(attentions) + len(linear) == config.num_hidden_layers
    if spec.attention_output_gate:  # q_proj yields the query and its gate
        for module in attentions:
            assert module.q_proj.out_features == 2 * config.num_attention_heads * module.head_dim
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
        values = [read_path(module, path) for module in attentions]
        assert any(v is not None for v in values), f"no layer of the mini model sets {name}"
    # A layer that reuses an earlier layer's keys and values has no key projection or norm.
    own_kv = [m for m in attentions if not (spec.kv_sharing and m.is_kv_shared_layer)]
    if spec.qk_norm:
        assert all(hasattr(m, "q_norm") for m in attentions)
        assert all(hasattr(m, "k_norm") for m in own_kv)
    if spec.v_norm:
        assert all(hasattr(m, "v_norm") for m in own_kv)
    if spec.kv_sharing:
        assert own_kv != attentions, "no layer of the mini model reuses keys and values"
    if spec.logit_softcap is not None:
        assert getattr(config, spec.logit_softcap) is not None
    if spec.rope_layer_attr is not None:  # layers with RoPE and layers without
        assert len({bool(getattr(m, spec.rope_layer_attr)) for m in attentions}) == 2
    if spec.post_rope_qk_norm is not None:
        assert any(hasattr(m, spec.post_rope_qk_norm) for m in attentions)
    if spec.attention_temperature:
        assert any(m.attn_temperature_tuning for m in attentions)
        assert config.floor_scale < TINY.sliding_window, "no temperature within the sequences"
    if spec.chunked_attention:  # chunked and global layers, chunks shorter than the sequences
        assert {"chunked_attention", "full_attention"} <= set(config.layer_types)
        assert config.attention_chunk_size <= TINY.sliding_window
    if spec.rope_per_layer_type:
        assert len(set(config.layer_types)) > 1, "one layer type: one set of RoPE frequencies"
    if spec.tied_lm_head:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if spec.position_query_scale:  # a scale that grows within the tests' sequences (up to 7)
        rope = config.rope_parameters
        assert rope["llama_4_scaling_beta"] and rope["original_max_position_embeddings"] < 7
    if spec.latent_attention:  # both query paths are transformers' own; the low-rank one here
        assert all(m.q_lora_rank is not None for m in attentions)
    if spec.mrope:  # sections apply_rope takes, read from the rotary module
        assert mrope_layout(getattr(model.model, spec.rotary_attr)) is not None


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
        models.append(causal_lm_from_config(config))
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
        assert callable(getattr(surgery.apply, spec.apply_name)), spec.apply_name


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_convergence_configs_build(name, size):
    mini = architecture_mini_config(name)
    config = make_config(name, size)
    assert type(config).__name__ == mini.config_class
    assert config._attn_implementation == mini.attention("sdpa")
    assert config.hidden_size == SIZES[size].hidden_size


def test_registry_collects_the_family_files(monkeypatch):
    """``SPECS`` is collected from the family files: a spec written in one comes after that file's
    others, one without a causal LM is a multimodal-only spec, a private one is left out."""
    import dataclasses

    from surgery import models
    from surgery.models import gemma, qwen

    new = dataclasses.replace(qwen.QWEN3, model_type="qwen_new", causal_lm="QwenNewForCausalLM")
    text_only = dataclasses.replace(new, model_type="qwen_new_text", causal_lm=None)
    template = dataclasses.replace(new, model_type="qwen_template")
    monkeypatch.setattr(qwen, "QWEN_NEW", new, raising=False)
    monkeypatch.setattr(qwen, "QWEN_NEW_TEXT", text_only, raising=False)
    monkeypatch.setattr(qwen, "_QWEN_TEMPLATE", template, raising=False)
    collected = [s.model_type for s in models._collected()]
    first_gemma = collected.index(gemma.GEMMA.model_type)
    assert collected[first_gemma - 2 : first_gemma] == ["qwen_new", "qwen_new_text"]
    assert "qwen_template" not in collected
    registered = [s.model_type for s in (*models.SPECS, *models.MULTIMODAL_ONLY_SPECS)]
    assert sorted(registered) == sorted(set(collected) - {"qwen_new", "qwen_new_text"})
    assert len(registered) == len(set(registered))
