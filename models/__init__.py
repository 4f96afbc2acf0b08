"""surgery.models: one declarative spec per supported architecture."""

from .gemma import GEMMA, GEMMA2, GEMMA3, GEMMA3N, GEMMA4
from .llama import LLAMA, LLAMA4
from .mini import MiniConfig, MiniSize, alternating_layer_types, from_size
from .mistral import MINISTRAL, MINISTRAL3, MISTRAL, MISTRAL4, MIXTRAL
from .qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE, QWEN3_NEXT
from .spec import ArchitectureSpec, RMSNormStyle

# The one list of supported architectures: surgery.supported(), the apply_<name> functions, the
# tests' tiny models and the convergence suite's models are all derived from it.
SPECS: tuple[ArchitectureSpec, ...] = (
    LLAMA,
    LLAMA4,
    MISTRAL,
    MIXTRAL,
    MINISTRAL,
    MINISTRAL3,
    MISTRAL4,
    QWEN2,
    QWEN3,
    QWEN2_MOE,
    QWEN3_MOE,
    QWEN3_NEXT,
    QWEN3_5,
    QWEN3_5_MOE,
    GEMMA,
    GEMMA2,
    GEMMA3,
    GEMMA4,
    GEMMA3N,
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
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3",
    "QWEN3_5",
    "QWEN3_5_MOE",
    "QWEN3_MOE",
    "QWEN3_NEXT",
    "SPECS",
    "ArchitectureSpec",
    "MiniConfig",
    "MiniSize",
    "RMSNormStyle",
    "alternating_layer_types",
    "from_size",
]
