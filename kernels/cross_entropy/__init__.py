"""Cross entropy over logits that exist, and the row kernels the fused linear cross entropy reuses.

Modules, in reading order: ``kernel`` (Triton kernels) -> ``launch`` (the PyTorch path and the
host launchers ``cross_entropy_fwd``, ``cross_entropy_bwd``) -> ``ops`` (torch.library ops and the
autograd.Function over them, eager and compiled) -> ``api`` (``cross_entropy``,
``cross_entropy_statistics`` and the loss inputs the linear cross entropy shares). The fp32
reference is ``reference.cross_entropy_reference``.

Per token i with target y, over the logits the loss sees, x = cap * tanh(k z / cap) / T (the
softcap ``cap`` where set; a logit scale k and a temperature T, both 1 unless given):

    lse_i  = log sum_j exp(x_ij)
    ce_i   = lse_i - (1 - eps) x_iy - (eps / V) sum_j x_ij          (label smoothing eps)
    zl_i   = s * lse_i^2                                            (z-loss scale s)
    h_i    = -sum_j p_ij log p_ij = lse_i - sum_j p_ij x_ij         (entropy, on request)
    dL/dz_ij = [ (a_i + 2 s lse_i b_i - e_i (x_ij - lse_i + h_i)) p_ij
                 - a_i ((1 - eps) [j = y] + eps / V) ] * dx/dz

where p = softmax(x) and a_i, b_i, e_i are the upstream gradients reaching ce_i, zl_i and h_i.
Tokens without a target (ignore_index, or a label outside [0, V)) have loss 0 and gradient 0 for
any upstream gradient. Logits of -inf (a vocabulary the caller masked) are columns of probability
0, as ``F.cross_entropy`` takes them (under a softcap they are logits of -cap). The other
statistics (``STATISTICS``) are log sum_j p_ij^2, the mean of x_i, whether y is the first maximum
of x_i and that first maximum's column (argmax's, -1 without a target); none has a gradient.
"""

from __future__ import annotations

from .api import (
    batch_rows,
    check_options,
    cross_entropy,
    cross_entropy_statistics,
    prepare_loss_inputs,
)
from .kernel import cross_entropy_bwd_kernel, cross_entropy_fwd_kernel
from .launch import (
    STATISTIC_DTYPES,
    STATISTIC_FILL,
    STATISTICS,
    cross_entropy_bwd,
    cross_entropy_fwd,
    named_statistics,
    statistics_buffers,
    statistics_mask,
    statistics_outputs,
)
from .ops import CrossEntropyFunction, reduce_losses, upstream_coefficients

__all__ = [
    "STATISTICS",
    "STATISTIC_DTYPES",
    "STATISTIC_FILL",
    "CrossEntropyFunction",
    "batch_rows",
    "check_options",
    "cross_entropy",
    "cross_entropy_bwd",
    "cross_entropy_bwd_kernel",
    "cross_entropy_fwd",
    "cross_entropy_fwd_kernel",
    "cross_entropy_statistics",
    "named_statistics",
    "prepare_loss_inputs",
    "reduce_losses",
    "statistics_buffers",
    "statistics_mask",
    "statistics_outputs",
    "upstream_coefficients",
]
