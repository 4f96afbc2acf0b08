"""The convergence check on the user's own checkpoint and data (``python -m surgery.convergence
--pretrained PATH_OR_HUB_ID [--data FILE]``): the sides of the mini runs (``train``), loaded
with ``from_pretrained`` in the run's dtype, trained one after another on the same batches, and
the same record, so ``compare.evaluate`` gives the verdict with the mini configs' rules.

One after another, because a real model and its AdamW state may fit only once (``sequential``:
each side is loaded, trained and dropped before the next starts; tensors are compared through
fixed random sketches, good to about 1%). The sides: ``reference`` (padded), the yardstick, and
``patched-padded`` / ``patched-packed``, as in ``train``; the fp32 probes run inside the unpatched
fp32 run (the reference of an fp32 run, the yardstick of a bf16 one). The model is set up as the
mini models are (``sequential.prepare_model``: a mixture of experts trains its router aux loss with
the checkpoint's coefficient). Padded rows are padded with token 0: right padding under causal
attention is never seen by a real token, so its id does not matter. A mixture of experts runs with
the mini runs' router replay (``routing``), the reference's routing replayed since it runs first
(``sequential``), its own decisions and every other side's judged against the yardstick's
(``record["routing"]``, as in ``train``).

The yardstick (the mini rule: the unpatched run one precision up, fp32 for bf16, fp64 for fp32,
trained on the same batches) needs twice the reference's memory. ``yardstick``:

- ``"full"``: run it, as the mini configs do.
- ``"init"``: the rule for a model whose yardstick does not fit. Accuracy is still measured one
  precision up, at the initial weights only (one forward and backward on the first batch and the
  eval batch, no optimizer, so about the memory of the run itself): the step-0 gradients and the
  eval batch before training. The drift budget (every later step's loss, the final eval loss and
  logits, the weight deltas) comes from the unpatched run's twin instead: the same run in the
  same dtype with one more rounding error of that dtype on every gradient element at every step
  (each multiplied by ``1 + δ``, δ uniform in ``[-u, u]``, u the dtype's unit roundoff, seeded).
  AdamW carries a per-step difference into loss curves and weights that separate however exact
  both runs are, in proportion to the difference while it is small. So the twin's distance from
  the unpatched run, scaled by how much farther the unpatched step-0 gradients are from the
  yardstick's than from the twin's (``twin_scale``, at least 1), estimates how far a correct
  patch, whose per-step error is the size of transformers' own, drifts from the unpatched run.
  The estimate stands where the mini rule has the unpatched run's distance from the yardstick,
  and the patched run's distance from the twin stands for its own.

  It is an estimate, and a stricter budget where low precision biases both runs alike, which the
  mini rule's yardstick counts in: bf16 weights round away updates below half an ulp, so at lr
  1e-5 a tiny Llama's bf16 weight deltas (unpatched and patched alike) were 0.93 away from the
  fp32 run's, while the twin estimate was 3.5e-2 and the patched run 4.0e-2 from the unpatched
  one. On that model (CPU, 6-12 steps, lr 1e-5 to 1e-3, text and chat data) the patched run's
  weight deltas were 0.9x-1.6x the estimate away from the unpatched run's in bf16 (the drift
  factor is 2, plus the floor 1e-2) and 0.4x-3.9x in fp32, where the floor, 2e-4, is 50 times
  either.
- ``"auto"`` (default): "full" when it fits (on CUDA, twice the reference's peak memory within
  90% of the free memory; on the CPU, 4 fp32/fp64 copies of the weights plus a quarter within the
  available memory), else "init"; and "init" when the full run runs out of memory after all.

In the record, ``exact`` names the yardstick; under "init" it is ``<fp32|fp64>-reference@init+
<dtype>-twin``: each pair with it holds step 0 and the eval batch before training from the
first; every later step, the final eval batch and the weight deltas from the second, the
unpatched run's scaled by ``twin_scale`` (the unscaled ones are kept under ``pretrained``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .capture import run_record
from .data import (
    DATA_KINDS,
    Document,
    read_documents,
    split_batches,
    synthetic_batches,
)
from .sequential import SequentialRunner, SideSpec
from .side import DTYPES, EXACT, LAYOUTS, Variant
from .sketch import SKETCH_WIDTH

__all__ = [
    "YARDSTICKS",
    "PretrainedRun",
    "describe_rules",
    "load_batches",
    "train_and_compare_pretrained",
]

YARDSTICKS = ("auto", "full", "init")
_GIB = 2**30


@dataclass(frozen=True)
class PretrainedRun:
    """One run on a real checkpoint: ``checkpoint`` (a local folder or a hub id), the data (a
    synthetic kind of ``data.DATA_KINDS`` or a ``.jsonl`` / ``.txt`` file), ``batch_size``
    documents of at most ``max_length`` tokens a step, and the yardstick rule (module docstring).
    ``lr`` defaults to a fine-tuning rate."""

    checkpoint: str
    data: str = "mixed"
    dtype: str = "bf16"
    device: str = "cpu"
    steps: int = 32
    variant: Variant = field(default_factory=Variant)
    layouts: tuple[str, ...] = LAYOUTS
    batch_size: int = 4
    max_length: int = 512
    lr: float = 1e-5
    weight_decay: float = 0.01
    seed: int = 0
    yardstick: str = "auto"

    def __post_init__(self):
        if self.yardstick not in YARDSTICKS:
            raise ValueError(f"unknown yardstick {self.yardstick!r}; expected one of {YARDSTICKS}")

    @property
    def label(self) -> str:
        """The checkpoint's last path component: ``Qwen2.5-0.5B`` for ``Qwen/Qwen2.5-0.5B``."""
        return Path(self.checkpoint.rstrip("/")).name or self.checkpoint

    @property
    def name(self) -> str:
        return f"{self.label}/{self.dtype}/{self.variant.name}"


