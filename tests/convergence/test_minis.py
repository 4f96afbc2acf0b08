"""The mini configs (``surgery.convergence.minis``): every spec and wrapper of the registry resolves
one, each table entry belongs to one, a ``model_type`` without an entry gets transformers' config
class at the mini size, and the public package (``surgery.models``) holds none of them."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import surgery.models
from surgery.convergence import minis
from surgery.convergence.mini import MiniConfig, MiniMultimodalConfig
from surgery.convergence.minis import (
    MINI_CONFIGS,
    MINI_MULTIMODAL_CONFIGS,
    mini_config,
    mini_multimodal_config,
)
from surgery.models import GEMMA, GEMMA3, LLAMA, MULTIMODAL_ONLY_SPECS, SPECS
from tests.models.tiny import TINY

TEXT_SPECS = (*SPECS, *MULTIMODAL_ONLY_SPECS)
WRAPPERS = {w.model_type: w for spec in TEXT_SPECS for w in spec.multimodal}


@pytest.mark.parametrize("spec", TEXT_SPECS, ids=lambda spec: spec.model_type)
def test_every_spec_resolves_a_mini_config(spec):
    mini = mini_config(spec)
    assert isinstance(mini, MiniConfig)
    assert mini.config_class == CONFIG_MAPPING_NAMES[spec.model_type]


@pytest.mark.parametrize("wrapper", WRAPPERS.values(), ids=lambda wrapper: wrapper.model_type)
def test_every_wrapper_resolves_a_mini_config(wrapper):
    mini = mini_multimodal_config(wrapper)
    assert isinstance(mini, MiniMultimodalConfig)
    assert mini.config_class == CONFIG_MAPPING_NAMES[wrapper.model_type]


def test_every_entry_is_of_a_spec_or_wrapper_of_the_registry():
    """A key that names no spec (a typo, a spec renamed) would leave its spec with the derived
    default, silently; no two family files share a key."""
    assert set(MINI_CONFIGS) <= {spec.model_type for spec in TEXT_SPECS}
    assert set(MINI_MULTIMODAL_CONFIGS) == set(WRAPPERS)
    families = [family.MINI_CONFIGS for family in minis._FAMILIES]
    assert sum(map(len, families)) == len(MINI_CONFIGS)
    families = [family.MINI_MULTIMODAL_CONFIGS for family in minis._FAMILIES]
    assert sum(map(len, families)) == len(MINI_MULTIMODAL_CONFIGS)


def test_a_model_type_without_an_entry_gets_transformers_config_class():
    """Gemma has no entry: its mini config is ``GemmaConfig`` at the mini size, nothing else. A
    spec of another model_type without one gets its own config class the same way; one
    transformers has no config class for is refused with what to add."""
    assert "gemma" not in MINI_CONFIGS
    assert mini_config(GEMMA) == MiniConfig("GemmaConfig")
    new = dataclasses.replace(LLAMA, model_type="phi3")
    assert "phi3" not in MINI_CONFIGS
    assert mini_config(new) == MiniConfig("Phi3Config")
    config = mini_config(new).build(TINY)
    assert type(config).__name__ == "Phi3Config"
    assert config.hidden_size == TINY.hidden_size
    assert config.num_hidden_layers == TINY.num_hidden_layers
    assert mini_config(new).attention("sdpa") == "sdpa"
    with pytest.raises(NotImplementedError, match=r"'no_such_model'.*MINI_CONFIGS"):
        mini_config(dataclasses.replace(LLAMA, model_type="no_such_model"))


def test_a_wrapper_without_an_entry_is_refused_with_what_to_add():
    (wrapper,) = GEMMA3.multimodal
    new = dataclasses.replace(wrapper, model_type="new_vlm")
    with pytest.raises(NotImplementedError, match=r"new_vlm wrapper.*MINI_MULTIMODAL_CONFIGS"):
        mini_multimodal_config(new)


def test_the_public_package_holds_no_mini_config():
    """``surgery.models`` describes architectures; how the tests build mini models lives here."""
    names = set(dir(surgery.models)) | set(surgery.models.__all__)
    helpers = {"from_size", "alternating_layer_types", "text_hidden_size", "mini"}
    mini_names = {n for n in names if n.startswith(("Mini", "MINI_"))} | (names & helpers)
    assert not mini_names, f"surgery.models exports {sorted(mini_names)}"
    assert importlib.util.find_spec("surgery.models.mini") is None
    for cls in (surgery.models.ArchitectureSpec, surgery.models.MultimodalWrapper):
        assert "mini_config" not in {f.name for f in dataclasses.fields(cls)}, cls.__name__
