"""Training sides one after another and comparing them as if they had trained side by side:
the runner behind ``pretrained`` (a real model and its AdamW state may fit only once).

A side (``SideSpec``) is loaded from the checkpoint, trained on the batches and dropped before the
next one starts; nothing of model size outlives it. The sides are the lockstep run's
(``side.Side``), captured and compared by the same core (``capture``: every step's gradients of
all parameters, of the final norm's output and of the lm_head, the eval batch's logits and their
gradients, and the weight deltas from the initial weights); what the lockstep run (``train``)
keeps whole, this one keeps as a fixed random linear map of each tensor (``capture.Sketched``,
2^14 fp64 numbers, the same map for every side; the weight deltas from a sketch of the weights at
the start and at the end: the map is linear). A relative error read off two sketches is the
tensors' own to within about 1%. Losses are scalars and exact. A side compared with later ones
(``keep``: the reference and the yardstick) keeps 0.4 MB a step; the others are compared as their
steps happen and keep nothing. The result is the record's pair entries
(``SequentialRunner.compared``, a ``capture.Comparisons``) and each side's ``SideTrace``.

The fp32 probes of ``train`` (the patched model on the unpatched fp32 run's weights at every
step) run inside their partner's run, as patched copies of its modules that share its parameters
and gradients: no weights of their own. At each step they run just before the partner's own
forward and backward, on the same weights.

Mixtures of experts get ``train``'s router replay (``routing``), with one difference the order
forces: the routing every side replays on one batch (the eval batch before and after training,
and each training step) is that of the first side run, the reference, which routes freely, since
the yardstick runs after it. At a training step a forward of the reference without gradients
picks the routing; its probes, its own step and every later side's replay it (kept on the CPU:
step 0's with the scores ranked, later steps' picks alone). Each side's own decisions at step 0
and on the eval batches (every earlier layer routed as the reference's) are compared with the
yardstick's once both have run (``routing`` in the record, judged by
``compare.flip_margin_ratio`` as in the mini runs). A router aux loss is trained and recorded as
in ``train``.
"""

from __future__ import annotations

import copy
import functools
import gc
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import (
    METRICS,
    Comparisons,
    Sketched,
    capture_eval,
    capture_step,
    delta_metrics,
    eval_metrics,
    rel_err,
    step_metrics,
)
from .data import Document, collate
from .routing import Decision, compare_decisions
from .side import (
    DTYPES,
    Forward,
    Side,
    adds_router_aux_loss,
    loss_series,
    patch_as_the_suite_does,
    router_aux_loss_trained,
    to_device,
    values,
)
from .sketch import SKETCH_WIDTH, CountSketch

__all__ = ["SequentialRunner", "SideSpec", "SideTrace", "prepare_model"]

# Per-tensor weight deltas are only kept for the json (compare judges the global one): a small map.
_PER_TENSOR_WIDTH = 1 << 10


@dataclass(frozen=True)
class SideSpec:
    """One side: its name (a key of the record), layout, whether it is patched, its dtype, and
    how it runs."""

    name: str
    layout: str
    patched: bool
    dtype: torch.dtype
    mask: bool = True
    grad_noise: float = 0.0  # the twin: each gradient element g -> g + δg, |δ| ≤ grad_noise
    train: bool = True  # False: step 0's forward and backward only, no optimizer (init yardstick)
    keep: bool = False  # keep every step's sketches: later sides are compared with this one
    probes: tuple[str, ...] = ()  # the fp32 partner: a patched probe per layout on its weights


@dataclass
class SideTrace:
    """What is left of a side once its model is gone."""

    spec: SideSpec
    losses: list[float] = field(default_factory=list)
    z_losses: list[float] = field(default_factory=list)
    aux_losses: list[float] | None = None  # a router aux loss trained: its value at every step
    steps: list[dict[str, Any]] = field(default_factory=list)  # only when spec.keep
    eval_init: dict[str, Any] | None = None
    eval_final: dict[str, Any] | None = None
    init: torch.Tensor | None = None  # sketch of the initial weights (all tensors)
    delta: torch.Tensor | None = None  # sketch of final − initial weights
    delta_per_tensor: dict[str, torch.Tensor] = field(default_factory=dict)
    logits_materialised: bool = False
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> layout, losses
    # A mixture of experts: the side's own routing decisions (on the CPU) by phase ("eval_init",
    # "step0", "eval_final"), until compared with the yardstick's.
    decisions: dict[str, list[Decision]] = field(default_factory=dict)
    peak_bytes: int | None = None  # CUDA: in the training steps (eval batches make logits)
    peak_bytes_all: int | None = None  # CUDA: including the eval batches

    def series(self) -> dict[str, list[float]]:
        """The side's recorded losses, as ``Side.series``."""
        return loss_series(self.losses, self.z_losses, self.aux_losses)


