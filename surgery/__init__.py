"""surgery: model surgery for Hugging Face transformers.

``surgery.patch(model)`` swaps forward methods on a transformers causal LM so that training uses the
fused ``linear_cross_entropy`` loss, position-aware ``apply_rope``, and fused ``rms_norm`` and
``gated_activation`` kernels; ``apply_<arch>()`` does the same for models built afterwards.
"""

from . import api, apply
from .api import *  # noqa: F403  (patch, unpatch, patched, ...)
from .apply import *  # noqa: F403  (revert, and apply_<name> for every supported architecture)
from .describe import PatchReport, describe
from .fallback import FallbackRefusedError
from .foreign import ForeignForwardError
from .options import PatchOptions
from .outputs import CausalLMOutputWithZLoss, MoeCausalLMOutputWithZLoss, ZLossOutput
from .registry import UnsupportedModelError, supported

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
