"""What is captured of a side and how two captures are compared: the core that the lockstep run
(``train``: every side alive at once) and the sequential one (``sequential``: one side after
another, for a real checkpoint) share, so that they differ only in how the sides are scheduled
and where their weights come from.

A training step's capture (``capture_step``) holds what carries the same information on both
sides and is safe to read once the step's backward has run: the patched model does not
materialise logits in training, and its kernels may reuse gradient buffers. That is the loss,
z-loss and router aux loss, every parameter's gradient (as one vector), the gradient with respect
to the final norm's output at the real tokens (the hidden states the lm_head sees), the lm_head
weight's gradient, its sum over the vocabulary (the z-loss's own gradient, see ``capture_step``)
and, for a multimodal wrapper, its vision tower's and projector's gradients. An eval batch's
capture (``capture_eval``, eval mode, where every side materialises logits) adds the logits at the
real tokens and their gradients.

How a tensor is kept is the scheduler's choice: ``Whole`` keeps it as it is (the sides are
compared while they hold them), ``Sketched`` keeps a fixed random sketch of it
(``sketch.CountSketch``: the side is gone before the next one starts; relative errors good to
about 1%). Either way two captures are compared by ``step_metrics`` / ``eval_metrics`` (relative
errors, ``rel_err``; a list of tensors is compared as one vector) and the weights' change over the
run by ``delta_metrics``. ``run_record`` puts a run's comparisons (``Comparisons``) into the record
``compare.evaluate`` judges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .side import Forward, Side, aux_value
from .sketch import CountSketch

__all__ = [
    "METRICS",
    "Comparisons",
    "Sketched",
    "Whole",
    "capture_eval",
    "capture_step",
    "delta_metrics",
    "eval_metrics",
    "rel_err",
    "rel_err_many",
    "rel_scalar",
    "run_record",
    "step_metrics",
]

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


def rel_err_many(xs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
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


def rel_scalar(x: float, ref: float) -> float:
    """|x − ref| / |ref| (the absolute error when ref is zero); inf if x is not finite."""
    if x != x or abs(x) == float("inf"):
        return float("inf")
    return abs(x - ref) / abs(ref) if ref != 0 else abs(x - ref)


def _vector_err(x, ref) -> float:
    """rel_err of two captured vectors: tensors (a sketch) or lists of tensors (``Whole``)."""
    return rel_err_many(x, ref) if isinstance(x, list) else rel_err(x, ref)


class Whole:
    """Keeps each captured tensor as it is: for sides compared while they all hold theirs.
    ``clone_grads``: copy the parameters' gradients (an eval batch's, kept past ``zero_grad``)."""

    def __init__(self, clone_grads: bool = False):
        self.clone_grads = clone_grads

    def grads(self, side: Side, params: dict[str, torch.Tensor] | None = None):
        grads = side.grads(None if params is None else params.values())
        return [g.detach().clone() for g in grads] if self.clone_grads else grads

    def one(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor

    def vector(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class Sketched:
    """Keeps a fixed random sketch of each captured tensor (``sketch.CountSketch``: the same map
    for every side), on the CPU: for sides compared after they are gone."""

    def __init__(self, sketch: CountSketch):
        self.sketch = sketch

    def grads(self, side: Side, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        params = side.params if params is None else params
        return self.sketch((k, p.grad) for k, p in params.items())

    def one(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return self.sketch.one(name, tensor)

    def vector(self, tensor: torch.Tensor) -> torch.Tensor:
        """A vector of the hidden size, kept whole (fp64, on the CPU)."""
        return tensor.to("cpu", torch.float64)


def capture_step(
    side: Side, batch, losses: tuple[float, float, float], keep: Whole | Sketched, z_on: bool
) -> dict[str, Any]:
    """What ``side`` holds after a training step's backward on ``batch`` (its ``losses``: loss,
    z-loss, aux loss), kept by ``keep``.

    ``z_grad`` (with ``z_on``, for a head not tied to the input embedding, which also collects
    its gradient; else None): the lm_head gradient's sum over the vocabulary. For each hidden
    unit, Σ_v ∂L/∂W[v] = Σ_t (Σ_v ∂L/∂logits[t, v]) h_t, and cross-entropy's gradient sums to
    zero over the vocabulary at every token (softmax minus the one-hot or smoothed target), so
    what remains is the z-loss's alone (2 s lse_t softmax_t sums to 2 s lse_t). Compared on its
    own, a 1% error in a z-loss of scale 1e-4 is a 1% difference here, where in the whole
    gradient it is below 1e-6."""
    head_grad = side.lm_head.grad
    captured = {
        "loss": losses[0],
        "z_loss": losses[1],
        "aux_loss": losses[2],
        "grad": keep.grads(side),
        "hidden_grad": keep.one("hidden", side.real_tokens(side.hidden.grad, batch)),
        "lm_head_grad": keep.one("lm_head", head_grad),
        "z_grad": keep.vector(head_grad.sum(0))
        if z_on and side.untied and head_grad is not None
        else None,
    }
    if side.vision:
        captured["vision_grad"] = keep.grads(side, side.vision)
    return captured


def capture_eval(
    side: Side, batch, forward: Callable[[dict], Forward], keep: Whole | Sketched
) -> dict[str, Any]:
    """One forward (``forward(batch)``: the side's, in whatever routing the scheduler gives it)
    and backward of ``side`` on an eval batch in eval mode, where the patched sides materialise
    logits too: the losses, the logits and their gradient at the real tokens, the final norm's
    output's gradient and every parameter's. The side is left in training mode, gradients
    cleared."""
    side.model.eval()
    side.zero_grad()
    out = forward(batch)
    logits = out.logits
    if logits is None:
        raise RuntimeError(f"{side.name}: the eval forward returned no logits")
    logits.retain_grad()
    out.loss.backward()
    captured = {
        "loss": out.loss.item(),
        "z_loss": out.z_loss.item(),
        "aux_loss": aux_value(out.aux_loss),
        "logits": keep.one("logits", side.real_tokens(logits.detach(), batch)),
        "logits_grad": keep.one("logits_grad", side.real_tokens(logits.grad, batch)),
        "hidden_grad": keep.one("hidden", side.real_tokens(side.hidden.grad, batch)),
        "grad": keep.grads(side),
    }
    side.zero_grad()
    side.model.train()
    return captured


def _loss_metrics(a: dict[str, Any], b: dict[str, Any], z_on, aux_on) -> dict[str, float]:
    return {
        "loss": rel_scalar(a["loss"], b["loss"]),
        "z_loss": rel_scalar(a["z_loss"], b["z_loss"]) if z_on else 0.0,
        "aux_loss": rel_scalar(a["aux_loss"], b["aux_loss"]) if aux_on else 0.0,
    }


def step_metrics(a: dict[str, Any], b: dict[str, Any], z_on, aux_on: bool) -> dict[str, float]:
    """The ``METRICS`` of step capture ``a`` against ``b`` (the z-loss's with ``z_on``, the aux
    loss's with ``aux_on``; ``z_grad`` where both captured it, ``vision_grad`` where ``a`` did)."""
    out = {
        **_loss_metrics(a, b, z_on, aux_on),
        "hidden_grad": rel_err(a["hidden_grad"], b["hidden_grad"]),
        "lm_head_grad": rel_err(a["lm_head_grad"], b["lm_head_grad"]),
        "grad": _vector_err(a["grad"], b["grad"]),
    }
    if "vision_grad" in a:
        out["vision_grad"] = _vector_err(a["vision_grad"], b["vision_grad"])
    if z_on and a["z_grad"] is not None and b["z_grad"] is not None:
        out["z_grad"] = rel_err(a["z_grad"], b["z_grad"])
    return out


def eval_metrics(a: dict[str, Any], b: dict[str, Any], z_on, aux_on: bool) -> dict[str, float]:
    """Eval capture ``a`` against ``b``: losses, logits, their gradient, the final norm's output's
    gradient and every parameter's."""
    return {
        **_loss_metrics(a, b, z_on, aux_on),
        **{k: rel_err(a[k], b[k]) for k in ("logits", "logits_grad", "hidden_grad")},
        "grad": _vector_err(a["grad"], b["grad"]),
    }


def delta_metrics(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], a_all, b_all) -> dict:
    """A pair's difference in what training changed of the weights (final minus initial): per
    tensor (``a`` against ``b``, by name), the worst tensor's, and over all of them (``a_all``
    against ``b_all``: one vector each, or lists of tensors)."""
    per_tensor = {k: rel_err(a[k], d) for k, d in b.items()}
    worst = max(per_tensor, key=per_tensor.get)
    return {
        "param_delta": per_tensor[worst],
        "param_delta_worst": worst,
        "param_delta_per_tensor": per_tensor,
        "param_delta_global": _vector_err(a_all, b_all),
    }


@dataclass
class Comparisons:
    """A run's measurements of its pairs of sides, keyed ``"<side>~<side it is compared with>"``:
    every training step's ``step_metrics`` (by metric, a list over the steps), the eval batch's
    ``eval_metrics`` before and after training, the weights' ``delta_metrics``; and, for a
    mixture of experts, each side's own routing decisions against the yardstick's by phase."""

    steps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    eval_init: dict[str, dict[str, float]] = field(default_factory=dict)
    eval_final: dict[str, dict[str, float]] = field(default_factory=dict)
    final: dict[str, dict[str, Any]] = field(default_factory=dict)
    routing: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)


