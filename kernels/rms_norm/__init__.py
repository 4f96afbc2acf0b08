"""RMSNorm over the last dimension, with transformers' cast points, in one read and one write.

Modules, in reading order: ``kernel`` (Triton kernels) -> ``launch`` (the launch configuration,
the PyTorch path and the host launchers ``rms_norm_fwd``, ``rms_norm_bwd``) -> ``ops``
(torch.library ops and the one autograd formula: registered on the op for torch.compile, and the
eager ``RmsNormFunction`` over the launchers) -> ``api`` (``rms_norm`` and the reference
``rms_norm_reference``).

Per row x of N elements, in fp32 whatever the storage dtype (o = ``offset``, w = weight):

    rstd = 1 / sqrt(mean(x^2) + eps)        n = x * rstd
    casting "llama":  y = round_in(n) * (o + w), rounded to promote(x.dtype, w.dtype)
    casting "gemma":  y = n * (o + w),           rounded to x.dtype

where round_in rounds to x's dtype and back: transformers' Llama, Mistral and Qwen2/3 norms return
``weight * normed.to(input_dtype)``; Gemma 1/2/3 return ``(normed * (1 + weight.float()))
.type_as(x)``. The backward treats the roundings as the identity (as autograd does for transformers'
casts), with dn = dy * (o + w):

    dx = rstd * (dn - n * mean(dn * n))
    dw = sum over rows of dy * round_in(n)  (llama), or of dy * n  (gemma)

The forward saves x and rstd (fp32, one per row) and nothing else. dw is summed in fp32: each
backward program accumulates its rows into one row of a (programs, N) buffer, and the rows of that
buffer are added at the end (no atomics, the same result on every run).
"""

from __future__ import annotations

from .api import rms_norm, rms_norm_reference
from .kernel import dw_partial_sum_kernel, rms_norm_bwd_kernel, rms_norm_fwd_kernel
from .launch import (
    CASTING_MODES,
    DEFAULT_LAUNCH,
    INTERPRETER_LAUNCH,
    MAX_HIDDEN,
    RmsNormLaunch,
    rms_norm_bwd,
    rms_norm_fwd,
)
from .ops import RmsNormFunction

__all__ = [
    "CASTING_MODES",
    "DEFAULT_LAUNCH",
    "INTERPRETER_LAUNCH",
    "MAX_HIDDEN",
    "RmsNormFunction",
    "RmsNormLaunch",
    "dw_partial_sum_kernel",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_bwd_kernel",
    "rms_norm_fwd",
    "rms_norm_fwd_kernel",
    "rms_norm_reference",
]
