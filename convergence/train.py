"""Train the original and the patched model side by side and record what can be compared.

Every side starts from the same weights, sees the same documents in the same order and takes
AdamW steps in lockstep, so each step's gradients can be compared while they exist and nothing but
scalars is kept. The sides:

- ``reference``: the unpatched HF model on padded batches; the loss is computed from its logits
  in fp32 by :func:`surgery.convergence.loss.causal_lm_loss`.
- ``patched-padded`` / ``patched-packed``: ``surgery.patch``-ed copies on the same documents,
  padded or packed into one row. Both are compared with the padded reference: for the packed side
  that is the packing-equivalence check, and it does not depend on whether the installed
  transformers keeps packed documents apart under SDPA/eager attention (with the configs' default
  ``use_cache`` it does not: the patched forward's guard is tested). They get their labels as
  real pipelines hand them over (``_Side.inputs``): ``shift_labels`` on padded rows, unmasked
  document starts on packed ones.
- ``fp64-reference`` (fp32 runs) / ``fp32-reference`` (bf16 runs): the reference one precision
  up, from the same (rounded) initial weights: the yardstick for how far rounding alone moves a
  correct run over many steps (the error budget in ``compare``).
- ``probe-padded`` / ``probe-packed``: not trained. At every step the patched model in fp32 is
  given the current weights of the unpatched fp32 run (the reference of an fp32 run, the
  yardstick of a bf16 one) and the step's batch, and compared with it: same weights, so what
  differs is the patch alone, at every step and not only at step 0, at fp32's resolution also in a
  bf16 run.
- ``fp32-reference-pytorch`` (bf16 runs of a hybrid model whose partner runs
  flash-linear-attention's TF32 kernels): not trained; the partner on transformers' PyTorch Gated
  DeltaNet at its weights each step, measuring how far the partner itself is from fp32
  (``PYTORCH_PARTNER``).

The patched model does not materialise logits in training, and its kernels may reuse gradient
buffers, so training steps compare what carries the same information and is safe to read: the
loss, the gradient with respect to the final norm's output (the hidden states the lm_head sees),
the lm_head weight's gradient, its sum over the vocabulary (the z-loss's own gradient, see
``_z_grad``) and every parameter's gradient. Logits and their gradients are compared on an eval
batch, where both sides materialise them.

A mixture of experts with a router auxiliary loss (``router_aux_loss_trained``) trains it, as
transformers' causal-LM forward does with ``output_router_logits``: every side's loss is the
language-model loss plus the model's own ``router_aux_loss_coef`` times transformers'
``load_balancing_loss_func`` of the router logits over the real tokens (the unpatched sides add
it to ``causal_lm_loss`` as transformers' forward adds it to its own loss; the patched forward
adds it itself), and each side's aux loss is recorded beside its loss. It is one statistic of all
the batch's real tokens, the same whether they come padded (the attention mask leaves the pads
out) or packed, so every side is compared with the padded reference as for the loss.

Mixtures of experts (``routing``): every side runs with the yardstick's routing decisions
replayed at the real tokens, on the eval batch and at every training step (the yardstick runs
first and routes freely), so that a near-tied router that rounding tips does not compare one
expert's output with another's, nor train two sides on different experts from then on (at full
size in fp32 one such flip took three MoE models' loss curves 10x past their limits). The probes
route as their partner did, which is the yardstick's routing too. What each side would have
picked itself is recorded where the weights are the same (step 0, the eval batch before training)
and judged there by ``compare.flip_margin_ratio``; and on the eval batch after training.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .configs import ARCHITECTURES, FALLBACK, SIZES, build_model
from .data import IGNORE_INDEX, Document, collate, make_batches
from .loss import causal_lm_loss
from .routing import Decision, Routing, compare_decisions

__all__ = ["DTYPES", "LAYOUTS", "RunConfig", "Variant", "rel_err", "train_and_compare"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The precision one step up from each dtype: the yardstick run.
EXACT = {"fp32": ("fp64-reference", torch.float64), "bf16": ("fp32-reference", torch.float32)}
LAYOUTS = ("padded", "packed")
# What each step records for a pair of sides (see compare for the checks).
# ``vision_grad``: the gradients of a multimodal wrapper's vision tower and projector, as one
# vector (empty for a text model).
METRICS = (
    "loss",
    "z_loss",
    "aux_loss",
    "grad",
    "hidden_grad",
    "lm_head_grad",
    "z_grad",
    "vision_grad",
)


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


@dataclass(frozen=True)
class RunConfig:
    model: str = "llama"
    size: str = "tiny"
    dtype: str = "fp32"
    device: str = "cpu"
    steps: int = 32
    variant: Variant = field(default_factory=Variant)
    layouts: tuple[str, ...] = LAYOUTS
    data: str = "mixed"
    lr: float = 2e-3
    weight_decay: float = 0.01
    seed: int = 0
    # Config attributes to override in the mini model, as a JSON object (hashable; the negative
    # controls use it to give a model a RoPE that is not shift-invariant).
    config_overrides: str = ""
    # ``model`` names a multimodal wrapper (``multimodal.MULTIMODAL``: qwen2_5_vl, gemma3, ...)
    # trained on chat samples with images (``data`` is then unused).
    multimodal: bool = False

    @property
    def name(self) -> str:
        model = f"{self.model}+images" if self.multimodal else self.model
        return f"{model}/{self.size}/{self.dtype}/{self.variant.name}"


def rel_err(x: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """‖x − ref‖ / ‖ref‖ in fp64 (the absolute error when ref is zero); inf if x is not finite
    or a gradient is missing (None)."""
    if x is None or ref is None:
        return float("inf")
    x64, r64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    num, den = (x64 - r64).norm(), r64.norm()
    return float(num / den) if den > 0 else float(num)


def _rel_err_many(xs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """rel_err of the concatenation of ``xs`` against that of ``refs``, without concatenating
    (and with one host sync, not one per tensor)."""
    num = den = None
    for x, r in zip(xs, refs):
        x64, r64 = x.detach().double(), r.detach().double()
        n, d = (x64 - r64).square().sum(), r64.square().sum()
        num, den = (n, d) if num is None else (num + n, den + d)
    if num is None:
        return 0.0
    num, den = float(num), float(den)
    if not math.isfinite(num):
        return float("inf")
    return (num / den) ** 0.5 if den > 0 else num**0.5


def _rel_scalar(x: float, ref: float) -> float:
    if x != x or abs(x) == float("inf"):
        return float("inf")
    return abs(x - ref) / abs(ref) if ref != 0 else abs(x - ref)


def _z_grad(a: _Side, b: _Side) -> float | None:
    """rel_err of the two lm_head gradients' sums over the vocabulary, or None where that does
    not isolate the z-loss (a head tied to the input embedding also collects its gradient).

    For each hidden unit, Σ_v ∂L/∂W[v] = Σ_t (Σ_v ∂L/∂logits[t, v]) h_t, and cross-entropy's
    gradient sums to zero over the vocabulary at every token (softmax minus the one-hot or
    smoothed target), so what remains is the z-loss's alone (2 s lse_t softmax_t sums to
    2 s lse_t). Compared on its own, a 1% error in a z-loss of scale 1e-4 is a 1% difference
    here, where in the whole gradient it is below 1e-6."""
    if not (a.untied and b.untied) or a.lm_head.grad is None or b.lm_head.grad is None:
        return None
    return rel_err(a.lm_head.grad.sum(0), b.lm_head.grad.sum(0))


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


class Forward(NamedTuple):
    """One side's forward: what it trains (``loss``), the z-loss and router aux loss terms in it
    (the aux loss before its coefficient, as transformers returns it; None without one) and the
    logits (None where the patched forward does not materialise them)."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    logits: torch.Tensor | None
    aux_loss: torch.Tensor | None


