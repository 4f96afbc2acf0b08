"""One side of a comparison: a model, the loss it trains and how it is called, its optimizer (none
for a probe) and a hook that keeps the final norm's output; and the settings every way of running
sides shares (the dtypes, the yardstick one precision up, the layouts, the loss ``Variant``, the
patch call).

The unpatched sides compute the loss from their logits in fp32
(:func:`surgery.convergence.loss.causal_lm_loss`). The patched ones get their labels as real
pipelines hand them over (``Side.inputs``): ``shift_labels`` on padded rows, unmasked document
starts on packed ones, so that the patched forward's own handling is what is tested.

A mixture of experts with a router auxiliary loss (``router_aux_loss_trained``) trains it, as
transformers' causal-LM forward does with ``output_router_logits``: every side's loss is the
language-model loss plus the model's own ``router_aux_loss_coef`` times transformers'
``load_balancing_loss_func`` of the router logits over the real tokens (the unpatched sides add
it to ``causal_lm_loss`` as transformers' forward adds it to its own loss; the patched forward
adds it itself), and each side's aux loss is recorded beside its loss. It is one statistic of all
the batch's real tokens, the same whether they come padded (the attention mask leaves the pads
out) or packed, so every side is compared with the padded reference as for the loss.

Who schedules the sides (all at once in ``train``, one after another in ``sequential``) and what
is captured of them (``capture``) is not decided here.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .loss import causal_lm_loss
from .routing import Decision, Routing

__all__ = [
    "DTYPES",
    "EXACT",
    "LAYOUTS",
    "Forward",
    "Side",
    "Variant",
    "adds_router_aux_loss",
    "default_patch",
    "loss_series",
    "moe_arguments",
    "patch_as_the_suite_does",
    "router_aux_loss_trained",
    "to_device",
    "values",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The precision one step up from each dtype: the yardstick run.
EXACT = {"fp32": ("fp64-reference", torch.float64), "bf16": ("fp32-reference", torch.float32)}
LAYOUTS = ("padded", "packed")


@dataclass(frozen=True)
class Variant:
    """The loss options a run trains with (the arguments given to ``surgery.patch``)."""

    reduction: str = "mean"
    z_loss_scale: float = 0.0
    label_smoothing: float = 0.0

    @property
    def name(self) -> str:
        parts = [self.reduction]
        if self.z_loss_scale:
            parts.append(f"z{self.z_loss_scale:g}")
        if self.label_smoothing:
            parts.append(f"ls{self.label_smoothing:g}")
        return "+".join(parts)


def default_patch() -> Callable[..., Any]:
    """``surgery.patch``: what the patched sides run unless a run is given another patch."""
    import surgery  # late: the patched sides are the only thing here that need it

    return surgery.patch


def patch_as_the_suite_does(patch: Callable[..., Any] | None, model, variant: Variant, **extra):
    """``patch(model, ...)`` with the options every patched side of the suite runs: RoPE and the
    fused loss on, the variant's loss (reduction, z-loss, label smoothing); ``extra`` on top.
    ``patch`` None: ``default_patch()``."""
    return (patch or default_patch())(
        model,
        **extra,
        rope=True,
        fused_linear_cross_entropy=True,
        loss_reduction=variant.reduction,
        z_loss_scale=variant.z_loss_scale,
        label_smoothing=variant.label_smoothing,
    )


def adds_router_aux_loss(model) -> bool:
    """Whether ``model``'s class's causal-LM forward reads ``output_router_logits``: transformers'
    mixtures of experts that then add ``router_aux_loss_coef`` times ``load_balancing_loss_func``
    of the router logits to the loss. Most name the argument; transformers 5.17's Qwen3-VL-MoE and
    Qwen3.5-MoE wrappers read it from their keyword arguments, which only their source shows.
    Llama 4's, which outputs router logits but adds nothing, does neither."""
    forward = type(model).forward
    if "output_router_logits" in inspect.signature(forward).parameters:
        return True
    try:
        return "output_router_logits" in inspect.getsource(forward)
    except (OSError, TypeError):  # no source to read (a built-in or generated forward)
        return False


def moe_arguments(model):
    """Where ``model``'s load-balancing loss reads ``num_experts``, ``num_experts_per_tok`` and
    ``router_aux_loss_coef``: a causal LM's own attributes, a multimodal wrapper's text config
    (Qwen3-VL-MoE, Qwen3.5-MoE: the wrapper's forward reads them there)."""
    return model if hasattr(model, "router_aux_loss_coef") else model.config.get_text_config()


