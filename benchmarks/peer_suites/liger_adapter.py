"""Liger-Kernel's own tests of its cross entropy, fused linear cross entropy, RMSNorm, SwiGLU
and RoPE, run against surgery's kernels: a pytest plugin that puts surgery's kernels behind
Liger's autograd functions, so that Liger's public wrappers (``liger_fused_linear_cross_entropy``,
``LigerFusedLinearCrossEntropyLoss``, ``liger_cross_entropy``, ``LigerCrossEntropyLoss``,
``LigerRMSNorm``, ``LigerSwiGLUMLP`` and its experts, ``liger_rotary_pos_emb``, ...) and its tests
run unchanged over our kernels.

    bash benchmarks/peer_suites/run_liger.sh LIGER_CHECKOUT OUT   # see there

Liger's tests are not in this repository (they are Liger's); the runner copies them from a Liger
checkout and loads this module with ``-p liger_adapter``.

What is replaced: ``LigerFusedLinearCrossEntropyFunction``, ``LigerCrossEntropyFunction``,
``LigerRMSNormFunction``, ``LigerSiLUMulFunction`` and ``LigerRopeFunction``, wherever a Liger
module holds them, by objects whose ``apply`` takes Liger's arguments and returns what Liger's
returns: the losses' ``(loss, z_loss, token_accuracy, predicted_tokens)`` computed by surgery's
``linear_cross_entropy_statistics`` and ``cross_entropy_statistics``, and ``rms_norm``,
``gated_activation`` and ``apply_rotary_pos_emb`` (``surgery.kernels``).
Liger's semantics, as its kernels define them: the loss includes the z-loss term; ``z_loss`` is
that term alone, reduced as the loss; ``token_accuracy`` is the fraction of tokens with a target
whose target is the first maximum (per token, 0 or 1, under reduction "none");
``predicted_tokens`` the first maximum's column per token, -1 where there is no target. Its
cross entropy over given logits returns the loss and z-loss in the logits' dtype (ours in fp32,
rounded once here); its fused head returns an fp32 loss, as ours. A label outside [0, V) that is
not ``ignore_index`` raises Liger's ``AssertionError`` ("out of bounds"): ours raises a
``ValueError`` on CPU and, on a GPU, flags it without a host sync for ``check_labels()``, which
the adapter calls after each call to report it as Liger does.

What our kernels do not have is refused as a skip with the reason, never approximated: class
weights (``ce_weight``, ``weight``), Liger's token scaling, RMSNorm's casting mode "none" (ours
computes in fp32), SwiGLU's gate and down multipliers, cos/sin given at half the rotary width, and
tests that call or patch Liger's own kernels (they test Liger, not the function replaced). What
only picks Liger's implementation (RMSNorm's ``in_place``, ``row_mode``) is ignored.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common

from common import import_surgery

kernels = import_surgery().kernels

LIGER_INTERNALS = (
    "liger_cross_entropy_kernel",
    "element_mul_kernel",
    "swiglu_ops",
    "LigerExperts",  # its forward is Liger's fused MoE kernel (LigerFusedMoEFunction), not SiLU-mul
)
"""Names through which a test runs or patches Liger's own kernels, which are not replaced: such a
test tests Liger."""


def _names_used(code, namespace: dict | None = None, seen: set | None = None) -> set[str]:
    """The global and attribute names a code object, the functions nested in it and, given the
    test module's ``namespace``, the module's own functions it calls (at any depth) refer to (not
    docstrings or comments)."""
    seen = set() if seen is None else seen
    seen.add(code)
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const) and const not in seen:
            names |= _names_used(const, namespace, seen)
    for name in code.co_names if namespace is not None else ():
        helper = namespace.get(name)
        own = inspect.isfunction(helper) and helper.__globals__ is namespace
        if own and helper.__code__ not in seen:
            names |= _names_used(helper.__code__, namespace, seen)
    return names


def _asked(token_accuracy: bool, predicted_tokens: bool) -> tuple[str, ...]:
    """Our statistics behind Liger's two per-token outputs."""
    return ("is_top1",) * bool(token_accuracy) + ("predicted",) * bool(predicted_tokens)