class _Side:
    """One model in the lockstep run, with its optimizer (none for a probe) and a hook on the
    final norm."""

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
        # A multimodal wrapper's vision tower and projector (compared on their own as well).
        self.vision = [self.params[n] for n in vision]
        # bf16 runs train the bf16 weights themselves (as Liger's convergence tests do): the
        # kernels see bf16 inputs. fp32 master weights were tried: the runs drift no less.
        self.optimizer = None
        if not probe:
            self.optimizer = torch.optim.AdamW(
                self.params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay
            )
        self.lm_head = model.get_output_embeddings().weight
        # The lm_head gradient's sum over the vocabulary is the z-loss's alone when the head is
        # not also the input embedding (see _z_grad).
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
        (``_values``)."""
        values = _values(out)
        self.losses.append(values[0])
        self.z_losses.append(values[1])
        if self.aux_coef is not None:
            self.aux_losses.append(values[2])
        return values

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
        if self.patched:
            out = self.model(**inputs)
            z = getattr(out, "z_loss", None)
            if z is None:
                z = torch.zeros((), device=out.loss.device)
            aux = getattr(out, "aux_loss", None) if self.aux_coef is not None else None
            return Forward(out.loss, z, out.logits, aux)
        out = self.model(**inputs)
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
            aux = out.aux_loss
            if not self.mask:
                # Run without the attention mask (the yardstick), transformers counted the pads
                # too: the same function over the real tokens, as for the sides with the mask.
                # Its topk calls are no part of the forward the others replay: they count the
                # experts the forward's own count (one call per layer, last) was given.
                again = routing.again(len(out.router_logits)) if routing is not None else None
                with again or contextlib.nullcontext():
                    moe = moe_arguments(self.model)
                    aux = _load_balancing_loss(self.model)(
                        out.router_logits,
                        moe.num_experts,
                        moe.num_experts_per_tok,
                        batch.get("attention_mask"),
                    )
            # As transformers' causal-LM forward adds it to its own loss.
            loss = loss + self.aux_coef * aux.to(loss.device)
        return Forward(loss, z, out.logits, aux)

    def routing(self, batch: dict[str, torch.Tensor], replay: list[Decision] | None = None):
        """A ``routing.Routing`` for one forward of ``batch``: records the side's routing
        decisions at the real tokens and forces ``replay``'s there (None: free routing)."""
        ids = batch["input_ids"]
        if self.layout == "packed":
            real = torch.arange(ids.shape[-1], device=ids.device)
        else:
            real = batch["attention_mask"].flatten().nonzero().squeeze(1)
        return Routing(real, tuple(ids.shape), replay)

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