def load_batches(
    run: PretrainedRun,
) -> tuple[list[list[Document]], list[Document], dict[str, Any]]:
    """``(train batches, eval batch, description)`` for ``run``: the user's file through the
    checkpoint's tokenizer (``data.read_documents``, ``data.split_batches``; only the rows needed
    are read), or synthetic documents of ``max_length / 16`` to ``max_length`` tokens over the
    model's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    if run.data in DATA_KINDS:
        config = AutoConfig.from_pretrained(run.checkpoint).get_text_config()
        train, eval_docs = synthetic_batches(
            config.vocab_size,
            run.steps,
            run.batch_size,
            max(4, run.max_length // 16),
            run.max_length,
            kind=run.data,
            seed=run.seed,
        )
        return train, eval_docs, {"source": f"synthetic ({run.data})"}
    tokenizer = AutoTokenizer.from_pretrained(run.checkpoint)
    docs = read_documents(
        run.data, tokenizer, max_length=run.max_length, limit=(run.steps + 1) * run.batch_size
    )
    train, eval_docs = split_batches(docs, run.steps, run.batch_size)
    info = {"source": str(run.data), "documents": len(docs)}
    if len(docs) <= run.batch_size:
        info["note"] = "no more documents than one batch: the eval batch is trained on too"
    elif len(docs) - run.batch_size < run.steps * run.batch_size:
        info["note"] = "fewer documents than the steps need: training goes over them again"
    return train, eval_docs, info


def _yardstick_fits(
    runner: SequentialRunner, run: PretrainedRun, exact_dtype: torch.dtype
) -> tuple[bool, str]:
    """Whether the full yardstick run is expected to fit, and the numbers behind the guess."""
    run_dtype = DTYPES[run.dtype]
    ratio = torch.finfo(exact_dtype).bits / torch.finfo(run_dtype).bits
    if runner.device.type == "cuda":
        peak = runner.traces["reference"].peak_bytes_all or 0
        need = ratio * peak
        free, _ = torch.cuda.mem_get_info(runner.device)
        return need <= 0.9 * free, (
            f"needs about {need / _GIB:.1f} GiB ({ratio:g}x the reference's peak), "
            f"{free / _GIB:.1f} GiB free"
        )
    need = 4 * 1.25 * runner.n_params * torch.finfo(exact_dtype).bits / 8
    available = _available_memory()
    if available is None:
        return True, "available memory unknown"
    return need <= available, (
        f"needs about {need / _GIB:.1f} GiB (weights, gradients, AdamW moments and a quarter "
        f"more), {available / _GIB:.1f} GiB available"
    )


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _merge(
    at_init: dict[str, list[float]], twin: dict[str, list[float]], scale: float
) -> dict[str, list[float]]:
    """A pair's per-step metrics with the "init" yardstick: step 0 against the run one precision
    up at the initial weights, every later step against the twin, times ``scale``."""
    return {k: [*at_init.get(k, [])[:1], *(scale * x for x in v[1:])] for k, v in twin.items()}


def _scaled(metrics: dict[str, Any], scale: float) -> dict[str, Any]:
    out = {}
    for k, value in metrics.items():
        if isinstance(value, dict):
            out[k] = _scaled(value, scale)
        elif isinstance(value, float):
            out[k] = scale * value
        else:
            out[k] = value
    return out


def train_and_compare_pretrained(
    run: PretrainedRun,
    *,
    patch: Callable[..., Any] | None = None,
    progress: Callable[[str], None] | None = None,
    batches: tuple[list[list[Document]], list[Document]] | None = None,
) -> dict[str, Any]:
    """Run ``run`` and return a record of the shape ``train.train_and_compare`` returns (what
    ``compare.evaluate`` and ``report``'s ``format_table``, ``plot`` and ``write_json`` read), plus
    a ``"pretrained"`` entry: the checkpoint, the yardstick used and why, each side's peak memory.

    ``patch`` defaults to ``surgery.patch`` (``side.default_patch``), called as in ``train``.
    ``batches``: ``(train, eval)`` documents, by default ``load_batches(run)``; ``run.steps`` is
    the number of training batches."""
    t0 = time.perf_counter()
    data_info: dict[str, Any] = {}
    if batches is None:
        train_docs, eval_docs, data_info = load_batches(run)
    else:
        train_docs, eval_docs = batches
    train_docs = list(train_docs)[: run.steps]
    dtype = DTYPES[run.dtype]
    runner = SequentialRunner(run, patch, progress, train_docs, eval_docs)
    patched = [SideSpec(f"patched-{layout}", layout, True, dtype) for layout in run.layouts]
    # The probes' partner is the unpatched fp32 run: the reference of an fp32 run, the yardstick
    # of a bf16 one (at the initial weights only, under "init").
    probes_here = run.layouts if run.dtype == "fp32" else ()
    # The reference first: the yardstick's fit is judged by its peak memory.
    runner.run_side(
        SideSpec("reference", "padded", False, dtype, keep=True, probes=probes_here), []
    )
    yardstick = _run_yardstick(runner, run)
    for spec in patched:
        pairs = [(spec.name, "reference")] + [(spec.name, y) for y in yardstick.sides]
        runner.run_side(spec, pairs)
    scaling = {} if yardstick.mode == "full" else _merge_twin(runner, yardstick, patched)
    return _pretrained_record(run, runner, yardstick, scaling, patched, train_docs, data_info, t0)


class _Yardstick(NamedTuple):
    """How the run's error budget was measured: ``mode`` ("full": the run one precision up
    trained alongside; "init": that run at the initial weights only, plus a twin of the run's
    dtype with one more rounding), why, the name the record compares against (``exact``) and
    the sides it stands for."""

    mode: str
    reason: str
    exact: str
    sides: list[str]


def _run_yardstick(runner: SequentialRunner, run: PretrainedRun) -> _Yardstick:
    """The yardstick's sides, run after the reference: trained one precision up where it fits
    (``run.yardstick`` "full", or "auto" and it fits), else at the initial weights with a twin."""
    exact_name, exact_dtype = EXACT[run.dtype]
    dtype = DTYPES[run.dtype]
    probes_up = run.layouts if run.dtype != "fp32" else ()
    mode, reason = run.yardstick, "asked for"
    if mode == "auto":
        fits, numbers = _yardstick_fits(runner, run, exact_dtype)
        mode, reason = ("full", f"fits: {numbers}") if fits else ("init", f"too big: {numbers}")
    if mode == "full":
        runner.routing_yardstick = exact_name
        # No attention_mask, as train's yardstick (right padding is causal anyway; fp64 eager
        # masks can turn a pad row into NaN).
        spec = SideSpec(
            exact_name, "padded", False, exact_dtype, mask=False, keep=True, probes=probes_up
        )
        try:
            runner.run_side(spec, [("reference", exact_name)])
        except (torch.cuda.OutOfMemoryError, MemoryError) as err:
            if run.yardstick == "full":
                raise
            mode, reason = "init", f"ran out of memory ({str(err).splitlines()[0]})"
        runner._free()
    if mode == "full":
        return _Yardstick(mode, reason, exact_name, [exact_name])
    at_init, twin = f"{exact_name}@init", f"{run.dtype}-twin"
    # Routing is judged at the initial weights (the final eval's is only recorded anyway).
    runner.routing_yardstick = at_init
    runner.run_side(
        SideSpec(at_init, "padded", False, exact_dtype, mask=False, train=False, keep=True,
                 probes=probes_up),
        [("reference", at_init)],
    )  # fmt: skip
    # One more rounding of the run's dtype: its unit roundoff, half its eps.
    unit_roundoff = torch.finfo(dtype).eps / 2
    runner.run_side(
        SideSpec(twin, "padded", False, dtype, grad_noise=unit_roundoff, keep=True),
        [("reference", twin)],
    )
    return _Yardstick(mode, reason, f"{at_init}+{twin}", [at_init, twin])


def _merge_twin(runner: SequentialRunner, yardstick: _Yardstick, patched) -> dict[str, Any]:
    """Under "init", every side's comparisons with the yardstick at the initial weights and with
    the twin merged into one against ``yardstick.exact``, the unpatched run's scaled by how much
    larger its own step-0 error is than the twin's one extra rounding; returns that scaling."""
    at_init, twin = yardstick.sides
    exact, compared = yardstick.exact, runner.compared
    from_exact = compared.steps[f"reference~{at_init}"]["grad"][0]
    from_twin = compared.steps[f"reference~{twin}"]["grad"][0]
    ratio = from_exact / from_twin if from_twin > 0 else 1.0
    scale = max(1.0, ratio) if ratio == ratio and ratio != float("inf") else 1.0
    scaling = {
        "twin_scale": scale,
        "grad@0": {"reference~" + at_init: from_exact, "reference~" + twin: from_twin},
        "unscaled": {
            "steps": compared.steps[f"reference~{twin}"],
            "eval_final": compared.eval_final[f"reference~{twin}"],
            "final": compared.final[f"reference~{twin}"],
        },
    }
    for side in ["reference"] + [s.name for s in patched]:
        key, key_init, key_twin = f"{side}~{exact}", f"{side}~{at_init}", f"{side}~{twin}"
        k = scale if side == "reference" else 1.0
        compared.steps[key] = _merge(compared.steps.pop(key_init), compared.steps.pop(key_twin), k)
        compared.eval_init[key] = compared.eval_init.pop(key_init)
        compared.eval_init.pop(key_twin)
        compared.eval_final[key] = _scaled(compared.eval_final.pop(key_twin), k)
        compared.final[key] = _scaled(compared.final.pop(key_twin), k)
    return scaling


