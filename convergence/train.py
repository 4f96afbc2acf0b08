"""Train the original and the patched mini model side by side and record what can be compared.

Every side (``side.Side``) starts from the same weights, sees the same documents in the same
order and takes AdamW steps in lockstep, so each step's gradients can be compared while they
exist (``capture``: kept whole) and nothing but scalars is kept. The sides:

- ``reference``: the unpatched HF model on padded batches; the loss is computed from its logits
  in fp32 by :func:`surgery.convergence.loss.causal_lm_loss`.
- ``patched-padded`` / ``patched-packed``: ``surgery.patch``-ed copies on the same documents,
  padded or packed into one row. Both are compared with the padded reference: for the packed side
  that is the packing-equivalence check, and it does not depend on whether the installed
  transformers keeps packed documents apart under SDPA/eager attention (with the configs' default
  ``use_cache`` it does not: the patched forward's guard is tested). They get their labels as
  real pipelines hand them over (``side.Side.inputs``).
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
  (``linear_attention.PYTORCH_PARTNER``).

Training steps compare what ``capture.capture_step`` holds; logits and their gradients are
compared on an eval batch before and after training, where every side materialises them. A
mixture of experts trains its router aux loss on every side (``side``).

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

import copy
import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from .capture import (
    METRICS,
    Comparisons,
    Whole,
    capture_eval,
    capture_step,
    delta_metrics,
    eval_metrics,
    rel_err,
    run_record,
    step_metrics,
)
from .configs import ARCHITECTURES, FALLBACK, SIZES, build_model
from .data import collate, make_batches
from .linear_attention import (
    PYTORCH_PARTNER,
    binds_linear_attention_kernels,
    pytorch_linear_attention,
)
from .routing import Decision, compare_decisions
from .side import DTYPES, EXACT, LAYOUTS, Side, Variant, patch_as_the_suite_does, to_device

__all__ = ["DTYPES", "LAYOUTS", "RunConfig", "Variant", "rel_err", "train_and_compare"]


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


def train_and_compare(
    cfg: RunConfig,
    *,
    patch: Callable[..., Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` and return a json-able record: per-side losses, per-step and final differences.

    ``patch`` defaults to ``surgery.patch`` (``side.default_patch``); it is called as
    ``patch(model, rope=True, fused_linear_cross_entropy=True, loss_reduction=...,
    z_loss_scale=..., label_smoothing=...)``.
    """
    t0 = time.perf_counter()
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    initial = _initial_model(cfg.model, cfg.size, cfg.seed, cfg.config_overrides, cfg.multimodal)
    inputs = _run_inputs(cfg, initial)
    base = _cast(copy.deepcopy(initial), dtype, device)
    base.train()
    init = {k: p.detach().clone() for k, p in base.named_parameters()}
    run = _plan_sides(cfg, functools.partial(_new_side, base, inputs, cfg, patch), inputs)
    run.evaluate("eval_init")
    for step, docs in enumerate(inputs.train_docs):
        run.step(step, docs)
        if progress is not None and ((step + 1) % 8 == 0 or step + 1 == cfg.steps):
            progress(
                f"{cfg.name}: step {step + 1}/{cfg.steps}  loss "
                + "  ".join(f"{s.name} {s.losses[-1]:.4f}" for s in run.sides)
            )
    run.evaluate("eval_final")
    run.compare_weights(init)
    record = run.record(cfg, inputs.train_docs, time.perf_counter() - t0)
    return {**record, "vision_parameters": len(inputs.vision)}


class _Inputs(NamedTuple):
    """A run's architecture spec, its vision parameters (a multimodal wrapper's), its training
    and eval documents, how they are collated, and the device the sides run on."""

    spec: Any
    vision: list[str]
    train_docs: list
    eval_docs: list
    collate_fn: Callable
    device: torch.device


def _run_inputs(cfg: RunConfig, initial) -> _Inputs:
    device = torch.device(cfg.device)
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
            device,
        )
    train_docs, eval_docs = make_batches(cfg.size, cfg.steps, kind=cfg.data, seed=cfg.seed)
    return _Inputs(ARCHITECTURES[cfg.model], [], train_docs, eval_docs, collate, device)