def _final_norm(model) -> torch.nn.Module:
    """The final norm of ``model``'s text base model: a causal LM's ``model.norm``, a multimodal
    wrapper's language model's (Llama 4's language model is a causal LM: one level more)."""
    base = model.model if hasattr(model, "model") else model.language_model  # Llama 4: no model
    base = getattr(base, "language_model", base)
    base = getattr(base, "model", base)  # Llama 4: the causal LM's base model
    return base.norm


def _aux_value(aux: torch.Tensor | None) -> float:
    return float("nan") if aux is None else float(aux.detach())


def _values(out: Forward) -> tuple[float, float, float]:
    """``out``'s loss, z-loss and aux loss as floats (the aux loss NaN where none was returned:
    a model that trains one and returns none fails every aux check)."""
    return out.loss.item(), out.z_loss.item(), _aux_value(out.aux_loss)


def _load_balancing_loss(model) -> Callable[..., torch.Tensor]:
    """transformers' ``load_balancing_loss_func`` of ``model``'s own modeling module (the one its
    causal-LM forward calls)."""
    return sys.modules[type(model).__module__].load_balancing_loss_func


def _cast(model: torch.nn.Module, dtype: torch.dtype, device=None) -> torch.nn.Module:
    """``model.to(device, dtype)`` for its floating-point tensors only: ``Module.to`` would cast a
    complex buffer (Llama 4's vision RoPE, ``freqs_ci``) to the real dtype, dropping its imaginary
    part; it is kept as built (its forward computes in complex64 whatever the dtype)."""
    return model._apply(lambda t: t.to(device, dtype if t.is_floating_point() else None))


def _to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


LINEAR_ATTENTION_KERNELS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
"""The functions of transformers' hybrid modeling modules that it binds, once, to an installed
package's kernel (flash-linear-attention, causal-conv1d) in place of its PyTorch code."""