def _round_once_more(side: Side, noise: float, step: int, seed: int) -> None:
    """The twin's extra rounding: every gradient element ``g`` becomes ``g + δ g`` rounded to
    the gradient's dtype, δ uniform in ``[-noise, noise]``, seeded by the step and the parameter's
    name (``g · (1 + δ)`` would round ``1 + δ`` first: in fp32, to 1)."""
    with torch.no_grad():
        for name, p in side.params.items():
            if p.grad is None:
                continue
            gen = torch.Generator(device=p.grad.device)
            gen.manual_seed((seed << 32) ^ (step << 20) ^ zlib.crc32(name.encode()))
            delta = torch.rand(p.grad.shape, generator=gen, device=p.grad.device) * 2 - 1
            g = p.grad.float()
            p.grad.copy_(torch.addcmul(g, g, delta, value=noise))


def prepare_model(model, dtype: torch.dtype) -> None:
    """Dropout off everywhere (two correct runs with dropout differ by design), and a
    mixture-of-experts model whose causal-LM forward adds a router aux loss trains it (with the
    checkpoint's ``router_aux_loss_coef``), as in ``train``. ``use_cache`` stays as the checkpoint
    has it, as in the mini configs: with a cache transformers lets packed documents attend to each
    other, so the packed side tests the patched forward's own guard against that."""
    config = model.config
    if adds_router_aux_loss(model):
        config.output_router_logits = True
    moe = getattr(config, "output_router_logits", None) is not None
    if moe and dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        # transformers' default experts implementation (grouped_mm) has no fp64 kernel.
        model.set_experts_implementation("eager")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0