def run_record(
    config: dict[str, Any],
    exact: str,
    sides: dict[str, dict[str, Any]],
    probes: dict[str, dict[str, Any]],
    compared: Comparisons,
    *,
    logits_materialised,
    train_docs,
    seconds: float,
    size: dict[str, Any],
    partner_kernel_error: str | None = None,
) -> dict[str, Any]:
    """The record ``compare.evaluate`` judges: the run's ``config``, the yardstick's name
    (``exact``), each side's and probe's losses, the ``compared`` pairs, the patched sides that
    materialised logits in training, the tokens a step, the run's ``seconds`` and the model's
    ``size``; ``partner_kernel_error`` names the pair that measures the probes' partner's own
    kernel error, where there is one."""
    partner = {} if partner_kernel_error is None else {"partner_kernel_error": partner_kernel_error}
    return {
        "config": config,
        "exact": exact,
        "sides": sides,
        "probes": probes,
        **partner,
        "steps": compared.steps,
        "final": compared.final,
        "eval_init": compared.eval_init,
        "eval_final": compared.eval_final,
        "routing": compared.routing,
        "logits_materialised_in_training": sorted(logits_materialised),
        "tokens_per_step": sum(len(d) for docs in train_docs for d in docs) / len(train_docs),
        "seconds": seconds,
        "size": size,
    }
