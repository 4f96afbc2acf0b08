"""How the tests and the convergence suite build each architecture's mini models: a ``MiniConfig``
per text spec and a ``MiniMultimodalConfig`` per multimodal wrapper of the registry, by
``model_type``, one file per family (as ``surgery.models``).

A spec with no entry gets transformers' own config class for its ``model_type`` at the mini size
(``mini_config``), which serves where transformers' defaults already exercise what the spec
declares. An entry says what its mini model must set for the patch to be tested (a window that
clips, a softcap that bites, both layer types present, eager attention for a class without
sdpa). A wrapper needs one: its tiny vision tower and special tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from ..mini import MiniConfig, MiniMultimodalConfig
from . import gemma, llama, mistral, qwen

if TYPE_CHECKING:
    from surgery.models import ArchitectureSpec, MultimodalWrapper

__all__ = ["MINI_CONFIGS", "MINI_MULTIMODAL_CONFIGS", "mini_config", "mini_multimodal_config"]

_FAMILIES = (llama, mistral, qwen, gemma)

MINI_CONFIGS: dict[str, MiniConfig] = {
    model_type: mini for family in _FAMILIES for model_type, mini in family.MINI_CONFIGS.items()
}
MINI_MULTIMODAL_CONFIGS: dict[str, MiniMultimodalConfig] = {
    model_type: mini
    for family in _FAMILIES
    for model_type, mini in family.MINI_MULTIMODAL_CONFIGS.items()
}


def mini_config(spec: ArchitectureSpec) -> MiniConfig:
    """The mini config of ``spec``: its entry in ``MINI_CONFIGS``, else transformers' config class
    of its ``model_type`` with no arguments of its own (only the size's)."""
    if spec.model_type in MINI_CONFIGS:
        return MINI_CONFIGS[spec.model_type]
    if spec.model_type not in CONFIG_MAPPING_NAMES:
        raise NotImplementedError(
            f"transformers has no config class for model_type {spec.model_type!r}: give it a "
            "MiniConfig in MINI_CONFIGS (convergence/minis/<family>.py)"
        )
    return MiniConfig(CONFIG_MAPPING_NAMES[spec.model_type])


def mini_multimodal_config(wrapper: MultimodalWrapper) -> MiniMultimodalConfig:
    """The mini config of ``wrapper`` (its entry in ``MINI_MULTIMODAL_CONFIGS``)."""
    if wrapper.model_type not in MINI_MULTIMODAL_CONFIGS:
        raise NotImplementedError(
            f"no mini config for the {wrapper.model_type} wrapper: give it a MiniMultimodalConfig "
            "(its vision tower in small, its special tokens) in MINI_MULTIMODAL_CONFIGS "
            "(convergence/minis/<family>.py)"
        )
    return MINI_MULTIMODAL_CONFIGS[wrapper.model_type]
