"""Verdicts: the tolerance table and the checks a run must pass (the printed table, png and json
of a run: ``report``).

Every measure is a relative error: ‖x − x_ref‖ / ‖x_ref‖ for tensors, |x − x_ref| / |x_ref| for
losses. Five kinds of check:

1. Direct, patched against the reference: the loss, z-loss and (a mixture of experts that trains
   one) router aux loss at every step, each step t within the dtype's tolerance plus
   ``drift_factor`` times the unpatched run's largest distance from the run one precision up up to
   step t (see 3.: at full size two correct runs' loss curves separate, and the distance between
   them grows with t); where both sides still hold the same weights, so any difference is the
   kernels' alone, the step-0 losses, every parameter's gradient (as one vector), ∂L/∂h at the final
   norm's output and the lm_head weight's gradient, and on an eval batch (eval mode, so both sides
   materialise logits) the losses, logits, ∂L/∂logits, ∂L/∂h and every parameter's gradient. And the
   patched training forward must return no logits. A same-weights gradient or eval limit is never
   tighter than (1 + ``accuracy_factor``) times the unpatched run's own error against the run one
   precision up (plus ``accuracy_floor``): two runs that the accuracy budget (2.) passes can be
   that far apart. That bound is about 3e-6 in fp32 for a well-conditioned model, under the
   fixed limits; a model whose fp32 run is itself far from fp64 raises it. An example is Gemma 4
   at transformers' initialisation, with unscaled attention logits: 2.3e-4, the patched model
   just as far (configs.condition_attention conditions the mini models). The probes of an fp32
   run take the step-0 error as that scale. The aux loss has the loss's limits: every
   side trains under one routing (5.), so each real token counts for the same experts on every
   side and what differs is the router probabilities' rounding and the run's drift.

2. Accuracy with the same weights (step 0 and the eval batch), the error budget (a run may exceed
   the unpatched run's own error by a factor and a floor): against the same run one precision up
   (fp64 for fp32, fp32 for bf16; same rounded initial weights, same data), the patched gradients
   and logits may be at most ``accuracy_factor`` times as far off as the unpatched model's own, plus
   ``accuracy_floor``: "as exact as transformers".

3. Drift over the whole run. After step 0 the sides' weights differ by what earlier steps'
   rounding left, and AdamW amplifies some of it: each update is g / (|g| + eps), so a weight
   whose gradient is at the rounding-noise level (|g| ~ 1e-7 in fp32, against eps = 1e-8) moves
   by a visibly different fraction of lr on two correct runs. Which weights those are is luck:
   over 8 batches the unpatched model (padded or packed) and the patched one each had 2-5 such
   weights, and one of them moves a whole run's weight deltas by 1e-5-1e-4. Elementwise or
   per-tensor comparisons of final weights therefore say nothing (json keeps them); the measures
   are the relative difference of the weight *deltas* from initialisation over all tensors,
   ‖Δp − Δp_ref‖ / ‖Δp_ref‖, and the final model's logits on the eval batch. They are judged
   against the unpatched run's own distance from the run one precision up: at most
   ``drift_factor`` times it plus ``drift_floor``, a floor set by that luck in fp32. In bf16 the
   drift is large but steady (pure bf16 weights round away updates below half an ulp, so many
   weights differ a little): two correct runs differ by several percent. The final model's
   eval loss is held to the same rule as the training loss.

4. The probes (train.py): at every step, the patched model in fp32 on the unpatched fp32 run's
   weights and batch, against that run: loss, z-loss, every gradient, ∂L/∂h, the lm_head's
   gradient and the z-loss's own gradient (its sum over the vocabulary), all within fp32's
   same-weights limits, in bf16 runs too. 1.-3. cannot see a small bug that starts after step 0
   in bf16: the distance between two correct bf16 runs (several percent after a few steps) hides
   a z-loss gradient 10% off or label smoothing 0.05 nobody asked for, and bf16's rounding of a
   gradient (2^-9 per element) hides a 1% error in a z-loss of scale 1e-4 even with the same
   weights. The negative controls (``surgery.convergence.controls``) are each caught.

5. Routing (mixtures of experts). Every side runs with the routing decisions of the run one
   precision up replayed (train.py, ``routing``): on the eval batch, and at every training step,
   so 1.-3. compare the same experts' outputs at the dense tolerances. Without it, one near-tied
   token that rounding sends elsewhere in the patched model and not in the unpatched one is enough
   to fail them: tiny Mixtral's eval batch in bf16 (eval_grad 3.3e-2, eval_logits:accuracy 1.6e-2
   against the unpatched 4.7e-3), and in fp32 at full size, where a step routes about 4,000 tokens
   per layer (H100, 32 steps: Mixtral's, Qwen2-MoE's and Qwen3-MoE's loss curves left their fp32
   limits by 10x after one flipped decision at steps 2-5, the aux loss first; in bf16, with the
   sides free, the aux loss needed a tolerance of its own, 5e-2). What each side would have
   picked itself is held to rounding instead: every flip at a margin rounding can reach
   (``flip_margin_ratio``), at step 0 and on the eval batch, where the weights are the same; from
   step 1 on they differ by the run's drift, and the probes (4.), which route as their partner,
   hold the router's scores (through the weights of the experts they pick) to fp32's limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOLERANCES",
    "Check",
    "Tolerance",
    "evaluate",
    "flip_margin_ratio",
    "ratio",
    "worst",
]


@dataclass(frozen=True)
class Tolerance:
    """Limits for one dtype (relative errors; see the module docstring for the measures)."""

    loss: float  # the loss at every step, patched vs reference
    z_loss: float  # the z-loss term at every step
    same_weights_loss: float  # loss and z-loss at step 0 and on the eval batch (same weights)
    grad_step0: float  # step-0 gradients, patched vs reference
    eval: float  # eval batch: logits, ∂L/∂logits, ∂L/∂h, every parameter's gradient
    accuracy_factor: float  # step 0: patched's error vs the exact run ≤ factor × unpatched's
    accuracy_floor: float
    drift_factor: float  # after the run: patched's distance from the exact run ≤ factor ×
    drift_floor: float  # unpatched's + floor (weight deltas, final eval logits)


TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(
        loss=1e-5,
        z_loss=1e-5,
        same_weights_loss=1e-5,
        grad_step0=1e-5,
        eval=1e-5,
        accuracy_factor=2.0,
        accuracy_floor=1e-6,
        drift_factor=2.0,
        # The luck of noise-level gradients under AdamW (module docstring, 3): measured up to
        # 5.6e-5 in the weight deltas and 8e-6 in the final logits (tiny, 7 models, 32 steps),
        # where the unpatched run happened to drift 10x less. A run that actually diverges is
        # 1e-2 or more away.
        drift_floor=2e-4,
    ),
    "bf16": Tolerance(
        loss=1e-2,
        # z = s·lse², so its relative error is twice lse's: twice the loss tolerance. Measured up
        # to 1.0e-2 over 32 tiny steps, where the bf16 reference's own z-loss is 3.9e-2 off the
        # fp32 run's.
        z_loss=2e-2,
        # Same weights, so only the loss head differs: transformers rounds the logits to bf16,
        # the kernel keeps them in fp32 (measured up to 5e-5).
        same_weights_loss=1e-3,
        # bf16 keeps 8 mantissa bits (eps 7.8e-3). The unpatched model's own step-0 gradients and
        # eval logits are up to 1.2e-2 off the fp32 run's (measured at full width, gemma3), and
        # patched vs unpatched compounds two such errors (the RoPE kernel rounds q and k once,
        # transformers rounds cos, sin and each product to bf16). The accuracy budget below is
        # the sharp bf16 check: patched is measured to be as close to fp32 as unpatched.
        grad_step0=3e-2,
        eval=3e-2,
        accuracy_factor=1.5,
        # One bf16 rounding of the kernels' outputs: up to 2^-8 = 3.9e-3 relative where it
        # truncates. Triton's interpreter (CPU) truncates fp32 -> bf16 casts, GPUs round to
        # nearest even; on CPU the patched ∂L/∂logits is 4.3e-3 off fp32 where autograd's is 3e-4.
        accuracy_floor=5e-3,
        # bf16 drift is many small rounding differences, so it is steady: patched vs unpatched
        # distance ratio measured 0.93x-1.22x (tiny, 7 models, 32 steps).
        drift_factor=2.0,
        drift_floor=1e-2,
    ),
}


# The z-loss's own gradient (``z_grad`` of capture.capture_step; untied heads), fp32, same
# weights. What is summed cancels to it from the whole lm_head gradient, so its rounding is
# relatively large where the z-loss is small: measured up to 1.7e-4 at scale 1e-4 and 2e-6 at
# 1e-2 (tiny, probes, the real patch through the interpreter); a 1% error in the z-loss gradient
# is 1e-2.
Z_GRAD = 1e-3
# The probes' gradients (fp32, same weights, every step). Past step 0 the weights have trained and
# fp32's summation-order noise between two correct forwards grows a little: measured up to 1.6e-5
# (the bug-free imitation, Gemma 2 full size, packed, H100; 2-4e-7 tiny); the smallest planted
# gradient bug (1% scale) is 1e-2.
PROBE_GRAD = 3e-5


@dataclass(frozen=True)
class Check:
    run: str
    side: str
    name: str
    value: float
    limit: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.value) and self.value <= self.limit


def _running_max(values: list[float]) -> list[float]:
    out, worst = [], 0.0
    for v in values:
        worst = max(worst, v) if v == v else float("inf")
        out.append(worst)
    return out


def _tightest(values: list[float], limits: list[float]) -> int:
    """The step whose value comes closest to (or furthest past) its limit; a NaN step first."""
    for i, v in enumerate(values):
        if v != v:
            return i
    return max(range(len(values)), key=lambda i: values[i] / limits[i] if limits[i] else values[i])


def worst(values: list[float]) -> tuple[float, int]:
    """The largest value (inf if any is NaN) and its index."""
    if not values:
        return 0.0, -1
    for i, v in enumerate(values):
        if v != v:
            return float("inf"), i
    i = max(range(len(values)), key=values.__getitem__)
    return values[i], i


GRADS = ("grad", "hidden_grad", "lm_head_grad")
# A multimodal wrapper's vision tower and projector: their gradients on their own, held to the
# same limits as every parameter's (inside ``grad`` they are a small part of the norm).
VISION_GRAD = "vision_grad"
EVAL_TENSORS = ("logits", "logits_grad", "hidden_grad", "grad")


def ratio(mine: float, theirs: float) -> float:
    """``mine / theirs``, a multiple of the unpatched run's error (inf where ``mine`` is not finite
    or ``theirs`` is 0 and ``mine`` is not)."""
    if not math.isfinite(mine):
        return float("inf")
    return mine / theirs if theirs > 0 else (float("inf") if mine > 0 else 1.0)


def flip_margin_ratio(mine: dict[str, Any], unpatched: dict[str, Any]) -> tuple[float, str]:
    """The routing check's value: the largest yardstick margin at one of ``mine``'s flips, in
    units of twice the unpatched side's largest router-score error on the same call, and a
    detail line. Both arguments are ``routing.compare_decisions`` results against the yardstick.

    A token flips from expert a (yardstick's k-th or better) to b (its (k+1)-th or worse) only if
    the side's scores moved a and b by more than the yardstick's margin together, so its larger
    score error there is at least half the margin. A side whose router scores are within f times
    the unpatched model's largest error (the accuracy budget's factor) can flip only at margins
    up to 2 f that error: the value is at most f. The unpatched side's own flips are at most 1 by
    construction. A flip at a larger margin means scores off by more than rounding (the hidden
    states the router sees are wrong)."""
    worst, flips, rows, at_margin = 0.0, 0, 0, 0.0
    for c, margins_c in enumerate(mine["flip_margins"]):
        err = unpatched["score_error"][c]
        rows += mine["rows"][c]
        flips += len(margins_c)
        for m in margins_c:
            ratio = m / (2 * err) if err > 0 else (0.0 if m == 0 else float("inf"))
            if ratio >= worst:
                worst, at_margin = ratio, m
    detail = (
        f"{flips}/{rows} decisions flipped (unpatched {sum(unpatched['flips'])}), "
        f"the worst at margin {at_margin:.1e}, unpatched score error up to "
        f"{max(unpatched['score_error'], default=0.0):.1e}"
    )
    return worst, detail


def _consistent(limit: float, unpatched: float, tol: Tolerance) -> float:
    """A direct same-weights limit no tighter than two runs the accuracy budget passes can be
    apart: each within (factor x) the unpatched run's error of the exact one."""
    return max(limit, (1 + tol.accuracy_factor) * unpatched + tol.accuracy_floor)