def router_aux_loss_trained(model) -> bool:
    """Whether ``model`` trains a router aux loss: it adds one (``adds_router_aux_loss``) and its
    config (a wrapper's text config) turns the router logits on."""
    return adds_router_aux_loss(model) and bool(
        getattr(model.config.get_text_config(), "output_router_logits", False)
    )


def load_balancing_loss(model) -> Callable[..., torch.Tensor]:
    """transformers' ``load_balancing_loss_func`` of ``model``'s own modeling module (the one its
    causal-LM forward calls)."""
    return sys.modules[type(model).__module__].load_balancing_loss_func


class Forward(NamedTuple):
    """One side's forward: what it trains (``loss``), the z-loss and router aux loss terms in it
    (the aux loss before its coefficient, as transformers returns it; None without one) and the
    logits (None where the patched forward does not materialise them)."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    logits: torch.Tensor | None
    aux_loss: torch.Tensor | None


def aux_value(aux: torch.Tensor | None) -> float:
    """The aux loss as a float, NaN where none was returned."""
    return float("nan") if aux is None else float(aux.detach())


def values(out: Forward) -> tuple[float, float, float]:
    """``out``'s loss, z-loss and aux loss as floats (the aux loss NaN where none was returned:
    a model that trains one and returns none fails every aux check)."""
    return out.loss.item(), out.z_loss.item(), aux_value(out.aux_loss)


def loss_series(losses, z_losses, aux_losses) -> dict[str, list[float]]:
    """A side's per-step losses as the record holds them: the aux loss only where the model
    trains one (``aux_losses`` not None; compare checks it where present)."""
    out = {"loss": losses, "z_loss": z_losses}
    return out if aux_losses is None else {**out, "aux_loss": aux_losses}


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _final_norm(model) -> torch.nn.Module:
    """The final norm of ``model``'s text base model: a causal LM's ``model.norm``, a multimodal
    wrapper's language model's (Llama 4's language model is a causal LM: one level more)."""
    base = model.model if hasattr(model, "model") else model.language_model  # Llama 4: no model
    base = getattr(base, "language_model", base)
    base = getattr(base, "model", base)  # Llama 4: the causal LM's base model
    return base.norm


class Side:
    """One model of a comparison, with its optimizer (none for a probe) and a hook on the final
    norm. ``cfg`` gives the learning rate and weight decay; ``vision``: the names of a multimodal
    wrapper's vision tower and projector parameters (compared on their own as well)."""

    def __init__(
        self, name, model, layout, patched, variant, cfg, mask=True, probe=False, vision=()
    ):
        self.name = name
        self.mask = mask
        self.model = model
        self.layout = layout
        self.patched = patched
        self.variant = variant
        self.params = dict(model.named_parameters())
        self.vision = {n: self.params[n] for n in vision}
        # bf16 runs train the bf16 weights themselves (as Liger's convergence tests do): the
        # kernels see bf16 inputs. fp32 master weights were tried: the runs drift no less.
        self.optimizer = None
        if not probe:
            self.optimizer = torch.optim.AdamW(
                self.params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay
            )
        self.lm_head = model.get_output_embeddings().weight
        # The lm_head gradient's sum over the vocabulary is the z-loss's alone when the head is
        # not also the input embedding (see capture.capture_step).
        self.untied = self.lm_head is not model.get_input_embeddings().weight
        self.hidden: torch.Tensor | None = None
        _final_norm(model).register_forward_hook(self._keep_hidden)
        # The router aux loss's coefficient where the model trains one (None: no aux loss).
        self.aux_coef = (
            moe_arguments(model).router_aux_loss_coef if router_aux_loss_trained(model) else None
        )
        self.losses: list[float] = []
        self.z_losses: list[float] = []
        self.aux_losses: list[float] = []

    def record(self, out: Forward) -> tuple[float, float, float]:
        """Append ``out``'s loss, z-loss and aux loss to the side's series; returns them
        (``values``)."""
        losses = values(out)
        self.losses.append(losses[0])
        self.z_losses.append(losses[1])
        if self.aux_coef is not None:
            self.aux_losses.append(losses[2])
        return losses

    def series(self) -> dict[str, list[float]]:
        """The side's recorded losses (``loss_series``)."""
        aux = self.aux_losses if self.aux_coef is not None else None
        return loss_series(self.losses, self.z_losses, aux)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def grads(self, params=None) -> list[torch.Tensor]:
        params = self.params.values() if params is None else params
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def _keep_hidden(self, module, args, output):
        if output.requires_grad:
            output.retain_grad()
        self.hidden = output

    def inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the side's model is called with. The unpatched sides get the batch's inputs (the
        loss is computed here). The patched ones get the labels the way real pipelines hand them
        over, so that the patched forward's own handling is what is tested: padded rows carry
        the targets as ``shift_labels`` beside ``labels`` = the input ids (unmasked prompts and
        pads: only ``shift_labels`` trains right); packed rows carry each document's first token
        as a label, so that only boundaries read from ``position_ids`` keep a document's last
        token from being trained on the next document's first."""
        if not self.mask:
            batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        if "pixel_values" in batch:
            # In the model's dtype, as pipelines hand a processor's output over (Llama 4's vision
            # tower does not cast them itself).
            batch = {**batch, "pixel_values": batch["pixel_values"].to(self.lm_head.dtype)}
        if self.aux_coef is not None:
            # Asked for, not left to the config: a multimodal wrapper's forward in transformers
            # 5.17 computes its aux loss only when the argument is passed.
            batch = {**batch, "output_router_logits": True}
        if not self.patched:
            return {k: v for k, v in batch.items() if k != "labels"}
        batch = dict(batch)
        if self.layout == "padded":
            batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
            batch["labels"] = batch["input_ids"]
        else:
            positions = batch["position_ids"]
            # Multimodal (4, batch, seq) ids: the text row counts the documents' tokens.
            starts = (positions[0] if positions.dim() == 3 else positions) == 0
            batch["labels"] = torch.where(starts, batch["input_ids"], batch["labels"])
        return batch

    def forward(self, batch: dict[str, torch.Tensor], routing: Routing | None = None) -> Forward:
        """One batch's ``Forward``, with the side's loss definition. ``routing``: the
        ``routing.Routing`` the forward runs in, if any."""
        inputs = self.inputs(batch)
        out = self.model(**inputs)
        if self.patched:
            z = getattr(out, "z_loss", None)
            if z is None:
                z = torch.zeros((), device=out.loss.device)
            aux = getattr(out, "aux_loss", None) if self.aux_coef is not None else None
            return Forward(out.loss, z, out.logits, aux)
        v = self.variant
        loss, z = causal_lm_loss(
            out.logits,
            batch["labels"],
            reduction=v.reduction,
            z_loss_scale=v.z_loss_scale,
            label_smoothing=v.label_smoothing,
            position_ids=inputs.get("position_ids"),
        )
        aux = None
        if self.aux_coef is not None:
            aux = self._aux_loss(out, batch, routing)
            # As transformers' causal-LM forward adds it to its own loss.
            loss = loss + self.aux_coef * aux.to(loss.device)
        return Forward(loss, z, out.logits, aux)

    def _aux_loss(self, out, batch, routing: Routing | None) -> torch.Tensor:
        """An unpatched side's router aux loss (before its coefficient) over the real tokens."""
        if self.mask:
            return out.aux_loss
        # Run without the attention mask (the yardstick), transformers counted the pads too: the
        # same function over the real tokens, as for the sides with the mask. Its topk calls are
        # no part of the forward the others replay: they count the experts the forward's own
        # count (one call per layer, last) was given.
        again = routing.again(len(out.router_logits)) if routing is not None else None
        with again or contextlib.nullcontext():
            moe = moe_arguments(self.model)
            return load_balancing_loss(self.model)(
                out.router_logits,
                moe.num_experts,
                moe.num_experts_per_tok,
                batch.get("attention_mask"),
            )

    def routing(self, batch: dict[str, torch.Tensor], replay: list[Decision] | None = None):
        """A ``routing.Routing`` for one forward of ``batch``: records the side's routing
        decisions at the real tokens and forces ``replay``'s there (None: free routing)."""
        ids = batch["input_ids"]
        if self.layout == "packed":
            real = torch.arange(ids.shape[-1], device=ids.device)
        else:
            real = batch["attention_mask"].flatten().nonzero().squeeze(1)
        return Routing(real, tuple(ids.shape), replay)

    def routed_forward(
        self, batch: dict[str, torch.Tensor], replay: list[Decision] | None
    ) -> tuple[Forward, list[Decision]]:
        """``forward(batch)`` inside a ``Routing`` that replays ``replay`` (None: free routing):
        (its ``Forward``, the side's decisions)."""
        routing = self.routing(batch, replay)
        with routing:
            out = self.forward(batch, routing)
        routing.check_replayed()
        return out, routing.decisions

    def real_tokens(self, t: torch.Tensor | None, batch: dict[str, torch.Tensor]):
        """(N, ...) rows of ``t`` for the batch's real tokens, documents in order."""
        if t is None:
            return None
        if self.layout == "packed":
            return t[0]
        mask = batch["attention_mask"].bool()
        if t.shape[:2] != mask.shape:  # a padding-free step (surgery's): the real tokens, in order
            return t[0]
        return t[mask]
