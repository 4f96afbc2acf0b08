"""surgery.models: one declarative spec per supported architecture."""

from . import gemma, llama, mistral, qwen
from .gemma import GEMMA, GEMMA2, GEMMA3, GEMMA3N, GEMMA4
from .llama import LLAMA, LLAMA4
from .mistral import MINISTRAL, MINISTRAL3, MISTRAL, MISTRAL4, MIXTRAL
from .qwen import (
    QWEN2,
    QWEN2_5_VL,
    QWEN2_MOE,
    QWEN2_VL,
    QWEN3,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_MOE,
    QWEN3_NEXT,
    QWEN3_VL,
    QWEN3_VL_MOE,
)
from .spec import ArchitectureSpec, MultimodalWrapper, RMSNormStyle

# The one list of supported architectures: surgery.supported(), the apply_<name> functions, the
# tests' tiny models and the convergence suite's models are all derived from it. Collected, not
# listed: every public ArchitectureSpec of the family files, family by family, each file's in the
# order written (a new spec in its family's file is in the registry).
_FAMILIES = (llama, mistral, qwen, gemma)


def _collected() -> tuple[ArchitectureSpec, ...]:
    found: dict[int, ArchitectureSpec] = {}
    for family in _FAMILIES:
        for name, value in vars(family).items():
            if isinstance(value, ArchitectureSpec) and not name.startswith("_"):
                found.setdefault(id(value), value)
    return tuple(found.values())


_SPECS_WRITTEN = _collected()
SPECS: tuple[ArchitectureSpec, ...] = tuple(s for s in _SPECS_WRITTEN if s.causal_lm is not None)

# Text architectures without a causal LM of their own, patched only as the language model of their
# multimodal wrappers (``ArchitectureSpec.multimodal``): not in SPECS, whose every entry is a causal
# LM (surgery.supported(), apply_<name>, the tests' and the convergence suite's models).
MULTIMODAL_ONLY_SPECS: tuple[ArchitectureSpec, ...] = tuple(
    s for s in _SPECS_WRITTEN if s.causal_lm is None
)

__all__ = [
    "GEMMA",
    "GEMMA2",
    "GEMMA3",
    "GEMMA3N",
    "GEMMA4",
    "LLAMA",
    "LLAMA4",
    "MINISTRAL",
    "MINISTRAL3",
    "MISTRAL",
    "MISTRAL4",
    "MIXTRAL",
    "MULTIMODAL_ONLY_SPECS",
    "QWEN2",
    "QWEN2_5_VL",
    "QWEN2_MOE",
    "QWEN2_VL",
    "QWEN3",
    "QWEN3_5",
    "QWEN3_5_MOE",
    "QWEN3_MOE",
    "QWEN3_NEXT",
    "QWEN3_VL",
    "QWEN3_VL_MOE",
    "SPECS",
    "ArchitectureSpec",
    "MultimodalWrapper",
    "RMSNormStyle",
]