def _plan_sides(cfg: RunConfig, side: Callable[..., Side], inputs: _Inputs) -> _Lockstep:
    """The run's sides (``side`` makes each: the reference, the patched layouts, the yardstick
    one precision up) and probes, with the pairs compared, in a ``_Lockstep``."""
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
    # without one counts the real tokens all the same (Side.forward).
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
    return _Lockstep(sides, probes, partner, exact_name, pairs, probe_pairs, inputs)


def _new_side(base, inputs: _Inputs, cfg: RunConfig, patch, name, layout, patched, model_dtype,
              mask=True, probe=False) -> Side:  # fmt: skip
    """A side of the run: a copy of ``base`` in ``model_dtype``, patched as the suite patches
    (``patch``) where ``patched``."""
    spec, v = inputs.spec, cfg.variant
    model = _cast(copy.deepcopy(base), model_dtype)
    if spec.router_aux_loss:
        # Trained and compared (side's docstring), with the mini config's coefficient (a
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
    return Side(name, model, layout, patched, v, cfg, mask, probe, inputs.vision)


class _Lockstep:
    """The sides trained in lockstep and the probes on their partner's weights: the eval batch
    (``evaluate``), one training step at a time (``step``), the weights' change
    (``compare_weights``), each measured for every compared pair, and the record."""

    def __init__(self, sides, probes, partner, exact_name, pairs, probe_pairs, inputs: _Inputs):
        self.sides, self.probes, self.partner = sides, probes, partner
        self.exact_name, self.inputs = exact_name, inputs
        # ``pairs``: the sides' pairs, compared at every step, on the eval batch and in their
        # weights; ``probe_pairs`` at every step only.
        self.pairs, self.step_pairs = pairs, pairs + probe_pairs
        self.by_name = {s.name: s for s in sides + probes}
        self.z_on = sides[0].variant.z_loss_scale
        self.compared = Comparisons(
            steps={f"{a}~{b}": {k: [] for k in METRICS} for a, b in self.step_pairs}
        )
        self.logits_materialised: list[str] = []
        self.routed = False  # a mixture of experts (known from the first eval batch)

    def _batch(self, docs, side: Side) -> dict[str, torch.Tensor]:
        return to_device(self.inputs.collate_fn(docs, side.layout), self.inputs.device)

    def evaluate(self, phase: str) -> None:
        """Logits, loss and every gradient on the eval batch, for each pair of sides, into
        ``compared.<phase>`` ("eval_init", "eval_final"); and each side's routing decisions
        against the yardstick's (``_routing_summary``), into ``compared.routing[phase]``.

        A mixture of experts runs every side with the yardstick's routing replayed at the real
        tokens (``routing``): where rounding alone tips a near-tied router, the sides would
        otherwise compare different experts' outputs for that token. What each side would have
        picked itself, with every earlier layer routed alike, is what the summary compares."""
        exact, keep = self.exact_name, Whole(clone_grads=True)
        captured: dict[str, dict[str, Any]] = {}
        decisions: dict[str, list[Decision]] = {}
        for side in _yardstick_first(self.sides, exact):

            def routed(batch, side=side, replay=None if side.name == exact else decisions[exact]):
                out, decisions[side.name] = side.routed_forward(batch, replay)
                return out

            batch = self._batch(self.inputs.eval_docs, side)
            captured[side.name] = capture_eval(side, batch, routed, keep)
        aux_on = self.sides[0].aux_coef is not None
        getattr(self.compared, phase).update(
            {f"{a}~{b}": eval_metrics(captured[a], captured[b], self.z_on, aux_on)
             for a, b in self.pairs}
        )  # fmt: skip
        summary = _routing_summary(decisions, exact)
        if phase == "eval_init":
            # The yardstick's eval forward made topk calls (a dense model makes none, and runs
            # without routing from then on).
            self.routed = bool(summary)
        if self.routed:
            self.compared.routing[phase] = summary

    def step(self, step: int, docs) -> None:
        """Training step ``step`` of every side on ``docs`` and one probe step: each pair's
        ``step_metrics`` appended; then the sides' optimizer steps."""
        batches = {s.name: self._batch(docs, s) for s in self.sides + self.probes}
        captured, decisions, keep = {}, {}, Whole()
        # A mixture of experts trains every side with the yardstick's routing of the step
        # replayed at the real tokens (module docstring), the yardstick first; the probes route
        # as their partner did, which is the yardstick's routing too.
        for s in _yardstick_first(self.sides, self.exact_name) if self.routed else self.sides:
            replay = None if s.name == self.exact_name else decisions.get(self.exact_name)
            out = self._forward_backward(s, batches[s.name], replay, decisions)
            if s.patched and out.logits is not None:
                self.logits_materialised.append(s.name)
            captured[s.name] = capture_step(s, batches[s.name], s.record(out), keep, self.z_on)
        for p in self.probes:
            with torch.no_grad():
                for mine, theirs in zip(p.params.values(), self.partner.params.values()):
                    mine.copy_(theirs)
            out = self._forward_backward(p, batches[p.name], decisions.get(self.exact_name))
            captured[p.name] = capture_step(p, batches[p.name], p.record(out), keep, self.z_on)
        for a, b in self.step_pairs:
            aux_on = self.by_name[b].aux_coef is not None
            metrics = self.compared.steps[f"{a}~{b}"]
            for k, value in step_metrics(captured[a], captured[b], self.z_on, aux_on).items():
                metrics[k].append(value)
        del batches, captured
        for s in self.sides:
            s.step()
        if self.routed and step == 0:
            self.compared.routing["step0"] = _routing_summary(decisions, self.exact_name)

    def _forward_backward(self, side: Side, batch, replay, decisions=None):
        """``side``'s forward on ``batch`` (routed, replaying ``replay``, in a mixture of experts;
        its decisions kept in ``decisions``) and backward, from cleared gradients."""
        side.zero_grad()
        if self.routed:
            out, mine = side.routed_forward(batch, replay)
            if decisions is not None:
                decisions[side.name] = mine
        else:
            out = side.forward(batch)
        out.loss.backward()
        return out

    def compare_weights(self, init: dict[str, torch.Tensor]) -> None:
        """Each pair's difference in what training changed of every parameter (final minus
        ``init``), into ``compared.final`` (``capture.delta_metrics``)."""
        for a, b in self.pairs:
            pa, pb = self.by_name[a].params, self.by_name[b].params
            da = {k: pa[k].double() - init[k].double() for k in pb}
            db = {k: pb[k].double() - init[k].double() for k in pb}
            self.compared.final[f"{a}~{b}"] = delta_metrics(da, db, [*da.values()], [*db.values()])

    def record(self, cfg: RunConfig, train_docs, seconds: float) -> dict[str, Any]:
        """The run's record (``capture.run_record``)."""
        v = cfg.variant
        return run_record(
            {**asdict(cfg), "variant": {**asdict(v), "name": v.name}, "name": cfg.name},
            self.exact_name,
            {s.name: {"layout": s.layout, "patched": s.patched, **s.series()} for s in self.sides},
            {
                p.name: {"layout": p.layout, "partner": self.partner.name, **p.series()}
                for p in self.probes
                if p.patched
            },
            self.compared,
            logits_materialised=set(self.logits_materialised),
            train_docs=train_docs,
            seconds=seconds,
            size=asdict(SIZES[cfg.size]),
            partner_kernel_error=f"{self.partner.name}~{PYTORCH_PARTNER}"
            if PYTORCH_PARTNER in self.by_name
            else None,
        )


def _cast(model: torch.nn.Module, dtype: torch.dtype, device=None) -> torch.nn.Module:
    """``model.to(device, dtype)`` for its floating-point tensors only: ``Module.to`` would cast a
    complex buffer (Llama 4's vision RoPE, ``freqs_ci``) to the real dtype, dropping its imaginary
    part; it is kept as built (its forward computes in complex64 whatever the dtype)."""
    return model._apply(lambda t: t.to(device, dtype if t.is_floating_point() else None))


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


def _yardstick_first(sides: list[Side], exact: str) -> list[Side]:
    return sorted(sides, key=lambda s: s.name != exact)


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
