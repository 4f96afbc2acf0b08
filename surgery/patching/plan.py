"""The plan of one ``patch`` call: every swap the options ask for on a causal LM (or multimodal
wrapper, or text model), built and checked before anything is changed (``surgery.api`` installs
it, all or nothing). What each swap carries is read from the model's ``ArchitectureSpec``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from surgery.attention.forward import (
    BINDING_ATTR,
    AttentionBinding,
    attention_forward,
    attention_forward_for,
    length_dependent,
    mrope_layout,
    read_path,
)
from surgery.attention.linear import (
    LINEAR_ATTENTION_ATTR,
    fla_ready,
    linear_attention_forward,
)
from surgery.attention.mla import mla_attention_forward
from surgery.attention.vision import VISION_ATTENTION_ATTR, vision_attention_forward
from surgery.forwards.base_model import (
    BASE_MODEL_ATTR,
    BaseModelNeeds,
    base_model_forward_for,
    base_model_needs,
)
from surgery.forwards.causal_lm import (
    STATE_ATTR,
    PatchState,
    causal_lm_forward,
    delegating_forward,
    moe_causal_lm_forward,
)
from surgery.forwards.head import LM_HEAD_ATTR, head_linears, lm_head_forward
from surgery.forwards.layers import (
    EMBEDDING_ATTR,
    MLP_ATTR,
    NORM_ATTR,
    embedding_forward,
    gated_mlp_forward_for,
    input_embeddings,
    rms_norm_forward_for,
)
from surgery.forwards.multimodal import language_model, text_model
from surgery.forwards.recompute import RECOMPUTE_ATTR, RecomputePlan
from surgery.forwards.tensor_parallel import (
    TP_LINEAR_ATTR,
    local_shards,
    tensor_parallel_linear_forward,
)
from surgery.models import ArchitectureSpec
from surgery.options import PatchOptions
from surgery.patching.experts_install import batched_experts_swaps
from surgery.patching.foreign import (
    ForeignForwardError,
    foreign_kernel_modules,
    library_of,
    tensor_parallel_forward,
)
from surgery.patching.signature import in_signature_of
from surgery.patching.swap import Swap, plan_swap

__all__ = ["delegates", "plan_lm"]


def _recompute_plan(spec: ArchitectureSpec, options: PatchOptions) -> RecomputePlan | None:
    plan = RecomputePlan(
        norm_output=options.recompute_norm_output
        and options.rms_norm
        and spec.rms_norm is not None,
        mlp_product=options.recompute_mlp_product and options.gated_mlp and spec.mlp is not None,
    )
    return plan if plan.norm_output or plan.mlp_product else None


def _feeds_projections(text: nn.Module, norm: nn.Module) -> bool:
    """A decoder layer's norm over the hidden size (its output goes into projections), not the
    final norm (into the loss) nor a q/k norm (into RoPE). ``text``: the text base model."""
    weight = getattr(norm, "weight", None)
    return (
        norm is not getattr(text, "norm", None)
        and weight is not None
        and weight.shape[-1] == text.config.hidden_size
    )


def _check_not_foreign(lm: nn.Module, spec: ArchitectureSpec) -> None:
    """Refuse a model that another kernel library patched, or whose transformers functions another
    library rebound, before anything is changed."""
    foreign = foreign_kernel_modules(lm)
    if foreign:
        more = len(foreign) - 3
        shown = "; ".join(foreign[:3]) + (f"; and {more} more" if more > 0 else "")
        raise ForeignForwardError(
            f"surgery.patch: {type(lm).__name__} holds modules patched by another kernel "
            f"library: {shown}. surgery and that library replace the same forwards: use one of "
            "them, on a model built without the other's patches. Nothing was changed."
        )
    rebound = spec.rebound_functions()
    if rebound:
        found = ", ".join(
            f"{name} is now {obj.__module__}.{obj.__qualname__} ({library_of(obj)})"
            for name, obj in rebound.items()
        )
        raise ForeignForwardError(
            f"surgery.patch: another library rebound functions of {spec.module} that surgery "
            f"calls ({found}). Liger-Kernel's apply_liger_kernel_to_* does this for the whole "
            "process: run surgery in a process that never applies it. Nothing was changed."
        )


Wanted = list[tuple[str, nn.Module, Callable, dict[str, Any]]]
"""Planned swaps before their checks: (module name, module, generic forward, attributes)."""


def plan_lm(lm: nn.Module, spec: ArchitectureSpec, options: PatchOptions) -> list[Swap]:
    """Every swap ``options`` asks for on ``lm`` (a causal LM, a multimodal wrapper or a text
    model: ``surgery.forwards.multimodal``), checked; nothing is changed yet."""
    _check_not_foreign(lm, spec)
    wrapper = spec.wrapper_of(lm)
    if delegates(lm, spec, wrapper):
        # Llama 4: the language model is the causal LM, patched in full; the wrapper's own
        # forward runs, and hands it the labels.
        state = {STATE_ATTR: PatchState(spec=spec, options=options, wrapper=wrapper)}
        forward = in_signature_of(delegating_forward, type(lm).forward)
        swaps = plan_lm(language_model(lm, wrapper), spec, options)
        swap = plan_swap(lm, forward, state, "")
        return swaps if swap is None else [*swaps, swap]
    text, text_name = text_model(lm, spec)
    plan = _recompute_plan(spec, options)
    prefix = text_name + "." if text_name else ""
    modules = [(prefix + name if name else text_name, m) for name, m in text.named_modules()]
    wanted = [
        *_layer_swaps(text, modules, spec, options, plan),
        *batched_experts_swaps(modules, text.config, spec, options),  # Llama 4's experts
        *_model_swaps(lm, text, text_name, modules, spec, options, wrapper),
    ]
    # A module transformers' tensor parallelism sharded keeps its forward, except the lm_head,
    # whose loss is vocabulary-parallel, and (tensor_parallel_projections) the projections
    # sharded column- or row-wise, which run on their local shards
    # (surgery.forwards.tensor_parallel), as do those torch's parallelize_module sharded so
    # (their layout hooks lifted while patched).
    wanted = [
        w
        for w in wanted
        if w[2] is lm_head_forward or not tensor_parallel_forward(w[1].__dict__.get("forward"))
    ]
    if options.tensor_parallel_projections:
        for name, module in modules:
            shards = local_shards(module)
            if shards is not None:
                extra = {TP_LINEAR_ATTR: shards}
                wanted.append((name, module, tensor_parallel_linear_forward, extra))
    swaps = [
        plan_swap(module, fn, extra, name, _lifted_hooks(extra))
        for name, module, fn, extra in wanted
    ]
    return [swap for swap in swaps if swap is not None]


def _lifted_hooks(extra: dict) -> tuple[tuple[str, int], ...]:
    """The hooks a swap lifts from its module (``Swap.lift``): torch's layout hooks of a
    projection that runs on its local shards (``LocalShards.lifted``)."""
    shards = extra.get(TP_LINEAR_ATTR)
    return () if shards is None else tuple((table, key) for table, key, _ in shards.lifted)


def _layer_swaps(
    text: nn.Module,
    modules: list[tuple[str, nn.Module]],
    spec: ArchitectureSpec,
    options: PatchOptions,
    plan: RecomputePlan | None,
) -> Wanted:
    """The decoder layers' swaps the options ask for: attention, RMSNorm, input embedding,
    gated MLP, and (always) the linear attention of a hybrid."""
    norm_plan = {RECOMPUTE_ATTR: plan} if plan is not None and plan.norm_output else {}
    wanted: Wanted = []
    if options.rope:
        binding = AttentionBinding(
            spec=spec,
            rotary=getattr(text, spec.rotary_attr),
            eager_attention=spec.eager_attention(),
            fallback_rope=spec.rotary_pos_emb(),
            share_mask=options.share_attention_mask,
            lean_eager=options.eager_attention_recompute and spec.eager_softmax_fp32,
            flex=options.flex_attention,
            mrope=mrope_layout(getattr(text, spec.rotary_attr)) if spec.mrope else None,
        )
        generic = mla_attention_forward if spec.latent_attention else attention_forward
        for name, module in modules:
            if spec.is_instance(module, spec.attention):
                extra = {BINDING_ATTR: binding, **norm_plan}
                wanted.append((name, module, attention_forward_for(module, generic), extra))
    if options.rms_norm and spec.rms_norm is not None:
        for name, module in modules:
            if spec.is_instance(module, spec.rms_norm):
                extra = {NORM_ATTR: spec.rms_norm_style}
                if _feeds_projections(text, module):
                    extra.update(norm_plan)
                wanted.append((name, module, rms_norm_forward_for(module), extra))
    embeddings = input_embeddings(text) if options.embedding_backward else []
    for name, module in modules:
        if any(module is e for e in embeddings):
            wanted.append((name, module, embedding_forward, {EMBEDDING_ATTR: True}))
    if options.gated_mlp and spec.mlp is not None:
        wanted += _mlp_swaps(text, modules, spec, plan)
    if spec.linear_attention is not None:
        # Not an option: without it a packed batch carries state across its documents.
        for name, module in modules:
            if spec.is_instance(module, spec.linear_attention):
                extra = {LINEAR_ATTENTION_ATTR: fla_ready(module)}
                wanted.append((name, module, linear_attention_forward, extra))
    return wanted


def _mlp_swaps(
    text: nn.Module,
    modules: list[tuple[str, nn.Module]],
    spec: ArchitectureSpec,
    plan: RecomputePlan | None,
) -> Wanted:
    """The dense gated MLPs' swaps (none, with a warning, for an activation without a kernel)."""
    activation = spec.gated_activation(text.config)
    if activation is None:
        warnings.warn(
            f"surgery: no fused kernel for the MLP activation "
            f"{getattr(text.config, spec.mlp_activation_attr, None)!r}; the MLPs keep their "
            "own forward",
            stacklevel=5,  # the caller of patch
        )
        return []
    wanted: Wanted = []
    for name, module in modules:
        if spec.is_instance(module, spec.mlp) and not spec.mlp_sparsity(module):
            extra = {MLP_ATTR: activation}
            if plan is not None:
                extra[RECOMPUTE_ATTR] = plan
            wanted.append((name, module, gated_mlp_forward_for(module), extra))
    return wanted


