"""Which experts modules ``surgery.forwards.experts`` fuses, choosing its implementation in
transformers' ``ExpertsInterface`` on ``patch`` and restoring the previous one on ``unpatch``, and
what ``surgery.describe`` says of them. The implementations themselves are in
``surgery.forwards.experts``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from surgery.forwards import experts
from surgery.forwards.experts import (
    ALL_EXPERTS_FUNCTIONS,
    EXPERTS_AUTO,
    EXPERTS_PLAN_ATTR,
    SURGERY_EXPERTS,
    ExpertsInterface,
    ExpertsPlan,
    batched_experts_forward,
    fused_grouped_mm_experts_forward,
)

if TYPE_CHECKING:
    from surgery.models import ArchitectureSpec
    from surgery.options import PatchOptions

__all__ = [
    "batched_experts_left_alone",
    "batched_experts_swaps",
    "describe_batched_experts",
    "describe_experts",
    "experts_modules",
    "install_experts",
    "restore_experts",
    "unfusable_reason",
]

PREVIOUS_ATTR = "_surgery_experts_implementation"
"""Instance attribute of the patched causal LM: the experts implementation before ``patch``."""


def _register() -> None:
    if ALL_EXPERTS_FUNCTIONS.get(SURGERY_EXPERTS) is not fused_grouped_mm_experts_forward:
        # A new name in transformers' registry (its public ``register``): no existing name changes.
        ExpertsInterface.register(SURGERY_EXPERTS, fused_grouped_mm_experts_forward)


def experts_modules(lm: nn.Module) -> list[nn.Module]:
    """The experts modules of ``lm`` that dispatch through transformers' experts implementations
    (their class decorated with ``use_experts_implementation``, which sets these attributes)."""
    return [
        m
        for m in lm.modules()
        if "has_gate" in m.__dict__ and "is_concatenated" in m.__dict__ and hasattr(m, "config")
    ]


def _is_default_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    return (
        getattr(gate, "__module__", None) == "transformers.integrations.moe"
        and getattr(gate, "__qualname__", None) == "_default_apply_gate"
    )


def unfusable_reason(module: nn.Module, spec: ArchitectureSpec | None) -> str | None:
    """Why ``fused_grouped_mm_experts_forward`` cannot fuse ``module``'s activation (None: it can).
    Fused exactly: gate and up concatenated in ``gate_up_proj`` without biases, transformers'
    default gate ``act_fn(gate) * up``, no norm after the experts, an activation with a kernel."""
    if spec is None:
        return "outside the registry"
    if experts._grouped_linear is None:
        return (
            "this transformers has no _grouped_linear(input, weight, offs, bias, is_transposed) "
            "and _can_use_grouped_mm(input, weight, offs)"
        )
    if not module.__dict__.get("has_gate", False):
        return "experts without a gate"
    if module.__dict__.get("has_bias", False):
        return "experts with biases"
    if not module.__dict__.get("is_concatenated", True):
        return "interleaved gate/up layout"
    if module.__dict__.get("has_post_expert_norm", False):
        return "a norm after each expert"
    if not _is_default_gate(module):
        return "a gate function of its own (_apply_gate)"
    return _activation_reason(module, module.config, spec)


def _activation_reason(module: nn.Module, config, spec: ArchitectureSpec) -> str | None:
    """Why ``module.act_fn`` has no fused kernel (None: it has), ``config`` naming it."""
    name = getattr(config, spec.mlp_activation_attr, None)
    if spec.gated_activation(config) is None:
        return f"no gated_activation kernel for {name!r}"
    from transformers.activations import ACT2FN

    if type(getattr(module, "act_fn", None)) is not type(ACT2FN[name]):
        return f"act_fn is not transformers' {name!r}"
    return None


def batched_experts_swaps(
    modules: list[tuple[str, nn.Module]], config, spec: ArchitectureSpec, options: PatchOptions
) -> list[tuple[str, nn.Module, Callable, dict[str, Any]]]:
    """(name, module, ``batched_experts_forward``, its plan) for each of ``modules`` (a text
    model's, ``config`` its config) that is ``spec.batched_experts`` with an activation of a
    kernel, when ``options.experts_implementation`` asks for surgery's experts (``"auto"`` or
    ``SURGERY_EXPERTS``, which warns about those left with their own forward)."""
    if spec.batched_experts is None or options.experts_implementation not in (
        EXPERTS_AUTO,
        SURGERY_EXPERTS,
    ):
        return []
    reasons = {
        name: _activation_reason(module, config, spec)
        for name, module in modules
        if spec.is_instance(module, spec.batched_experts)
    }
    left = set(reasons.values()) - {None}
    if left and options.experts_implementation == SURGERY_EXPERTS:
        warnings.warn(
            f"surgery: experts_implementation={SURGERY_EXPERTS!r} leaves {spec.batched_experts} "
            f"with transformers' forward ({'; '.join(sorted(left))})",
            stacklevel=5,
        )
    plan = ExpertsPlan(spec.gated_activation(config), options.recompute_mlp_product)
    return [
        (name, module, batched_experts_forward, {EXPERTS_PLAN_ATTR: plan})
        for name, module in modules
        if name in reasons and reasons[name] is None
    ]


def _batched(lm: nn.Module, spec: ArchitectureSpec | None) -> bool:
    return (
        spec is not None
        and spec.batched_experts is not None
        and any(spec.is_instance(m, spec.batched_experts) for m in lm.modules())
    )


def _expert_parallel(lm: nn.Module) -> bool:
    distributed = getattr(lm.config, "distributed_config", None)
    return bool(getattr(distributed, "enable_expert_parallel", False))


def _current(lm: nn.Module) -> dict[str, str | None]:
    get = getattr(lm, "get_experts_implementation", None)
    return get() if get is not None else {"": lm.config._experts_implementation}


def install_experts(lm: nn.Module, spec: ArchitectureSpec | None, options: PatchOptions) -> bool:
    """Set the experts implementation ``options.experts_implementation`` asks for on ``lm`` and mark
    the modules ``SURGERY_EXPERTS`` fuses; the previous implementation is kept for
    ``restore_experts``. Returns whether this call changed an unchanged model (what
    ``restore_experts`` would undo). Raises (nothing changed) for a name transformers does not
    know, or ``SURGERY_EXPERTS`` asked of a model without experts implementations."""
    requested = options.experts_implementation
    fresh = PREVIOUS_ATTR not in lm.__dict__
    if requested is None:
        return False
    experts = experts_modules(lm) if ExpertsInterface is not None else []
    if not experts:
        if requested == EXPERTS_AUTO or (requested == SURGERY_EXPERTS and _batched(lm, spec)):
            return False  # batched experts get a swapped forward (``batched_experts_swaps``)
        if not hasattr(lm, "set_experts_implementation") or requested == SURGERY_EXPERTS:
            raise ValueError(
                f"experts_implementation={requested!r}: {type(lm).__name__} has no experts "
                "implementations to choose from (not a mixture-of-experts model of transformers 5 "
                "whose experts dispatch through them)"
            )
    previous = lm.__dict__.get(PREVIOUS_ATTR) or _current(lm)
    plans = {}
    if requested in (EXPERTS_AUTO, SURGERY_EXPERTS) and not _expert_parallel(lm):
        for module in experts:
            if unfusable_reason(module, spec) is None:
                activation = spec.gated_activation(module.config)
                plans[module] = ExpertsPlan(activation, options.recompute_mlp_product)
    if requested == EXPERTS_AUTO:
        # Every (sub)model running grouped_mm gets surgery's; any other choice is kept.
        target: str | dict = {
            key: SURGERY_EXPERTS if value == "grouped_mm" else value
            for key, value in previous.items()
        }
        if not plans or SURGERY_EXPERTS not in target.values():
            return False  # nothing to fuse: the model's own implementation
    else:
        target = requested
    if SURGERY_EXPERTS in (target.values() if isinstance(target, dict) else (target,)):
        _register()
        if not plans:
            reasons = sorted({unfusable_reason(m, spec) or "expert parallel" for m in experts})
            warnings.warn(
                f"surgery: experts_implementation={SURGERY_EXPERTS!r} fuses none of "
                f"{type(lm).__name__}'s experts ({'; '.join(reasons)}): they run transformers' "
                "grouped_mm",
                stacklevel=4,
            )
    lm.set_experts_implementation(target)  # raises on a name transformers does not know
    lm.__dict__[PREVIOUS_ATTR] = previous
    for module, plan in plans.items():
        if module.config._experts_implementation == SURGERY_EXPERTS:
            module.__dict__[EXPERTS_PLAN_ATTR] = plan
    return fresh


def restore_experts(lm: nn.Module) -> None:
    """Undo ``install_experts``: the previous implementation, no marks."""
    for module in lm.modules():
        module.__dict__.pop(EXPERTS_PLAN_ATTR, None)
    previous = lm.__dict__.pop(PREVIOUS_ATTR, None)
    if previous is not None:
        lm.set_experts_implementation(previous)


def describe_batched_experts(plan: ExpertsPlan) -> str:
    """For ``surgery.describe``: what ``batched_experts_forward`` runs under ``plan``."""
    return (
        f"batched experts: transformers' bmm GEMMs, gated_activation_merged ({plan.activation}) "
        "between them" + (", product recomputed in the backward" if plan.recompute_product else "")
    )


def batched_experts_left_alone(
    module: nn.Module, config, spec: ArchitectureSpec, options: PatchOptions
) -> str:
    """For ``surgery.describe``: why ``batched_experts_swaps`` left ``module`` its own forward."""
    if options.experts_implementation not in (EXPERTS_AUTO, SURGERY_EXPERTS):
        return f"experts_implementation={options.experts_implementation!r}: transformers' own"
    return f"transformers' own; not fusable: {_activation_reason(module, config, spec)}"


def describe_experts(module: nn.Module, spec: ArchitectureSpec | None) -> tuple[bool, str] | None:
    """For ``surgery.describe``: (fused?, what runs) for an experts module, None for others."""
    if "has_gate" not in module.__dict__ or not hasattr(module, "config"):
        return None
    implementation = module.config._experts_implementation
    plan: ExpertsPlan | None = module.__dict__.get(EXPERTS_PLAN_ATTR)
    if implementation == SURGERY_EXPERTS and plan is not None:
        what = (
            f"experts {SURGERY_EXPERTS!r}: transformers' grouped GEMMs, gated_activation_merged "
            f"({plan.activation}) between them; gathered rows"
            + (" and product" if plan.recompute_product else "")
            + " recomputed in the backward; the down GEMM's output not kept"
        )
        return True, what
    reason = unfusable_reason(module, spec)
    why = f"; not fusable: {reason}" if reason else ""
    if implementation == SURGERY_EXPERTS:
        return False, f"experts {SURGERY_EXPERTS!r} unfused: transformers' grouped_mm{why}"
    return False, f"experts implementation {implementation!r}: transformers' own{why}"
