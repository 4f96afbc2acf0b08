"""``patch`` / ``unpatch`` / ``patched`` on one model instance (``surgery.apply``: the same for the
models of a class built afterwards).

Patching replaces the forward of each module it patches by one of the generic forwards, bound to
the module (``types.MethodType``), and keeps what it replaced to restore. It adds no parameters,
buffers or submodules: what a patched forward needs lives in plain attributes of the instance's
``__dict__``. Modules are matched by transformers' own classes (``ArchitectureSpec.is_instance``).
``patch`` is all or nothing: every swap is planned and checked first (signatures, forwards other
code installed: see ``surgery.patching.foreign``), then installed; a failure while installing undoes
the swaps already made. accelerate's hooks and mixed-precision wrapper are kept around the patched
forward; other libraries' forwards are refused. A causal LM outside the registry is patched only
when asked (``fallback="loss"``): the fused loss alone, proven at patch time
(``surgery.patching.fallback``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn

from surgery.forwards.causal_lm import (
    STATE_ATTR,
)
from surgery.integrations.trl import REQUEST_ATTR as TRL_REQUEST_ATTR
from surgery.integrations.trl import serve_fused_head
from surgery.models import ArchitectureSpec
from surgery.options import OPTIONS, PatchOptions, loss_only_options
from surgery.patching.experts_install import install_experts, restore_experts
from surgery.patching.fallback import (
    FALLBACK_ATTR,
    FALLBACKS,
    causal_lm_of,
    fallback_patched_lm,
    find_fallback_lm,
    plan_loss_fallback,
    prove_loss_fallback,
)
from surgery.patching.plan import delegates, plan_lm
from surgery.patching.registry import UnsupportedModelError, find_causal_lm
from surgery.patching.swap import Swap, apply_swaps, restore_swap

__all__ = [
    "is_patched",
    "patch",
    "patch_options",
    "patched",
    "unpatch",
]

M = TypeVar("M", bound=nn.Module)

ACCEPTS_ATTR = "_surgery_accepts_loss_kwargs"
TRL_HOOK_ATTR = "_surgery_trl_hook"
"""The patched causal LM's handle of its ``serve_fused_head`` pre-hook, removed by ``unpatch``."""


def _install(
    lm: nn.Module,
    swaps: list[Swap],
    options: PatchOptions,
    spec: ArchitectureSpec | None = None,
) -> None:
    """Install the planned ``swaps`` on ``lm`` (registry, or fallback: ``spec`` None), all or
    nothing."""
    experts_changed = install_experts(lm, spec, options)  # see surgery.forwards.experts
    try:
        apply_swaps(swaps)
    except BaseException:
        if experts_changed:
            restore_experts(lm)
        raise
    serves_trl = spec is not None and not delegates(lm, spec, spec.wrapper_of(lm))
    if serves_trl and TRL_HOOK_ATTR not in lm.__dict__:
        lm.__dict__[TRL_HOOK_ATTR] = lm.register_forward_pre_hook(
            serve_fused_head, with_kwargs=True
        )
    if options.loss_reduction == "sequence" and ACCEPTS_ATTR not in lm.__dict__:
        # num_items_in_batch counts tokens across the accumulated batch; a per-sequence mean cannot
        # use it. With accepts_loss_kwargs False the HF Trainer passes none and divides each
        # micro-batch's loss by the number of accumulation steps.
        lm.__dict__[ACCEPTS_ATTR] = (
            "accepts_loss_kwargs" in lm.__dict__,
            lm.__dict__.get("accepts_loss_kwargs"),
        )
        lm.__dict__["accepts_loss_kwargs"] = False


def _unpatch_lm(lm: nn.Module) -> None:
    for module in lm.modules():
        restore_swap(module)
    restore_experts(lm)
    hook = lm.__dict__.pop(TRL_HOOK_ATTR, None)
    if hook is not None:
        hook.remove()
    lm.__dict__.pop(TRL_REQUEST_ATTR, None)
    if ACCEPTS_ATTR in lm.__dict__:
        had, value = lm.__dict__.pop(ACCEPTS_ATTR)
        if had:
            lm.__dict__["accepts_loss_kwargs"] = value
        else:
            lm.__dict__.pop("accepts_loss_kwargs", None)


