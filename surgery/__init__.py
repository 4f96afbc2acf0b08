"""surgery: model surgery for Hugging Face transformers.

``surgery.patch(model)`` swaps forward methods on a transformers causal LM so that training uses the
fused ``linear_cross_entropy`` loss, position-aware ``apply_rope``, and fused ``rms_norm`` and
``gated_activation`` kernels; ``apply_<arch>()`` does the same for models built afterwards.
"""

from .api import (
    apply_gemma,
    apply_gemma2,
    apply_gemma3,
    apply_llama,
    apply_mistral,
    apply_qwen2,
    apply_qwen3,
    is_patched,
    patch,
    patch_options,
    patched,
    revert,
    unpatch,
)
from .forward import CausalLMOutputWithZLoss
from .options import PatchOptions
from .registry import UnsupportedModelError, supported

__version__ = "0.1.0"

__all__ = [
    "CausalLMOutputWithZLoss",
    "PatchOptions",
    "UnsupportedModelError",
    "__version__",
    "apply_gemma",
    "apply_gemma2",
    "apply_gemma3",
    "apply_llama",
    "apply_mistral",
    "apply_qwen2",
    "apply_qwen3",
    "is_patched",
    "patch",
    "patch_options",
    "patched",
    "revert",
    "supported",
    "unpatch",
]