def _liger_statistics(named: dict, target, ignore_index: int, reduction: str) -> tuple:
    """Liger's ``(token_accuracy, predicted_tokens)`` from our statistics (None where not asked):
    the accuracy per token under reduction "none", else the fraction over the tokens with a
    target (Liger counts ``target != ignore_index``)."""
    accuracy = None
    if "is_top1" in named:
        accuracy = named["is_top1"].to(torch.float32)
        if reduction != "none":
            accuracy = accuracy.sum() / (target != ignore_index).sum()
    return accuracy, named.get("predicted")


def _as_liger_errors(call):
    """``call()``, then our label check; a label out of range raised as Liger raises it."""
    try:
        out = call()
        kernels.check_labels()  # the flag a GPU call sets instead of reading labels on the host
    except ValueError as e:
        if "outside [0," not in str(e):
            raise
        raise AssertionError(f"target out of bounds: {e}") from e
    return out


def fused_linear_cross_entropy(
    _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
    label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
    use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, *_rest,
):  # fmt: skip
    """``LigerFusedLinearCrossEntropyFunction.apply``'s contract over surgery's fused head.
    ``accum_dtype``: our weight gradient is accumulated in fp32 whatever is asked (Liger's
    fp32 option); ``_rest``: Liger's implementation selectors and chunk budget, not ours."""
    if ce_weight is not None:
        pytest.skip("surgery's fused head has no class weights (ce_weight)")
    if use_token_scaling:
        pytest.skip("surgery's fused head has no token scaling (use_token_scaling)")
    statistics = _asked(return_token_accuracy, return_predicted_tokens)
    out, named = _as_liger_errors(lambda: kernels.linear_cross_entropy_statistics(
        _input, weight, target, bias, statistics=statistics, ignore_index=ignore_index,
        reduction=reduction, z_loss_scale=float(lse_square_scale),
        label_smoothing=float(label_smoothing), softcap=softcap,
    ))  # fmt: skip
    z_loss = out.z_loss if return_z_loss else None
    return out.loss, z_loss, *_liger_statistics(named, target, ignore_index, reduction)


def cross_entropy(
    _input, target, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
    reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
    return_predicted_tokens=False,
):  # fmt: skip
    """``LigerCrossEntropyFunction.apply``'s contract over
    ``surgery.kernels.cross_entropy_statistics``."""
    if weight is not None:
        pytest.skip("surgery's cross entropy has no class weights (weight)")
    statistics = _asked(return_token_accuracy, return_predicted_tokens)
    out, named = _as_liger_errors(lambda: kernels.cross_entropy_statistics(
        _input, target, statistics=statistics, ignore_index=ignore_index, reduction=reduction,
        z_loss_scale=float(lse_square_scale), label_smoothing=float(label_smoothing),
        softcap=softcap,
    ))  # fmt: skip
    z_loss = out.z_loss.to(_input.dtype) if return_z_loss else None
    return (out.loss.to(_input.dtype), z_loss,
            *_liger_statistics(named, target, ignore_index, reduction))  # fmt: skip


def rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
    """``LigerRMSNormFunction.apply``'s contract over ``surgery.kernels.rms_norm``; without a
    weight (Liger's ``elementwise_affine=False``) the scale is exactly 1."""
    if casting_mode not in ("llama", "gemma"):
        pytest.skip(f"surgery's RMSNorm has no casting mode {casting_mode!r} (it computes in fp32)")
    if W is None:  # offset + (1 - offset) is 1 exactly for Liger's offsets, 0 and 1
        W = torch.full(X.shape[-1:], 1.0 - offset, dtype=X.dtype, device=X.device)
    return kernels.rms_norm(X, W, eps, offset, casting_mode)


