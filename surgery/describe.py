"""``surgery.describe(model)``: what ``patch`` swapped on a model, what it left alone and why, and
the options in force.

It reads what the patch installed (each swapped module's attributes, ``surgery.patching.swap``), not
what the options would imply, so it shows the model as it is: patched through the registry, by the
loss-only fallback, or not at all.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

from surgery.attention.flex import flex_layer
from surgery.attention.forward import BINDING_ATTR, attention_kwargs
from surgery.attention.linear import LINEAR_ATTENTION_ATTR
from surgery.attention.vision import VISION_ATTENTION_ATTR
from surgery.forwards.base_model import BASE_MODEL_ATTR, BaseModelNeeds
from surgery.forwards.causal_lm import STATE_ATTR, PatchState
from surgery.forwards.experts import EXPERTS_PLAN_ATTR
from surgery.forwards.head import LM_HEAD_ATTR, head_takes_loss, rows_sharded
from surgery.forwards.layers import EMBEDDING_ATTR, MLP_ATTR, NORM_ATTR, plain_linear, share_input
from surgery.forwards.multimodal import text_model
from surgery.forwards.recompute import RECOMPUTE_ATTR
from surgery.forwards.tensor_parallel import TP_LINEAR_ATTR
from surgery.integrations.fla import fla_status
from surgery.models import ArchitectureSpec
from surgery.options import PatchOptions
from surgery.patching.experts_install import (
    batched_experts_left_alone,
    describe_batched_experts,
    describe_experts,
)
from surgery.patching.fallback import (
    FALLBACK_ATTR,
    LossFallback,
    fallback_patched_lm,
    find_fallback_lm,
)
from surgery.patching.foreign import tensor_parallel_forward
from surgery.patching.registry import UnsupportedModelError, find_causal_lm
from surgery.patching.swap import is_swapped

__all__ = ["ModuleGroup", "PatchReport", "describe"]


@dataclass(frozen=True)
class ModuleGroup:
    """``count`` modules of class ``cls``: the kernel their forward now reaches (``patched``), or
    why it was left alone (``left_alone``)."""

    cls: str
    count: int
    what: str


@dataclass(frozen=True)
class PatchReport:
    """What ``describe`` found; ``str(report)`` is a readable table."""

    model: str
    """Class of the causal LM (or of the model passed, when it holds none)."""
    model_type: str | None
    how: str
    """``"registry"`` (patched through its architecture's spec), ``"fallback"`` (the loss-only
    fallback) or ``"unpatched"``."""
    options: PatchOptions | None
    """The options in force (None: unpatched)."""
    patched: tuple[ModuleGroup, ...]
    left_alone: tuple[ModuleGroup, ...]
    notes: tuple[str, ...]

    def __str__(self) -> str:
        kind = f" (model_type {self.model_type})" if self.model_type else ""
        heading = {
            "registry": "patched through the registry",
            "fallback": "patched by the loss-only fallback",
            "unpatched": "not patched",
        }[self.how]
        lines = [f"surgery.describe: {self.model}{kind}: {heading}"]
        width = max((len(g.cls) for g in self.patched + self.left_alone), default=0)
        for title, groups in (("patched", self.patched), ("left alone", self.left_alone)):
            if groups:
                lines.append(f"{title}:")
                lines += [f"  {g.cls:<{width}}  x{g.count:<3} {g.what}" for g in groups]
        if self.notes:
            lines.append("notes:")
            lines += [f"  - {note}" for note in self.notes]
        if self.options is not None:
            lines.append("options in force:")
            fields = [f"{k}={v!r}" for k, v in dataclasses.asdict(self.options).items()]
            lines += ["  " + ", ".join(fields[i : i + 4]) for i in range(0, len(fields), 4)]
        return "\n".join(lines)


QKV = ("q_proj", "k_proj", "v_proj")


def _share_input(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``module``'s projections ``names`` (those it has) run through
    ``shared_input_linear`` (``surgery.forwards.layers.share_input``), as the patch left them;
    autocast and a later hook or adapter call them as modules."""
    return share_input([m for m in (getattr(module, n, None) for n in names) if m is not None])


