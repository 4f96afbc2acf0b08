"""``rms_norm``, checked before anything launches, and its reference ``rms_norm_reference``."""

from __future__ import annotations

from typing import Literal

import torch

from ..dispatch import call_kernel
from .launch import _FLOAT_DTYPES, CASTING_MODES, MAX_HIDDEN, _out_dtype, rms_norm_fwd
from .ops import RmsNormFunction, _rms_norm_fwd_op

__all__ = ["rms_norm", "rms_norm_reference"]

# ---------------------------------------------------------------------------------------------
# Public functions.


def _check(x, weight, eps, casting) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm: x and weight must be tensors, got {type(x)}, {type(weight)}")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"rms_norm: x and weight must be float32, bfloat16 or float16; got {x.dtype} and "
            f"{weight.dtype}"
        )
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be 1-D with x's last dimension; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"rms_norm: rows of more than {MAX_HIDDEN} elements are not supported")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")
    if casting not in CASTING_MODES:
        raise ValueError(f"rms_norm: casting must be one of {CASTING_MODES}, got {casting!r}")
    if not eps >= 0.0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: Literal["llama", "gemma"] = "llama",
) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 inside the kernel.

    Args:
        x: (..., N), any leading shape; float32, bfloat16 or float16. The last dimension must have
            unit stride for a copy-free call (otherwise x is copied). N <= 65536.
        weight: (N,); float32, bfloat16 or float16, on x's device.
        eps: added to the mean square before the reciprocal square root.
        offset: the scale is ``offset + weight`` (in fp32): 0.0 for Llama-style weights, 1.0 for
            Gemma's zero-centred ones.
        casting: where the result is rounded, to reproduce transformers' modules:
            ``"llama"`` (Llama, Mistral, Qwen2, Qwen3): the normalised row is rounded to x's dtype,
            then multiplied by the scale, and the product rounded to ``promote(x.dtype,
            weight.dtype)`` — ``weight * normed.to(input_dtype)``;
            ``"gemma"`` (Gemma 1/2/3): normalised and scaled in fp32, rounded once to x's dtype —
            ``(normed * (1 + weight.float())).type_as(x)``.

    Returns:
        A new tensor of x's shape in the casting's output dtype. x is never written.

    Differentiable in x and weight (once: a double backward raises): the forward saves x and one
    fp32 rstd per row; the backward recomputes the normalised rows, and sums the weight gradient in
    fp32 over every row (skipped when the weight does not require grad, e.g. under LoRA). Under
    ``torch.compile(fullgraph=True)`` it is the op ``torch.ops.surgery.rms_norm_fwd`` with its
    registered autograd (fake tensors registered too); an eager call that autograd records runs the
    same setup and backward as ``RmsNormFunction`` over the launchers; one with nothing to
    differentiate (grad mode off, or neither x nor weight requiring grad) the launcher
    ``rms_norm_fwd`` alone. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``)
    run the Triton kernels; other CPU tensors a PyTorch path with the same fp32 math.

    Autocast (the rule of every kernel here: inputs are cast on entry where the unpatched module's
    ops would cast them, and nothing after that depends on autocast): transformers' norms are
    elementwise, which autocast leaves alone, so nothing is cast and the output dtype follows
    ``casting`` as without autocast — ``"llama"``: promote(x, weight), fp32 for an fp32 weight
    whatever x's dtype; ``"gemma"``: x's dtype — which is what transformers' module returns under
    autocast. No op inside depends on autocast: the result is that of the call without it, bit for
    bit.
    """
    _check(x, weight, eps, casting)
    N = x.shape[-1]
    x2d = x.reshape(-1, N)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    eps, offset = float(eps), float(offset)
    inputs = (x2d, weight, eps, offset, casting)
    y, _ = call_kernel(_rms_norm_fwd_op, RmsNormFunction, rms_norm_fwd, inputs, x2d, weight)
    return y.view(x.shape)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: Literal["llama", "gemma"] = "llama",
) -> torch.Tensor:
    """Reference for ``rms_norm`` in plain PyTorch, differentiable, with the same cast points.

    Computed in fp32, or in fp64 when x is fp64 (tests use that as ground truth: with fp64 x and
    weight every cast is exact and the result is the norm itself)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    scale = weight.to(ct) + offset
    if casting == "llama":
        return (normed.to(x.dtype).to(ct) * scale).to(_out_dtype(x.dtype, weight.dtype, casting))
    return (normed * scale).to(x.dtype)