PYTORCH_PARTNER = "fp32-reference-pytorch"
"""The probes' partner (a bf16 run's fp32 yardstick) on transformers' PyTorch Gated DeltaNet, where
the partner runs a package's kernels (``binds_linear_attention_kernels``): not trained, given the
partner's weights at every step; the pair ``<partner>~fp32-reference-pytorch`` is the partner's
own kernel error, which widens the probes' limits (``compare.evaluate``)."""


def _pytorch_functions(module) -> dict[str, Callable]:
    """The PyTorch function behind each of ``module``'s ``LINEAR_ATTENTION_KERNELS`` (the
    function itself where transformers bound no package's kernel to it)."""
    return {
        name: inspect.unwrap(fn)
        for name in LINEAR_ATTENTION_KERNELS
        if (fn := getattr(module, name, None)) is not None
    }


def binds_linear_attention_kernels(model) -> bool:
    """Whether ``model``'s modeling module runs a package's kernel (flash-linear-attention,
    causal-conv1d) for any of its ``LINEAR_ATTENTION_KERNELS`` instead of transformers' PyTorch
    function (which transformers' binding wraps)."""
    module = sys.modules[type(model).__module__]
    return any(getattr(module, name) is not fn for name, fn in _pytorch_functions(module).items())


def pytorch_linear_attention(forward: Callable) -> Callable:
    """``forward`` with transformers' PyTorch Gated DeltaNet for the length of each call: in the
    modeling module of ``forward``'s model, the ``LINEAR_ATTENTION_KERNELS`` bound to a package
    are swapped for the PyTorch functions they wrap, and put back after (the backward runs the
    ops recorded). For the fp64 yardstick: those kernels have no fp64 code."""
    module = sys.modules[type(forward.__self__).__module__]
    swaps = _pytorch_functions(module)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        bound = {name: getattr(module, name) for name in swaps}
        try:
            for name, fn in swaps.items():
                setattr(module, name, fn)
            return forward(*args, **kwargs)
        finally:
            for name, fn in bound.items():
                setattr(module, name, fn)

    return run


@functools.lru_cache(maxsize=1)
def _initial_model(name: str, size: str, seed: int, overrides: str = "", multimodal=False):
    """The fp32 CPU model every run of ``name`` starts from; kept while runs of the same model
    follow one another (a full-size model takes seconds to initialise)."""
    if multimodal:
        from .multimodal import build_multimodal_model

        model = build_multimodal_model(name, size, seed=seed)
        for key, value in json.loads(overrides or "{}").items():
            setattr(model.config, key, value)
        return model
    return build_model(name, size, seed=seed, overrides=json.loads(overrides or "{}"))


def _default_patch() -> Callable[..., Any]:
    import surgery  # late: the patched side is the only thing here that needs it

    return surgery.patch


def _yardstick_first(sides: list[_Side], exact: str) -> list[_Side]:
    return sorted(sides, key=lambda s: s.name != exact)


def _routed_forward(
    side: _Side, batch, replay: list[Decision] | None
) -> tuple[Forward, list[Decision]]:
    """``side.forward(batch)`` inside a ``Routing``: (its ``Forward``, the decisions)."""
    routing = side.routing(batch, replay)
    with routing:
        out = side.forward(batch, routing)
    routing.check_replayed()
    return out, routing.decisions


def _routing_summary(decisions: dict[str, list[Decision]], exact: str) -> dict[str, dict[str, Any]]:
    """Each side's own routing decisions against the yardstick's (``routing.compare_decisions``),
    or {} where the model does not route (a dense model makes no topk call)."""
    if not decisions[exact]:
        return {}
    return {
        name: compare_decisions(mine, decisions[exact])
        for name, mine in decisions.items()
        if name != exact
    }