def _installed(module: nn.Module, state: PatchState) -> str:
    """The kernel a swapped module's forward reaches, from the attributes the swap added."""
    attrs = module.__dict__
    plan = attrs.get(RECOMPUTE_ATTR)
    if STATE_ATTR in attrs:
        own: PatchState = attrs[STATE_ATTR]
        if own.wrapper is not None and not hasattr(module, "lm_head"):  # Llama 4's
            return "multimodal forward: transformers' own, labels passed to the language model"
        if not hasattr(module, "lm_head"):
            return "text model on its own (no head, no loss): carries the patch state"
        what = "causal-LM forward: fused loss in training with labels, else logits"
        if own.wrapper is not None:
            what = "multimodal forward: the wrapper's model, then the fused loss"
        if state.spec.logit_softcap and (own.wrapper is None or own.wrapper.logit_softcap):
            what += f"; softcap config.{state.spec.logit_softcap} in the kernel"
        if state.spec.router_aux_loss:
            what += "; router aux loss kept"
        return what
    if LM_HEAD_ATTR in attrs:
        if rows_sharded(module.weight):
            return (
                "lm_head: vocab_parallel_linear_cross_entropy over the ranks its rows are "
                "sharded on (no logits materialised, the head never gathered)"
            )
        return "lm_head: linear_cross_entropy (no logits materialised)"
    if BINDING_ATTR in attrs:
        what = "attention forward: RoPE through apply_rope" + (
            " (norm output recomputed for q/k/v)" if plan is not None and plan.norm_output else ""
        )
        names = ("q_proj",) if getattr(module, "is_kv_shared_layer", False) else QKV
        if _share_input(module, names):
            what += "; q/k/v share their input (shared_input_linear)"
        binding = attrs[BINDING_ATTR]
        softcap = attention_kwargs(module, binding.spec).get("softcap")
        if flex_layer(module, binding.flex, softcap) and not module.attention_dropout:
            what += "; softcapped attention through flex attention (CUDA, 16-bit, no cached keys)"
        return what
    if NORM_ATTR in attrs:
        style = attrs[NORM_ATTR]
        scale = "weight" if style.offset == 0 else f"({style.offset:g} + weight)"
        return f"rms_norm ({style.casting} cast points, scale {scale})" + (
            ", output recomputed in the backward" if plan is not None and plan.norm_output else ""
        )
    if EXPERTS_PLAN_ATTR in attrs:
        return describe_batched_experts(attrs[EXPERTS_PLAN_ATTR])
    if MLP_ATTR in attrs:
        what = f"gated_activation ({attrs[MLP_ATTR]})"
        if _share_input(module, ("gate_proj", "up_proj")):
            what += ", gate/up sharing their input (shared_input_linear)"
        if plan is None or not plan.mlp_product:
            return what
        if plain_linear(module.down_proj):
            return (
                what
                + ", with down_proj one step (gated_linear): product rebuilt in the backward kernel"
            )
        return what + ", product recomputed in the backward"
    if BASE_MODEL_ATTR in attrs and STATE_ATTR not in attrs:
        needs: BaseModelNeeds = attrs[BASE_MODEL_ATTR]
        given = [
            what
            for what, wanted in (
                ("position ids", needs.positions),
                ("the rotary module's positions", needs.rope_positions),
                ("packed documents", needs.documents),
                ("the chunked layers' packed mask", needs.chunked_mask),
            )
            if wanted
        ]
        return "base model forward: transformers' own, handing its layers " + (
            ", ".join(given) or "nothing more"
        )
    if TP_LINEAR_ATTR in attrs:
        style = attrs[TP_LINEAR_ATTR].style
        collective = (
            "the input's gradient all-reduced" if style == "colwise" else "the output all-reduced"
        )
        return f"{style} tensor-parallel projection on its local shards ({collective})"
    if EMBEDDING_ATTR in attrs:
        return "input embedding: weight gradient in one op, torch's eager kernel (also compiled)"
    if VISION_ATTENTION_ATTR in attrs:
        return "vision attention: each image, frame or window in one varlen call (CUDA, 16-bit)"
    if LINEAR_ATTENTION_ATTR in attrs:
        without = "without it: transformers' forward, one packed document at a time"
        if not attrs[LINEAR_ATTENTION_ATTR]:
            return f"linear attention: a layout fla's path does not know; {without}"
        device = next(module.parameters()).device
        return f"linear attention, each document alone: {fla_status(device)}; {without}"
    return "a surgery forward"