def _pretrained_record(run, runner, yardstick: _Yardstick, scaling, patched, train_docs,
                       data_info, t0) -> dict[str, Any]:  # fmt: skip
    """The record of ``train_and_compare_pretrained`` (its docstring) from what ran."""
    from transformers import AutoConfig

    traces, exact = runner.traces, yardstick.exact
    if yardstick.mode == "full":
        yardstick_series = traces[exact].series()
    else:
        at_init_series, twin_series = (traces[n].series() for n in yardstick.sides)
        yardstick_series = {k: v[:1] + twin_series[k][1:] for k, v in at_init_series.items()}
    sides = {
        name: {
            "layout": traces[name].spec.layout,
            "patched": traces[name].spec.patched,
            **traces[name].series(),
        }
        for name in ["reference"] + [s.name for s in patched]
    }
    sides[exact] = {"layout": "padded", "patched": False, **yardstick_series}
    text_config = AutoConfig.from_pretrained(run.checkpoint).get_text_config()
    v = run.variant
    config = {**asdict(run), "variant": {**asdict(v), "name": v.name}, "model": run.label,
              "name": run.name}  # fmt: skip
    # A mixture of experts: each side's own routing decisions against the yardstick's, by phase
    # (as train's record; {} for a dense model).
    routing = {
        phase: {name: summary for name, summary in by_side.items() if name in sides}
        for phase, by_side in runner.compared.routing.items()
    }
    record = run_record(
        config,
        exact,
        sides,
        {name: info for t in traces.values() for name, info in t.probes.items()},
        replace(runner.compared, routing=routing),
        logits_materialised=[name for name, t in traces.items() if t.logits_materialised],
        train_docs=train_docs,
        seconds=time.perf_counter() - t0,
        size={
            "parameters": runner.n_params,
            "vocab_size": text_config.vocab_size,
            "hidden_size": getattr(text_config, "hidden_size", None),
            "num_hidden_layers": getattr(text_config, "num_hidden_layers", None),
            "docs_per_step": run.batch_size,
            "max_doc_len": run.max_length,
        },
    )
    return {
        **record,
        "pretrained": {
            "checkpoint": run.checkpoint,
            "data": data_info or {"source": "given batches"},
            "yardstick": {
                "mode": yardstick.mode,
                "reason": yardstick.reason,
                "sides": yardstick.sides,
                **scaling,
            },
            "sketch_width": SKETCH_WIDTH,
            # In the training steps: the eval batches materialise logits on every side.
            "peak_training_memory_gib": {
                name: t.peak_bytes / _GIB for name, t in traces.items() if t.peak_bytes is not None
            },
        },
    }