def _model_swaps(
    lm: nn.Module,
    text: nn.Module,
    text_name: str,
    modules: list[tuple[str, nn.Module]],
    spec: ArchitectureSpec,
    options: PatchOptions,
    wrapper,
) -> Wanted:
    """The swaps above the layers: the Qwen-VL vision tower's attention, the base model's
    forward (where its layers need something of the whole batch), the lm_head and the causal
    LM's (or wrapper's) forward carrying the ``PatchState``."""
    wanted: Wanted = []
    if options.varlen_attention and wrapper is not None and wrapper.vision_attention:
        for name, module in lm.named_modules():  # the Qwen-VL vision tower's
            if wrapper.is_vision_attention(module):
                extra = {VISION_ATTENTION_ATTR: True}
                wanted.append((name, module, vision_attention_forward, extra))
    needs = base_model_needs(spec, options)
    rotary = getattr(text, spec.rotary_attr, None)
    padding_free = _padding_free(spec, options, wrapper, needs, modules, rotary)
    state = {
        STATE_ATTR: PatchState(
            spec=spec, options=options, wrapper=wrapper, padding_free=padding_free
        )
    }
    if text is lm:  # a text model on its own: no head; its forward carries the state
        extra = {BASE_MODEL_ATTR: needs or BaseModelNeeds(False, False, False), **state}
        wanted.append(("", lm, base_model_forward_for(lm), extra))
        return wanted
    if needs is not None:  # Llama 4's position ids, a hybrid's documents
        base = base_model_forward_for(text)
        wanted.append((text_name, text, base, {BASE_MODEL_ATTR: needs}))
    if options.fused_linear_cross_entropy:
        names = {id(m): n for n, m in lm.named_modules()}
        for head in head_linears(lm):
            wanted.append((names[id(head)], head, lm_head_forward, {LM_HEAD_ATTR: True}))
    forward = moe_causal_lm_forward if spec.router_aux_loss else causal_lm_forward
    if wrapper is not None:  # the wrapper's arguments, in its order
        forward = in_signature_of(forward, type(lm).forward)
    wanted.append(("", lm, forward, state))
    return wanted


