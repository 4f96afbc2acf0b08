"""surgery: model surgery for Hugging Face transformers.

``surgery.patch(model)`` swaps forward methods on a transformers causal LM so that training uses the
fused ``linear_cross_entropy`` loss, position-aware ``apply_rope``, and fused ``rms_norm`` and
``gated_activation`` kernels; ``apply_<arch>()`` does the same for models built afterwards.
"""

from surgery import api, apply
from surgery.api import *  # noqa: F403  (patch, unpatch, patched, ...)
from surgery.apply import *  # noqa: F403  (revert, and apply_<name> for every supported architecture)
from surgery.describe import PatchReport, describe
from surgery.options import PatchOptions
from surgery.outputs import CausalLMOutputWithZLoss, MoeCausalLMOutputWithZLoss, ZLossOutput
from surgery.patching.fallback import FallbackRefusedError
from surgery.patching.foreign import ForeignForwardError
from surgery.patching.registry import UnsupportedModelError, supported

__version__ = "0.1.0"

__all__ = [
    "CausalLMOutputWithZLoss",
    "FallbackRefusedError",
    "ForeignForwardError",
    "MoeCausalLMOutputWithZLoss",
    "PatchOptions",
    "PatchReport",
    "UnsupportedModelError",
    "ZLossOutput",
    "__version__",
    "describe",
    "supported",
]
__all__ += api.__all__
__all__ += apply.__all__
