"""surgery.models: one declarative spec per supported architecture."""

from .gemma import GEMMA, GEMMA2, GEMMA3
from .llama import LLAMA
from .mistral import MISTRAL
from .qwen import QWEN2, QWEN3
from .spec import ArchitectureSpec, RMSNormStyle

SPECS: tuple[ArchitectureSpec, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3)

__all__ = [
    "GEMMA",
    "GEMMA2",
    "GEMMA3",
    "LLAMA",
    "MISTRAL",
    "QWEN2",
    "QWEN3",
    "SPECS",
    "ArchitectureSpec",
    "RMSNormStyle",
]