def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0):
    """``LigerSiLUMulFunction.apply``'s contract over ``surgery.kernels.gated_activation``."""
    if float(gate_multiplier) != 1.0 or float(down_multiplier) != 1.0:
        pytest.skip("surgery's gated activation has no gate or down multipliers")
    return kernels.gated_activation(a, b, "silu")


def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """``LigerRopeFunction.apply``'s contract over ``surgery.kernels.apply_rotary_pos_emb``: cos
    and sin of 2, 3 or 4 dimensions as Liger reads them (``position_ids``, unused by Liger too)."""
    if cos.ndim == 4:  # the singleton head axis out, where Liger looks for it
        axis = unsqueeze_dim if cos.shape[unsqueeze_dim] == 1 else 1
        cos, sin = cos.squeeze(axis), sin.squeeze(axis)
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if rotary_dim is not None and rotary_dim != cos.shape[-1]:
        pytest.skip("surgery's RoPE takes cos/sin over the whole rotary width (rotary_dim given)")
    return kernels.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _stand_in(liger_name: str, apply, **attributes) -> type:
    """A class standing where Liger's ``liger_name`` stood, its ``apply`` ours."""
    doc = f"Stands where ``{liger_name}`` stood."
    return type(liger_name, (), {"__doc__": doc, "apply": staticmethod(apply), **attributes})


SurgeryRMSNorm = _stand_in("LigerRMSNormFunction", rms_norm)
SurgerySiLUMul = _stand_in("LigerSiLUMulFunction", silu_mul)
SurgeryRope = _stand_in("LigerRopeFunction", rope)
SurgeryFusedLinearCrossEntropy = _stand_in(
    "LigerFusedLinearCrossEntropyFunction",
    fused_linear_cross_entropy,
    supports_inner_impl_dispatch=False,  # Liger's wrapper then passes its 15 arguments
)
SurgeryCrossEntropy = _stand_in("LigerCrossEntropyFunction", cross_entropy)


LIGER_MODULES = (
    "liger_kernel.ops",
    "liger_kernel.transformers.cross_entropy",
    "liger_kernel.transformers.functional",
    "liger_kernel.transformers.fused_linear_cross_entropy",
    "liger_kernel.transformers.rms_norm",
    "liger_kernel.transformers.rope",
    "liger_kernel.transformers.swiglu",
)
"""Liger's modules that hold the functions (and the wrappers that call them)."""

REPLACED = {
    "LigerFusedLinearCrossEntropyFunction": SurgeryFusedLinearCrossEntropy,
    "LigerCrossEntropyFunction": SurgeryCrossEntropy,
    "LigerRMSNormFunction": SurgeryRMSNorm,
    "LigerSiLUMulFunction": SurgerySiLUMul,
    "LigerRopeFunction": SurgeryRope,
}


def install() -> list[str]:
    """Put ours wherever a loaded Liger module holds Liger's functions; returns the
    ``module.name`` places replaced."""
    for name in LIGER_MODULES:
        importlib.import_module(name)
    originals = {name: getattr(sys.modules["liger_kernel.ops"], name) for name in REPLACED}
    places = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("liger_kernel") or module is None:
            continue
        for name, ours in REPLACED.items():
            if getattr(module, name, None) is originals[name]:
                setattr(module, name, ours)
                places.append(f"{module_name}.{name}")
    return places


_PLACES = pytest.StashKey[list]()


def pytest_configure(config):
    places = install()
    missing = [n for n in REPLACED if f"liger_kernel.transformers.functional.{n}" not in places]
    if missing:  # the wrappers the tests call would still run Liger's kernels
        raise pytest.UsageError(f"this Liger's functional wrappers do not call {missing}")
    config.stash[_PLACES] = places


def pytest_report_header(config):
    return f"surgery liger_adapter: replaced {', '.join(config.stash[_PLACES])}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        code = getattr(fn, "__code__", None)
        names = _names_used(code, fn.__globals__) if code is not None else set()
        used = [name for name in LIGER_INTERNALS if name in names]
        if used:
            item.add_marker(pytest.mark.skip(reason=f"runs Liger's own kernel ({used[0]})"))