def patch(
    model: M,
    *,
    rope: bool = True,
    fused_linear_cross_entropy: bool = True,
    loss_reduction: str = "mean",
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    return_logits: bool = False,
    rms_norm: bool = True,
    gated_mlp: bool = True,
    embedding_backward: bool = True,
    recompute_mlp_product: bool = True,
    recompute_norm_output: bool = True,
    loss_low_memory: bool = False,
    loss_chunk_bytes: int | None = None,
    loss_skip_ignored: bool = True,
    share_attention_mask: bool = True,
    causal_right_padding: bool = True,
    padding_free: bool = True,
    eager_attention_recompute: bool = True,
    varlen_attention: bool = True,
    flex_attention: bool = True,
    experts_implementation: str | None = "auto",
    tensor_parallel_projections: bool = True,
    fallback: str | None = None,
    strict: bool = True,
) -> M:
    """Patch ``model`` in place and return it (the same object).

    ``model`` is a supported transformers causal LM, or anything containing one (a ``PeftModel``).
    The options are ``surgery.options.OPTIONS`` (``docs/options.md``). Patching again with the
    same options leaves what is patched as it is and patches what appeared since (an lm_head copy
    PEFT added, projections torch's ``parallelize_module`` sharded); with other options the model
    is unpatched and patched anew. An unsupported model raises
    ``UnsupportedModelError`` naming the supported architectures, or with ``strict=False`` warns
    and returns the model untouched.

    ``fallback="loss"``: a causal LM outside the registry gets the fused loss alone (its lm_head
    and causal-LM forwards; attention, norms and MLPs keep their own, and the options acting on
    them are off: ``surgery.options.loss_only_options``), once a probe has shown that the fused
    loss computes exactly what its forward computes (``surgery.patching.fallback``). A model that
    fails the probe raises ``FallbackRefusedError`` (an ``UnsupportedModelError``) saying what
    differed, or with ``strict=False`` warns and is left untouched. A supported model ignores
    ``fallback``.
    """
    given = locals()  # the keyword options: OPTIONS, in this signature's order (a test holds it)
    if fallback is not None and fallback not in FALLBACKS:
        raise ValueError(f"fallback must be None or one of {FALLBACKS}, got {fallback!r}")
    options = PatchOptions(**{option.name: given[option.name] for option in OPTIONS})
    try:
        lm, spec = find_causal_lm(model)
        plan = functools.partial(plan_lm, lm, spec)
    except UnsupportedModelError as err:
        spec = None
        try:
            if fallback is None:
                raise UnsupportedModelError(
                    f"{err}; surgery.patch(model, fallback='loss') patches the fused loss alone on "
                    "a standard causal LM"
                ) from None
            lm, plan, options = _loss_fallback(model, options)
        except UnsupportedModelError as refused:
            if strict:
                raise
            warnings.warn(f"{refused}; the model is left unpatched", stacklevel=2)
            return model
    state = lm.__dict__.get(STATE_ATTR)
    if state is not None and state.options != options:
        _unpatch_lm(lm)
        try:
            _install(lm, plan(options), options, spec)
        except BaseException:
            _install(lm, plan(state.options), state.options, spec)  # as it was: all or nothing
            raise
    else:
        _install(lm, plan(options), options, spec)
    return model


def _loss_fallback(
    model: nn.Module, options: PatchOptions
) -> tuple[nn.Module, Callable[[PatchOptions], list[Swap]], PatchOptions]:
    """The causal LM in ``model`` that ``fallback="loss"`` patches, its planner and its options.
    The probe runs on the unpatched model, once: a model the fallback already patched keeps what
    its probe found."""
    lm = fallback_patched_lm(model)
    if lm is None:
        lm = find_fallback_lm(model)
    proof = lm.__dict__.get(FALLBACK_ATTR)
    if proof is None:
        proof = prove_loss_fallback(lm)
    return lm, functools.partial(plan_loss_fallback, lm, proof), loss_only_options(options)


def unpatch(model: M) -> M:
    """Restore every forward that ``patch`` replaced (the original objects) and return ``model``.
    A model that is not patched is returned as it is."""
    lm = causal_lm_of(model)
    if lm is not None:
        _unpatch_lm(lm)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` (or the causal LM inside it) is patched."""
    lm = causal_lm_of(model)
    return lm is not None and STATE_ATTR in lm.__dict__


def patch_options(model: nn.Module) -> PatchOptions | None:
    """The options ``model`` is patched with (after ``fallback="loss"``: those in force, see
    ``loss_only_options``), or None."""
    lm = causal_lm_of(model)
    state = None if lm is None else lm.__dict__.get(STATE_ATTR)
    return None if state is None else state.options


@contextmanager
def patched(model: M, **options: Any) -> Iterator[M]:
    """``with surgery.patched(model, **options):`` patches for the block, then puts back what was
    there before (unpatched, or patched with its previous options)."""
    previous = patch_options(model)
    was_fallback = fallback_patched_lm(model) is not None
    patch(model, **options)
    try:
        yield model
    finally:
        unpatch(model)
        if previous is not None:
            again = {"fallback": "loss"} if was_fallback else {}
            patch(model, **dataclasses.asdict(previous), **again)