def evaluate(record: dict[str, Any]) -> list[Check]:
    """Every check of one run (a ``train_and_compare`` record) against ``TOLERANCES``: for each
    patched side, 1. direct, its probe, 2. accuracy and routing, 3. drift (``_SideChecks``)."""
    checks: list[Check] = []
    for side, info in record["sides"].items():
        if info["patched"]:
            checks += _SideChecks(record, side, info["layout"]).all()
    return checks


class _SideChecks:
    """The checks of one patched side of a run, in ``evaluate``'s order."""

    def __init__(self, record: dict[str, Any], side: str, layout: str) -> None:
        cfg = record["config"]
        self.record, self.side, self.layout, self.dtype = record, side, layout, cfg["dtype"]
        self.tol = TOLERANCES[cfg["dtype"]]
        self.run, self.exact = cfg["name"], record["exact"]
        self.z_on = cfg["variant"]["z_loss_scale"] > 0
        # A mixture of experts that trains its router aux loss records it on every side.
        self.aux_on = "aux_loss" in record["sides"]["reference"]
        self.steps = record["steps"]
        self.ref_exact = self.steps[f"reference~{self.exact}"]
        self.grads = GRADS + ((VISION_GRAD,) if self.ref_exact.get(VISION_GRAD) else ())
        self.checks: list[Check] = []

    def all(self) -> list[Check]:
        for part in (self.direct, self.probe, self.accuracy, self.routing, self.drift):
            part()
        return self.checks

    def add(self, name: str, value: float, limit: float, detail: str = "") -> None:
        self.checks.append(Check(self.run, self.side, name, value, limit, detail))

    def consistent(self, limit: float, unpatched: float) -> float:
        return _consistent(limit, unpatched, self.tol)

    def budget(self, name, mine, theirs, factor, floor, detail="") -> None:
        self.add(name, mine, factor * theirs + floor, f"unpatched {theirs:.2e} {detail}".strip())

    def direct(self) -> None:
        """1. Direct. Over the run, the loss curves may be as far apart as the dtype's loss
        tolerance plus the drift budget of the unpatched run's own distance from the run one
        precision up (3. below), step by step: at full size AdamW amplifies rounding into loss
        curves that separate for any two correct runs (measured on an H200, Llama fp32 full at
        lr 1e-3: unpatched vs fp64 5.0e-2 apart at step 31, patched vs unpatched 1.7e-2), so a
        fixed 1e-5 would fail transformers against itself. Step t is held to the unpatched run's
        largest distance up to step t (never a later step's); the check reports the step closest
        to its limit. Same weights (step 0) stay direct. The router aux loss has the loss's
        limits (module docstring, 1)."""
        tol, exact, record, side = self.tol, self.exact, self.record, self.side
        direct = self.steps[f"{side}~reference"]
        for key, limit in (("loss", tol.loss), ("z_loss", tol.z_loss), ("aux_loss", tol.loss)):
            if (key == "z_loss" and not self.z_on) or (key == "aux_loss" and not self.aux_on):
                continue
            envelope = _running_max(self.ref_exact[key])
            limits = [limit + tol.drift_factor * e for e in envelope]
            at = _tightest(direct[key], limits)
            by_then = f"step {at}; unpatched vs {exact} up to {envelope[at]:.1e} by then"
            self.add(key, direct[key][at], limits[at], by_then)
            self.add(f"{key}@0", direct[key][0], tol.same_weights_loss)
        for key in self.grads:
            self.add(
                f"{key}@0", direct[key][0], self.consistent(tol.grad_step0, self.ref_exact[key][0])
            )
        ev = record["eval_init"][f"{side}~reference"]
        self.add("eval_loss", ev["loss"], tol.same_weights_loss)
        if self.z_on:
            self.add("eval_z_loss", ev["z_loss"], tol.same_weights_loss)
        if self.aux_on:
            self.add("eval_aux_loss", ev["aux_loss"], tol.same_weights_loss)
        for key in EVAL_TENSORS:
            unpatched = record["eval_init"][f"reference~{exact}"][key]
            self.add(f"eval_{key}", ev[key], self.consistent(tol.eval, unpatched))
        materialised = side in record["logits_materialised_in_training"]
        self.add("no_logits_in_training", float(materialised), 0.0, "logits returned in training")

    def probe(self) -> None:
        """The probe of this side's layout: the patched model in fp32 on the unpatched fp32 run's
        weights at every step (train.py), held to fp32's same-weights limits in every run."""
        record, probe = self.record, f"probe-{self.layout}"
        if probe not in record.get("probes", {}):
            return
        fp32, grads = TOLERANCES["fp32"], self.grads
        pm = self.steps[f"{probe}~{record['probes'][probe]['partner']}"]
        limits = dict.fromkeys(("loss", "z_loss", "aux_loss"), fp32.same_weights_loss)
        limits.update(dict.fromkeys(grads, PROBE_GRAD), z_grad=Z_GRAD)
        if self.dtype == "fp32":  # the unpatched fp32 run's own error is measured
            limits.update({k: self.consistent(PROBE_GRAD, self.ref_exact[k][0]) for k in grads})
        elif own := record.get("partner_kernel_error"):
            # The bf16 run's fp32 partner through TF32 kernels (linear_attention.PYTORCH_PARTNER):
            # its worst error against its PyTorch path, with fp32's accuracy budget.
            steps = self.steps[own]
            limits.update({k: _consistent(PROBE_GRAD, max(steps[k]), fp32) for k in grads})
        for key, limit in limits.items():
            if key.startswith("z_") and not (self.z_on and pm[key]):
                continue
            if key == "aux_loss" and not self.aux_on:
                continue
            value, at = worst(pm[key])
            self.add(f"probe_{key}", value, limit, f"step {at}, fp32, same weights")

    def accuracy(self) -> None:
        """2. Accuracy with the same weights (step 0, eval batch) against the run one precision
        up."""
        tol, exact, record = self.tol, self.exact, self.record
        vs_exact = self.steps[f"{self.side}~{exact}"]
        for key in self.grads:
            self.budget(f"{key}@0:accuracy", vs_exact[key][0], self.ref_exact[key][0],
                        tol.accuracy_factor, tol.accuracy_floor, f"vs {exact}")  # fmt: skip
        ev_mine = record["eval_init"][f"{self.side}~{exact}"]
        ev_theirs = record["eval_init"][f"reference~{exact}"]
        for key in EVAL_TENSORS:
            self.budget(f"eval_{key}:accuracy", ev_mine[key], ev_theirs[key],
                        tol.accuracy_factor, tol.accuracy_floor, f"vs {exact}")  # fmt: skip

    def routing(self) -> None:
        """Routing (mixtures of experts), with the same weights: the side's own decisions (every
        earlier layer routed like the run one precision up) differ from that run's only where
        rounding can tip them (flip_margin_ratio). The final eval's are recorded, not checked: by
        then the weights differ by the run's drift (a tiny bf16 run's patched side flipped 16 of
        54 decisions at margins up to 7.7e-2, the unpatched one 1, with params:drift 1.76x the
        unpatched run's), which params:drift and final_eval_logits:drift judge, routed alike."""
        for phase, name in (("step0", "routing@0"), ("eval_init", "eval_routing")):
            if self.side in self.record.get("routing", {}).get(phase, {}):
                phase_routing = self.record["routing"][phase]
                value, detail = flip_margin_ratio(
                    phase_routing[self.side], phase_routing["reference"]
                )
                self.add(name, value, self.tol.accuracy_factor, f"{detail}; vs {self.exact}")

    def drift(self) -> None:
        """3. Drift over the run, against the unpatched run's own. The final model's eval loss
        (and aux loss): the same rule as the training loss (``direct``)."""
        tol, exact, record, side = self.tol, self.exact, self.record, self.side
        final_keys = ("loss", "aux_loss") if self.aux_on else ("loss",)
        for key in final_keys:
            theirs = record["eval_final"][f"reference~{exact}"][key]
            mine = record["eval_final"][f"{side}~reference"][key]
            limit = tol.loss + tol.drift_factor * theirs
            self.add(f"final_eval_{key}", mine, limit, f"unpatched vs {exact} {theirs:.1e}")
        self.budget("final_eval_logits:drift", record["eval_final"][f"{side}~{exact}"]["logits"],
                    record["eval_final"][f"reference~{exact}"]["logits"], tol.drift_factor,
                    tol.drift_floor)  # fmt: skip
        final = record["final"]
        self.budget("params:drift", final[f"{side}~{exact}"]["param_delta_global"],
                    final[f"reference~{exact}"]["param_delta_global"], tol.drift_factor,
                    tol.drift_floor)  # fmt: skip