class SequentialRunner:
    """Runs sides one at a time with ``run_side``; ``traces`` and the pair entries
    (``compared``: ``steps``, ``eval_init``, ``eval_final``, ``final``, ``routing``) fill in as
    they finish. ``run`` gives the checkpoint, its dtype, the device, the loss variant, the
    learning rate, the seed and the name shown in progress lines (a ``pretrained.PretrainedRun``);
    ``patch``: what patches the patched sides (None: ``side.default_patch()``)."""

    def __init__(self, run, patch, progress, train_docs, eval_docs):
        self.run = run
        self.patch = patch
        self.progress = progress
        self.train_docs = train_docs
        self.eval_docs = eval_docs
        self.device = torch.device(run.device)
        self.z_on = run.variant.z_loss_scale > 0
        self.sketch = CountSketch(SKETCH_WIDTH, seed=run.seed)
        self.small_sketch = CountSketch(_PER_TENSOR_WIDTH, seed=run.seed)
        self.keep = Sketched(self.sketch)
        self.traces: dict[str, SideTrace] = {}
        # Every finished pair's measurements (routing: each side's own against the yardstick's).
        self.compared = Comparisons()
        self.n_params = 0
        self.aux_on = False  # the model trains a router aux loss (known once a side has loaded)
        # Mixtures of experts (module docstring): the routing every later side replays, by phase
        # (the first side's, on the CPU); whether the model routes at all (known after the first
        # side's eval batch); and the side whose decisions the others' are judged against (set
        # by the caller before that side runs).
        self.replay_source: dict[str, list[Decision]] = {}
        self.routed = False
        self.routing_yardstick: str | None = None

    def _load(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        run = self.run
        # A weight the checkpoint lacks is initialised at random: the same way for every side.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.seed)
            model = AutoModelForCausalLM.from_pretrained(run.checkpoint, dtype=DTYPES[run.dtype])
        # Loaded in the run's dtype first, so the yardstick starts from the same rounded weights.
        model = model.to(device=self.device, dtype=dtype)
        prepare_model(model, dtype)
        model.train()
        return model

    def _collate(self, docs: Sequence[Document], layout: str) -> dict[str, torch.Tensor]:
        return to_device(collate(docs, layout), self.device)

    def _probe(self, model, layout: str, partner: SideSpec) -> Side:
        """As train's probes: the patched model in fp32 on the fp32 partner's weights at every
        step, to be held to fp32's same-weights limits. Here it is a patched copy of the
        partner's modules that shares its parameters (and their gradients), so it costs no
        weights of its own; it runs before the partner at each step."""
        shared = {id(p): p for p in model.parameters()}
        probe = self._patched(copy.deepcopy(model, shared))
        v = self.run.variant
        # As in train: the attention mask where the router aux loss reads it.
        mask = partner.mask or router_aux_loss_trained(model)
        return Side(f"probe-{layout}", probe, layout, True, v, self.run, mask, probe=True)

    def _patched(self, model):
        """``model`` patched as ``train``'s sides are."""
        return patch_as_the_suite_does(self.patch, model, self.run.variant)

    def _replayed(self, side: Side, batch, phase: str, trace: SideTrace) -> Forward:
        """``side.forward(batch)`` with the routing of ``phase`` that every side replays: the
        first side to run the phase routes freely and its decisions become that routing. The
        side's own decisions are kept in ``trace`` for the comparison with the yardstick's."""
        source = self.replay_source.get(phase)
        out, decisions = side.routed_forward(batch, source)
        own = [Decision(d.scores.cpu(), d.indices.cpu(), d.largest) for d in decisions]
        if source is None:
            self.replay_source[phase] = own
        if own:
            trace.decisions[phase] = own
        return out

    def _step_routing(self, side: Side, batch, t: int) -> list[Decision]:
        """The routing every side replays at training step ``t``: the first side's own, from a
        forward of it without gradients (kept from step 0 on with its scores, which the step-0
        comparison judges; later steps keep the picks alone, and only their shape of the
        scores, which is what replay checks)."""
        phase = "step0" if t == 0 else f"train{t}"
        if phase not in self.replay_source:
            with torch.no_grad():
                _, decisions = side.routed_forward(batch, None)
            self.replay_source[phase] = [
                Decision(
                    d.scores.cpu() if t == 0 else d.scores.new_zeros(()).expand(d.scores.shape),
                    d.indices.cpu(),
                    d.largest,
                )
                for d in decisions
            ]
        return self.replay_source[phase]

    def _capture_eval(self, side: Side, phase: str, trace: SideTrace) -> dict[str, Any]:
        """The eval batch's capture of ``side`` (``capture.capture_eval``) under ``phase``'s
        replayed routing."""
        batch = self._collate(self.eval_docs, side.layout)
        forward = functools.partial(self._replayed, side, phase=phase, trace=trace)
        return capture_eval(side, batch, forward, self.keep)

    def _weights(self, side: Side) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            whole = self.sketch(side.params.items())
            per_tensor = {k: self.small_sketch.one(k, p) for k, p in side.params.items()}
        return whole, per_tensor

    def run_side(self, spec: SideSpec, pairs: list[tuple[str, str]]) -> SideTrace:
        """Train ``spec``'s side and compare it, step by step, with the sides already run, in the
        ``pairs`` that name it; what it leaves is stored only when the side has finished, so a
        side that runs out of memory leaves nothing behind."""
        mine = [(a, b) for a, b in pairs if spec.name in (a, b)]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        side, probes, trace, init_per_tensor = self._start_side(spec)
        peaks = [self._peak(reset=True)]
        mine += [(probe.name, spec.name) for probe in probes]
        steps = {f"{a}~{b}": {k: [] for k in METRICS} for a, b in mine}
        batches = self.train_docs if spec.train else self.train_docs[:1]
        for t, docs in enumerate(batches):
            self._train_step(side, probes, spec, trace, t, docs, mine, steps)
            if self.progress is not None and ((t + 1) % 8 == 0 or t + 1 == len(batches)):
                self.progress(
                    f"{self.run.name} {spec.name}: step {t + 1}/{len(batches)}  "
                    f"loss {trace.losses[-1]:.4f}"
                )
        peaks.append(self._peak(reset=True))
        trace.peak_bytes = peaks[-1]
        if spec.train:
            trace.eval_final = self._capture_eval(side, "eval_final", trace)
            final, final_per_tensor = self._weights(side)
            trace.delta = final - trace.init
            trace.delta_per_tensor = {
                k: final_per_tensor[k] - start for k, start in init_per_tensor.items()
            }
        peaks.append(self._peak())
        trace.peak_bytes_all = None if None in peaks else max(peaks)
        trace.probes = {
            probe.name: {"layout": probe.layout, "partner": spec.name, **probe.series()}
            for probe in probes
        }
        del side, probes
        self._free()
        self._store(spec, trace, mine, steps)
        return trace

    def _start_side(self, spec: SideSpec):
        """``spec``'s model loaded (and patched), its probes, its trace with the initial weights
        and the eval batch's capture; and the initial weights per tensor."""
        run = self.run
        model = self._load(spec.dtype)
        if spec.patched:
            model = self._patched(model)
        elif type(model).forward is not model.forward.__func__:
            raise RuntimeError(f"{spec.name}: the unpatched model's forward was replaced")
        probes = [self._probe(model, layout, spec) for layout in spec.probes]
        side = Side(spec.name, model, spec.layout, spec.patched, run.variant, run, spec.mask)
        trace = SideTrace(spec)
        self.n_params = sum(p.numel() for p in side.params.values())
        init, init_per_tensor = self._weights(side)
        ref = self.traces.get("reference")
        if ref is not None and rel_err(init, ref.init) > 1e-12:
            raise RuntimeError(
                f"{spec.name} did not start from the reference's weights: loading "
                f"{run.checkpoint} twice gave different weights"
            )
        trace.init = init
        self.aux_on = side.aux_coef is not None
        if self.aux_on:
            trace.aux_losses = []
        trace.eval_init = self._capture_eval(side, "eval_init", trace)
        self.routed = bool(self.replay_source["eval_init"])
        return side, probes, trace, init_per_tensor

    def _train_step(self, side, probes, spec: SideSpec, trace: SideTrace, t: int, docs, mine,
                    steps) -> None:  # fmt: skip
        """Step ``t`` on ``docs``: the probes on the side's weights, then the side (trained where
        ``spec.train``); each pair's metrics of the step appended to ``steps``."""
        batch = self._collate(docs, spec.layout)
        # A mixture of experts trains under the step's routing (module docstring): the first
        # side's, picked by a forward of it without gradients, which its probes and its own step
        # replay; every later side and its probes replay it.
        routing = self._step_routing(side, batch, t) if self.routed else None
        probed = {probe.name: self._probe_step(probe, docs, routing) for probe in probes}
        side.zero_grad()
        if routing is None:
            fwd = side.forward(batch)
        elif t == 0:
            # The side's own step-0 decisions are judged against the yardstick's.
            fwd = self._replayed(side, batch, "step0", trace)
        else:
            fwd, _ = side.routed_forward(batch, routing)
        fwd.loss.backward()
        if spec.grad_noise:
            _round_once_more(side, spec.grad_noise, t, self.run.seed)
        trace.logits_materialised |= spec.patched and fwd.logits is not None
        here = capture_step(side, batch, values(fwd), self.keep, self.z_on)
        del batch, fwd
        trace.losses.append(here["loss"])
        trace.z_losses.append(here["z_loss"])
        if self.aux_on:
            trace.aux_losses.append(here["aux_loss"])
        if spec.keep:
            trace.steps.append(here)
        for a, b in mine:
            if a in probed:
                xa, xb = probed[a], here
            else:
                other = self.traces[b if a == spec.name else a]
                if t >= len(other.steps):
                    continue
                xa, xb = (here, other.steps[t]) if a == spec.name else (other.steps[t], here)
            for k, value in step_metrics(xa, xb, self.z_on, self.aux_on).items():
                steps[f"{a}~{b}"][k].append(value)
        del here, probed, routing
        if spec.train:
            side.step()

    def _probe_step(self, probe, docs, routing) -> dict[str, Any]:
        """One step of ``probe`` (on its partner's current weights) on ``docs``: its capture."""
        probe_batch = self._collate(docs, probe.layout)
        probe.zero_grad()
        if routing is not None:
            fwd, _ = probe.routed_forward(probe_batch, routing)
        else:
            fwd = probe.forward(probe_batch)
        fwd.loss.backward()
        return capture_step(probe, probe_batch, probe.record(fwd), self.keep, self.z_on)

    def _store(self, spec: SideSpec, trace: SideTrace, mine, steps) -> None:
        """The finished side and its pairs with the sides run before it, stored."""
        self.traces[spec.name] = trace
        compared, on = self.compared, (self.z_on, self.aux_on)
        for a, b in mine:
            key = f"{a}~{b}"
            compared.steps[key] = steps[key]
            if a in trace.probes:
                continue
            ta, tb = self.traces[a], self.traces[b]
            compared.eval_init[key] = eval_metrics(ta.eval_init, tb.eval_init, *on)
            if ta.eval_final is not None and tb.eval_final is not None:
                compared.eval_final[key] = eval_metrics(ta.eval_final, tb.eval_final, *on)
                compared.final[key] = delta_metrics(
                    ta.delta_per_tensor, tb.delta_per_tensor, ta.delta, tb.delta
                )
        self._compare_routing()

    def _compare_routing(self) -> None:
        """Each finished side's own routing decisions against the yardstick's, by phase
        (``routing.compare_decisions``), once the yardstick has run; then they are dropped."""
        yardstick = self.traces.get(self.routing_yardstick)
        if yardstick is None:
            return
        for name, trace in self.traces.items():
            if trace is yardstick:
                continue
            for phase, mine in trace.decisions.items():
                if phase in yardstick.decisions:
                    theirs = yardstick.decisions[phase]
                    by_side = self.compared.routing.setdefault(phase, {})
                    by_side[name] = compare_decisions(mine, theirs)
            trace.decisions = {}

    def _peak(self, reset: bool = False) -> int | None:
        """CUDA: the most memory allocated since the last reset (None elsewhere)."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device)
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def _free(self) -> None:
        gc.collect()  # the side's norm hook holds a cycle through the model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
