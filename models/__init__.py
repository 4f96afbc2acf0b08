"""surgery.models: one declarative spec per supported architecture."""

from .gemma import GEMMA, GEMMA2, GEMMA3
from .llama import LLAMA
from .mini import MiniConfig, MiniSize, alternating_layer_types, from_size
from .mistral import MINISTRAL, MISTRAL
from .qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE
from .spec import ArchitectureSpec, RMSNormStyle

# The one list of supported architectures: surgery.supported(), the apply_<name> functions, the
# tests' tiny models and the convergence suite's models are all derived from it.
SPECS: tuple[ArchitectureSpec, ...] = (
    LLAMA,
    MISTRAL,
    MINISTRAL,
    QWEN2,
    QWEN3,
    QWEN2_MOE,
    QWEN3_MOE,
    GEMMA,
    GEMMA2,
    GEMMA3,
)

__all__ = [
    "GEMMA",
    "GEMMA2",
    "GEMMA3",
    "LLAMA",
    "MINISTRAL",
    "MISTRAL",
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3",
    "QWEN3_MOE",
    "SPECS",
    "ArchitectureSpec",
    "MiniConfig",
    "MiniSize",
    "RMSNormStyle",
    "alternating_layer_types",
    "from_size",
]