def _padding_free(
    spec: ArchitectureSpec,
    options: PatchOptions,
    wrapper,
    needs: BaseModelNeeds | None,
    modules: list[tuple[str, nn.Module]],
    rotary: nn.Module | None,
) -> bool:
    """Whether a right-padded training batch of this model may run padding-free
    (``PatchOptions.padding_free``, ``surgery.attention.unpadding``): the option and what it rests
    on (``causal_right_padding``; ``rope``, whose attention forward pads again) are on, and no layer
    reads the layout beyond the attention: the architecture's (``ArchitectureSpec.
    row_layout_free``), no base-model forward of surgery's or multimodal wrapper, no sliding
    window, no RoPE whose frequencies follow the sequence's length (``length_dependent``: the
    one row is longer than the batch's). Decided at patch time."""
    if not (options.padding_free and options.causal_right_padding and options.rope):
        return False
    if wrapper is not None or needs is not None:
        return False
    if length_dependent(rotary):
        return False
    if not spec.row_layout_free:
        return False
    attentions = [m for _, m in modules if spec.is_instance(m, spec.attention)]
    windows = [path for name, path in spec.attention_kwargs if name == "sliding_window"]
    return bool(attentions) and not any(
        read_path(m, path) is not None for m in attentions for path in windows
    )


def delegates(lm: nn.Module, spec: ArchitectureSpec, wrapper) -> bool:
    """Whether ``lm`` is a multimodal wrapper whose language model is the causal LM (Llama 4):
    its patched forward is ``delegating_forward``, which hands the labels down. That forward
    serves no TRL fused head (``surgery.integrations.trl``): TRL's own head runs there."""
    return wrapper is not None and spec.is_instance(language_model(lm, wrapper), spec.causal_lm)