def _torch_tensor_parallel(module: nn.Module) -> bool:
    """Whether torch's ``parallelize_module`` sharded ``module``: DTensor parameters of its own and
    the layout hooks ``distribute_module`` registers (FSDP2's hooks sit on the module it wraps,
    and its parameters are gathered into plain tensors inside the forward)."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False)) and any(
        getattr(hook, "__module__", "").startswith("torch.distributed.tensor") for hook in hooks
    )


def _left_alone_because(
    module: nn.Module, lm: nn.Module, under_head: set[int], state: PatchState, fallback: bool
) -> str:
    if id(module) in under_head:
        if head_takes_loss(lm.lm_head):
            return "inside lm_head: dispatches to the patched head"
        return (
            "inside lm_head, with parameters of its own (an adapter, a quantised layer): the loss "
            "is computed from lm_head's logits, not fused"
        )
    if fallback:
        return "loss-only fallback: transformers' own forward"
    if tensor_parallel_forward(module.__dict__.get("forward")):
        return "sharded by transformers' tensor parallelism: its own forward on the shards"
    if _torch_tensor_parallel(module):
        return "sharded by torch's tensor parallelism (parallelize_module): DTensor's forward"
    spec: ArchitectureSpec = state.spec
    options = state.options
    if not any(module is m for m in text_model(lm, spec)[0].modules()):
        return "outside the language model (vision, projector): transformers' own forward"
    if spec.is_instance(module, spec.attention):
        return "rope=False"
    if spec.rms_norm is not None and spec.is_instance(module, spec.rms_norm):
        return "rms_norm=False"
    if isinstance(module, nn.Embedding) and any(
        module is m for m in text_model(lm, spec)[0].get_input_embeddings().modules()
    ):
        if not options.embedding_backward:
            return "embedding_backward=False"
        return (
            "input embedding with a forward of its own (Gemma's scaled one), max_norm or sparse "
            "gradients: transformers' own forward"
        )
    if spec.mlp is not None and spec.is_instance(module, spec.mlp):
        if not options.gated_mlp:
            return "gated_mlp=False"
        sparsity = spec.mlp_sparsity(module)
        if sparsity:
            return (
                f"activation sparsity {sparsity}: the gate is cut by a Gaussian top-k before the "
                "activation, not the fused kernel's math"
            )
        activation = getattr(lm.config, spec.mlp_activation_attr, None)
        return f"no gated_activation kernel for {activation!r}"
    if spec.batched_experts is not None and spec.is_instance(module, spec.batched_experts):
        config = text_model(lm, spec)[0].config
        return batched_experts_left_alone(module, config, spec, options)
    return "no surgery kernel: transformers' own forward"


def _grouped(rows: list[tuple[str, str]]) -> tuple[ModuleGroup, ...]:
    counts = Counter(rows)
    return tuple(ModuleGroup(cls, n, what) for (cls, what), n in counts.items())


def describe(model: nn.Module) -> PatchReport:
    """What ``surgery.patch`` did to ``model`` (or to the causal LM inside it): the module classes
    whose forward it swapped and the kernel each now reaches, every other module class and why it
    was left alone, the options in force, and for the loss-only fallback what its probe checked.
    ``print(surgery.describe(model))`` shows it as a table; an unpatched model is reported as
    such, with how it could be patched."""
    try:
        lm, spec = find_causal_lm(model)
    except UnsupportedModelError:
        lm, spec = fallback_patched_lm(model), None
    state: PatchState | None = None if lm is None else lm.__dict__.get(STATE_ATTR)
    if state is None:
        return _unpatched(model, lm, spec)
    proof: LossFallback | None = lm.__dict__.get(FALLBACK_ATTR)
    fallback = proof is not None

    head = getattr(lm, "lm_head", None)  # none on a text model patched on its own
    under_head = set() if head is None else {id(m) for m in head.modules()}
    patched, left = [], []
    for module in lm.modules():
        # Experts run through transformers' dispatch, not a swapped forward.
        experts = None if fallback else describe_experts(module, spec)
        if is_swapped(module):
            patched.append((type(module).__name__, _installed(module, state)))
        elif experts is not None:
            fused, what = experts
            (patched if fused else left).append((type(module).__name__, what))
        elif type(module).forward is not nn.Module.forward:  # containers have no forward
            why = _left_alone_because(module, lm, under_head, state, fallback)
            left.append((type(module).__name__, why))

    notes = []
    if fallback:
        notes.append(
            "outside the registry: the loss-only fallback, proven on a probe at patch time"
        )
        notes += [f"probe: {check}" for check in proof.checks]
        notes.append(
            "off, as they act on modules the fallback leaves alone: rope, rms_norm, gated_mlp, "
            "embedding_backward, their recomputation, the attention options, "
            "causal_right_padding and padding_free"
        )
    else:
        what = spec.causal_lm if state.wrapper is None else f"in {state.wrapper.wrapper}"
        notes.append(f"architecture {spec.model_type} ({what}) from the registry")
        if state.options.padding_free:
            notes.append(
                "padding_free: right-padded training batches run their real tokens only"
                if state.padding_free
                else "padding_free is off for this model: its layers read the padded layout "
                "beyond the attention (or causal_right_padding / rope is off)"
            )
    if state.options.loss_reduction == "sequence":
        notes.append("accepts_loss_kwargs is False: the Trainer passes no num_items_in_batch")
    return PatchReport(
        model=type(lm).__name__,
        model_type=getattr(lm.config, "model_type", None),
        how="fallback" if fallback else "registry",
        options=state.options,
        patched=_grouped(patched),
        left_alone=_grouped(left),
        notes=tuple(notes),
    )


def _unpatched(model: nn.Module, lm: nn.Module | None, spec: ArchitectureSpec | None):
    if spec is not None:
        how_to = f"supported ({spec.causal_lm}): surgery.patch(model) patches it"
    else:
        try:
            lm = find_fallback_lm(model)
            how_to = (
                "outside the registry: surgery.patch(model, fallback='loss') patches the fused "
                "loss alone if its probe passes"
            )
        except UnsupportedModelError:
            how_to = "no transformers model inside: nothing to patch"
    target = lm if lm is not None else model
    return PatchReport(
        model=type(target).__name__,
        model_type=getattr(getattr(target, "config", None), "model_type", None),
        how="unpatched",
        options=None,
        patched=(),
        left_alone=(),
        notes=("nothing is patched", how_to),
    )