def describe_rules(record: dict[str, Any]) -> list[str]:
    """Where a real model's run is judged differently from the mini configs', and why: printed
    with the verdict."""
    info, cfg, exact = record["pretrained"], record["config"], record["exact"]
    yardstick = info["yardstick"]
    lines = [
        f"Rules: the mini configs' (compare.TOLERANCES[{cfg['dtype']!r}]), with these "
        "differences for a real model:",
        f"- The sides train one after another (a real model may fit only once), so gradients, "
        f"final-norm gradients, eval logits and weight deltas are compared through a fixed random "
        f"sketch of each tensor ({info['sketch_width']} numbers, the same for every side): the "
        "relative errors are estimates, good to about 1%.",
    ]
    if yardstick["mode"] == "full":
        lines.append(
            f"- Yardstick as in the mini runs: {exact}, trained all {cfg['steps']} steps "
            f"({yardstick['reason']})."
        )
    else:
        at_init, twin = yardstick["sides"]
        lines += [
            f"- Drift rule differs: the {at_init.split('@')[0]} yardstick was not trained "
            f"({yardstick['reason']}); it needs twice the reference's memory.",
            f"  Accuracy (step-0 gradients, the eval batch before training) is still measured "
            f"against it, at the initial weights only ({at_init})"
            + ("; so are the fp32 probes." if cfg["dtype"] != "fp32" else "."),
            f"  The drift budget (later steps' loss, final eval loss and logits, weight deltas) "
            f"is estimated from {twin}, the unpatched run with one more {cfg['dtype']} rounding "
            f"error on every gradient element at every step: its distance from the unpatched "
            f"run times {yardstick['twin_scale']:.2g} (the unpatched step-0 gradients are that "
            f"much farther from {at_init} than from the twin) stands for how far a correct patch "
            "drifts, and the patched run's distance from the twin for its own. An estimate where "
            "the mini rule measures, and stricter: it leaves out what low precision does to both "
            "runs alike (updates that bf16 weights round away).",
        ]
    if not record.get("probes"):
        lines.append(
            "- No fp32 probes (the patched model on the unpatched fp32 run's weights at every "
            "step): their checks are not part of the verdict."
        )
    return lines