def _eval_check(
    sides: list[_Side],
    pairs: list[tuple[str, str]],
    docs: list[Document],
    device,
    exact: str,
    collate: Callable[[list[Document], str], dict[str, torch.Tensor]] = collate,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """Logits, loss and every gradient on one batch, for each pair of sides; and each side's
    routing decisions against the yardstick's (``_routing_summary``).

    All sides are in eval mode, so the patched ones materialise logits too. A mixture of experts
    runs every side with the yardstick's (``exact``) routing replayed at the real tokens
    (``routing``): where rounding alone tips a near-tied router, the sides would otherwise compare
    different experts' outputs for that token. What each side would have picked itself, with
    every earlier layer routed alike, is what the summary compares."""
    captured: dict[str, dict[str, Any]] = {}
    decisions: dict[str, list[Decision]] = {}
    for side in _yardstick_first(sides, exact):
        batch = _to_device(collate(docs, side.layout), device)
        side.model.eval()
        side.zero_grad()
        replay = None if side.name == exact else decisions[exact]
        out, decisions[side.name] = _routed_forward(side, batch, replay)
        logits = out.logits
        if logits is None:
            raise RuntimeError(f"{side.name}: the eval forward returned no logits")
        logits.retain_grad()
        out.loss.backward()
        captured[side.name] = {
            "loss": out.loss.item(),
            "z_loss": out.z_loss.item(),
            "aux_loss": _aux_value(out.aux_loss),
            "logits": side.real_tokens(logits.detach(), batch),
            "logits_grad": side.real_tokens(logits.grad, batch),
            "hidden_grad": side.real_tokens(side.hidden.grad, batch),
            "grads": [g.detach().clone() for g in side.grads()],
        }
        side.zero_grad()
        side.model.train()
    results = {}
    z_on, aux_on = sides[0].variant.z_loss_scale, sides[0].aux_coef is not None
    for a, b in pairs:
        x, r = captured[a], captured[b]
        results[f"{a}~{b}"] = {
            "loss": _rel_scalar(x["loss"], r["loss"]),
            "z_loss": _rel_scalar(x["z_loss"], r["z_loss"]) if z_on else 0.0,
            "aux_loss": _rel_scalar(x["aux_loss"], r["aux_loss"]) if aux_on else 0.0,
            "logits": rel_err(x["logits"], r["logits"]),
            "logits_grad": rel_err(x["logits_grad"], r["logits_grad"]),
            "hidden_grad": rel_err(x["hidden_grad"], r["hidden_grad"]),
            "grad": _rel_err_many(x["grads"], r["grads"]),
        }
    return results, _routing_summary(decisions, exact)


def _append_step(m: dict[str, list[float]], sa: _Side, sb: _Side, ba, bb, la, lb, z_on) -> None:
    """One step's METRICS of side ``sa`` against ``sb`` (their batches ``ba``, ``bb`` and their
    (loss, z-loss, aux loss) ``la``, ``lb``), from the gradients they hold now."""
    m["loss"].append(_rel_scalar(la[0], lb[0]))
    m["z_loss"].append(_rel_scalar(la[1], lb[1]) if z_on else 0.0)
    m["aux_loss"].append(_rel_scalar(la[2], lb[2]) if sb.aux_coef is not None else 0.0)
    m["hidden_grad"].append(
        rel_err(sa.real_tokens(sa.hidden.grad, ba), sb.real_tokens(sb.hidden.grad, bb))
    )
    m["lm_head_grad"].append(rel_err(sa.lm_head.grad, sb.lm_head.grad))
    m["grad"].append(_rel_err_many(sa.grads(), sb.grads()))
    if sa.vision:
        m["vision_grad"].append(_rel_err_many(sa.grads(sa.vision), sb.grads(sb.vision)))
    z_grad = _z_grad(sa, sb) if z_on else None
    if z_grad is not None:
        m["z_grad"].append(z_grad)


def train_and_compare(
    cfg: RunConfig,
    *,
    patch: Callable[..., Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` and return a json-able record: per-side losses, per-step and final differences.

    ``patch`` defaults to ``surgery.patch``; it is called as ``patch(model, rope=True,
    fused_linear_cross_entropy=True, loss_reduction=..., z_loss_scale=..., label_smoothing=...)``.
    """
    t0 = time.perf_counter()
    patch = patch or _default_patch()
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    initial = _initial_model(cfg.model, cfg.size, cfg.seed, cfg.config_overrides, cfg.multimodal)
    inputs = _run_inputs(cfg, initial)
    base = _cast(copy.deepcopy(initial), dtype, device)
    base.train()
    init = {k: p.detach().clone() for k, p in base.named_parameters()}
    side = functools.partial(_new_side, base, inputs, cfg, patch)

    run, pairs = _plan_sides(cfg, side)
    sides, exact_name = run.sides, run.exact_name

    collate_fn, eval_docs = inputs.collate_fn, inputs.eval_docs
    eval_init, routing_init = _eval_check(sides, pairs, eval_docs, device, exact_name, collate_fn)
    # A mixture of experts: the yardstick's eval forward made topk calls (a dense model makes
    # none, and runs exactly as before).
    routed = bool(routing_init)
    routing: dict[str, dict[str, Any]] = {"eval_init": routing_init} if routed else {}
    for step, docs in enumerate(inputs.train_docs):
        decisions = run.step(docs, collate_fn, device, routed, cfg.variant.z_loss_scale)
        if routed and step == 0:
            routing["step0"] = _routing_summary(decisions, exact_name)
        if progress is not None and ((step + 1) % 8 == 0 or step + 1 == cfg.steps):
            progress(
                f"{cfg.name}: step {step + 1}/{cfg.steps}  loss "
                + "  ".join(f"{s.name} {s.losses[-1]:.4f}" for s in sides)
            )
    eval_final, routing_final = _eval_check(sides, pairs, eval_docs, device, exact_name, collate_fn)
    if routed:
        routing["eval_final"] = routing_final
    record = run.record(cfg, _final_deltas(pairs, run.by_name, init))
    return {
        **record,
        "eval_init": eval_init,
        "eval_final": eval_final,
        "routing": routing,
        "logits_materialised_in_training": sorted(set(run.logits_materialised)),
        "tokens_per_step": (
            sum(len(d) for docs in inputs.train_docs for d in docs) / len(inputs.train_docs)
        ),
        "seconds": time.perf_counter() - t0,
        "size": asdict(SIZES[cfg.size]),
        "vision_parameters": len(inputs.vision),
    }


def _plan_sides(cfg: RunConfig, side: Callable[..., _Side]) -> tuple[_Lockstep, list]:
    """The run's sides (``side`` makes each: the reference, the patched layouts, the yardstick
    one precision up) and probes, in a ``_Lockstep``; and the pairs of sides whose final
    parameters are compared."""
    dtype = DTYPES[cfg.dtype]
    exact_name, exact_dtype = EXACT[cfg.dtype]
    sides = [side("reference", "padded", False, dtype)]
    sides += [side(f"patched-{layout}", layout, True, dtype) for layout in cfg.layouts]
    # The yardstick runs without attention_mask: with right padding, causal attention keeps real
    # tokens from seeing pads anyway, and in fp64 transformers' eager mask turns a pad row whose
    # sliding window holds only pads into NaN, which the next layer spreads to real tokens (a zero
    # attention weight times a NaN value is NaN).
    sides.append(side(exact_name, "padded", False, exact_dtype, mask=False))
    ref = sides[0]
    if type(ref.model).forward is not ref.model.forward.__func__:
        raise RuntimeError("patching a copy changed the reference model's forward")
    # The probes: at every step, the patched model in fp32 on the unpatched fp32 run's current
    # weights and batch (the reference of an fp32 run, the yardstick of a bf16 one). Same
    # weights, so any difference is the patch's alone, at any step: a bug that starts late, or
    # one whose effect bf16's rounding hides (2^-9 per element, where a 1% error in a 1e-4
    # z-loss is 1e-6 of the gradient), is held to fp32's same-weights limits in a bf16 run too.
    partner = ref if cfg.dtype == "fp32" else sides[-1]
    # The probes get the attention mask as their partner does, except where the router aux loss
    # reads it (the patched forward counts the tokens of the mask it is given): the partner
    # without one counts the real tokens all the same (_Side.forward).
    probe_mask = partner.mask or partner.aux_coef is not None
    probes = [
        side(f"probe-{layout}", layout, True, torch.float32, mask=probe_mask, probe=True)
        for layout in cfg.layouts
    ]
    # Which pairs are compared: every patched side against the reference, every side against
    # the run one precision up (the error budget), and every probe against its partner.
    pairs = [(s.name, ref.name) for s in sides if s.patched]
    pairs += [(s.name, exact_name) for s in sides if s.name != exact_name]
    probe_pairs = [(p.name, partner.name) for p in probes]
    # A bf16 run's partner is fp32 only as far as its kernels are: flash-linear-attention's
    # Gated DeltaNet multiplies fp32 in TF32 (10 mantissa bits), so the partner and the probes
    # each sit about 1e-4 off exact fp32 and the same-weights limit alone would fail two
    # correct models. Its own error is measured as an fp32 run's is (against fp64): the
    # partner's weights, batch and routing through transformers' PyTorch path, every step.
    if partner is not ref and binds_linear_attention_kernels(partner.model):
        exact32 = side(PYTORCH_PARTNER, "padded", False, torch.float32, partner.mask, True)
        exact32.model.forward = pytorch_linear_attention(exact32.model.forward)
        probes.append(exact32)
        probe_pairs.append((partner.name, exact32.name))
    return _Lockstep(sides, probes, partner, exact_name, pairs + probe_pairs), pairs


class _Inputs(NamedTuple):
    """A run's architecture spec, its vision parameters (a multimodal wrapper's), its training
    and eval documents, and how they are collated."""

    spec: Any
    vision: list[str]
    train_docs: list
    eval_docs: list
    collate_fn: Callable


def _run_inputs(cfg: RunConfig, initial) -> _Inputs:
    if cfg.multimodal:
        from . import multimodal

        train_docs, eval_docs = multimodal.multimodal_batches(
            initial, cfg.size, cfg.steps, seed=cfg.seed
        )
        return _Inputs(
            multimodal.MULTIMODAL[cfg.model][0],
            multimodal.vision_parameters(initial, cfg.model),
            train_docs,
            eval_docs,
            functools.partial(multimodal.collate_multimodal, config=initial.config),
        )
    train_docs, eval_docs = make_batches(cfg.size, cfg.steps, kind=cfg.data, seed=cfg.seed)
    return _Inputs(ARCHITECTURES[cfg.model], [], train_docs, eval_docs, collate)


def _new_side(base, inputs: _Inputs, cfg: RunConfig, patch, name, layout, patched, model_dtype,
              mask=True, probe=False) -> _Side:  # fmt: skip
    """A side of the run: a copy of ``base`` in ``model_dtype``, patched as the suite patches
    (``patch``) where ``patched``."""
    spec, v = inputs.spec, cfg.variant
    model = _cast(copy.deepcopy(base), model_dtype)
    if spec.router_aux_loss:
        # Trained and compared (module docstring), with the mini config's coefficient (a
        # multimodal wrapper's text config holds it).
        model.config.get_text_config().output_router_logits = True
    if model_dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        # transformers' default experts implementation (grouped_mm) has no fp64 kernel; its
        # reference loop computes the same experts (Gemma 4's mixture has no aux loss).
        model.set_experts_implementation("eager")
    if model_dtype == torch.float64 and spec.linear_attention is not None:
        # Nor has flash-linear-attention, which transformers' Gated DeltaNet picks once it
        # is installed: the yardstick runs transformers' PyTorch path.
        model.forward = pytorch_linear_attention(model.forward)
    if patched:
        # A model outside the registry gets the fused loss through the fallback.
        fallback = {"fallback": "loss"} if cfg.model in FALLBACK and not cfg.multimodal else {}
        model = patch_as_the_suite_does(patch, model, v, **fallback)
    return _Side(name, model, layout, patched, v, cfg, mask, probe, inputs.vision)


def patch_as_the_suite_does(patch: Callable[..., Any], model, variant: Variant, **extra):
    """``patch(model, ...)`` with the options every patched side of the suite runs: RoPE and the
    fused loss on, the variant's loss (reduction, z-loss, label smoothing); ``extra`` on top."""
    return patch(
        model,
        **extra,
        rope=True,
        fused_linear_cross_entropy=True,
        loss_reduction=variant.reduction,
        z_loss_scale=variant.z_loss_scale,
        label_smoothing=variant.label_smoothing,
    )


class _Lockstep:
    """The sides trained in lockstep and the probes on their partner's weights: one training
    step at a time (``step``), the per-step metrics of every compared pair, and the record."""

    def __init__(self, sides, probes, partner, exact_name, pairs):
        self.sides, self.probes, self.partner = sides, probes, partner
        self.exact_name, self.pairs = exact_name, pairs
        self.by_name = {s.name: s for s in sides + probes}
        self.metrics = {f"{a}~{b}": {k: [] for k in METRICS} for a, b in pairs}
        self.logits_materialised: list[str] = []

    def step(self, docs, collate_fn, device, routed: bool, z_loss_scale: float):
        """One training step of every side on ``docs`` and one probe step; returns the step's
        routing decisions by side (a mixture of experts; else empty)."""
        sides, probes, exact_name = self.sides, self.probes, self.exact_name
        batches = {s.name: _to_device(collate_fn(docs, s.layout), device) for s in sides + probes}
        recorded, decisions = {}, {}
        # A mixture of experts trains every side with the yardstick's routing of the step
        # replayed at the real tokens (module docstring), the yardstick first; the probes route
        # as their partner did, which is the yardstick's routing too.
        for s in _yardstick_first(sides, exact_name) if routed else sides:
            s.zero_grad()
            if routed:
                replay = None if s.name == exact_name else decisions[exact_name]
                out, decisions[s.name] = _routed_forward(s, batches[s.name], replay)
            else:
                out = s.forward(batches[s.name])
            out.loss.backward()
            if s.patched and out.logits is not None:
                self.logits_materialised.append(s.name)
            recorded[s.name] = s.record(out)
        for p in probes:
            with torch.no_grad():
                for mine, theirs in zip(p.params.values(), self.partner.params.values()):
                    mine.copy_(theirs)
            p.zero_grad()
            if routed:
                out, _ = _routed_forward(p, batches[p.name], decisions[exact_name])
            else:
                out = p.forward(batches[p.name])
            out.loss.backward()
            recorded[p.name] = p.record(out)
        for a, b in self.pairs:
            sa, sb = self.by_name[a], self.by_name[b]
            _append_step(self.metrics[f"{a}~{b}"], sa, sb, batches[a], batches[b], recorded[a],
                         recorded[b], z_loss_scale)  # fmt: skip
        del batches
        for s in sides:
            s.step()
        return decisions

    def record(self, cfg: RunConfig, final: dict) -> dict[str, Any]:
        """The run's record of the sides, the probes, the steps and ``final`` (the first keys of
        ``train_and_compare``'s)."""
        v = cfg.variant

        def series(s: _Side) -> dict[str, list[float]]:
            # The aux loss only where the model trains one (compare checks it where present).
            out = {"loss": s.losses, "z_loss": s.z_losses}
            return {**out, "aux_loss": s.aux_losses} if s.aux_coef is not None else out

        return {
            "config": {**asdict(cfg), "variant": {**asdict(v), "name": v.name}, "name": cfg.name},
            "exact": self.exact_name,
            "sides": {
                s.name: {"layout": s.layout, "patched": s.patched, **series(s)} for s in self.sides
            },
            "probes": {
                p.name: {"layout": p.layout, "partner": self.partner.name, **series(p)}
                for p in self.probes
                if p.patched
            },
            **(
                {"partner_kernel_error": f"{self.partner.name}~{PYTORCH_PARTNER}"}
                if PYTORCH_PARTNER in self.by_name
                else {}
            ),
            "steps": self.metrics,
            "final": final,
        }


def _final_deltas(pairs, by_name: dict[str, _Side], init: dict[str, torch.Tensor]) -> dict:
    """Each pair's difference in what training changed of every parameter (final minus
    initial): the worst tensor's, per tensor and over all of them."""
    final: dict[str, dict[str, Any]] = {}
    for a, b in pairs:
        pa, pb = by_name[a].params, by_name[b].params
        per_param = {
            k: rel_err(pa[k].double() - init[k].double(), pb[k].double() - init[k].double())
            for k in pb
        }
        worst = max(per_param, key=per_param.get)
        final[f"{a}~{b}"] = {
            "param_delta": per_param[worst],
            "param_delta_worst": worst,
            "param_delta_per_tensor": per_param,
            "param_delta_global": _rel_err_many(
                [pa[k].double() - init[k].double() for k in pb],
                [pb[k].double() - init[k].double() for k in pb],
            ),
        }
    return final
