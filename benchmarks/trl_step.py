"""TRL's trainers' step, end to end: TRL alone, TRL with Liger's layer kernels, TRL with surgery,
each in its own process, on models built from configs with random weights (``train_step.py``'s
shapes), bf16, one GPU.

    python benchmarks/trl_step.py --out benchmarks/results
    python benchmarks/trl_step.py --models llama --out DIR
    python benchmarks/trl_step.py --smoke          # CPU, tiny, plumbing only

Every contender installs TRL's fused head as its trainers do (``add_fused_lm_head``) and
computes TRL's loss over its outputs:

- ``sft``: ``SFTTrainer.compute_loss``'s step: ``model(**batch, fused_lm_head=True)`` with the
  head installed for ``("log_probs", "entropy", "is_top1")``, loss = -sum(log_probs) / the number
  of labelled tokens (plus the router's aux loss times its coefficient on MoE models), backward,
  fused AdamW step. Padded (right-padded rows, attention mask) and packed (``position_ids``
  restarting per document, no mask), 2 x 4096.
- ``grpo``: a GRPO policy pass: the head installed with temperature 0.7 for ``("log_probs",
  "entropy")``, the first 1024 tokens of each row a prompt (labels -100), loss =
  -sum(advantage * log_probs) / the number of completion tokens with one random advantage per
  row, forward and backward (no optimizer step: rollouts dominate GRPO's step, this is its
  training pass).

Contenders: ``trl`` (the model as transformers builds it); ``trl_liger`` (Liger's layer kernels,
``_apply_liger_kernel_to_instance`` without its fused loss, as ``SFTTrainer(use_liger_kernel=
True)`` applies them: TRL refuses Liger's fused loss); ``trl_surgery`` (``surgery.patch`` before
the head is installed: surgery serves TRL's head, ``surgery.integrations.trl``);
``trl_surgery_options`` (SFT only: ``surgery.patch(model, loss_reduction="sequence",
z_loss_scale=1e-4)`` and the step ``surgery.integrations.trl_sft.SFTTrainer`` makes: TRL's fused
call asking for surgery's loss, ``SFT_LOSS_KWARG``, whose per-document mean plus z-loss, from the
same sweep over the logits as TRL's statistics, is the loss, plus the router's aux loss as
above: what surgery's loss options cost under TRL); ``trl_surgery_recompute`` (GRPO only:
``trl_surgery`` with the kept schedule declined, as when another call's kept logits wait: the
head's backward recomputes its logits, four products where the kept schedule makes three; the
two side by side measure what keeping the logits gains in a whole pass). Tokens/s =
batch x seq / median step time of 10 timed steps after 3 warm-up steps; peak GiB =
``torch.cuda.max_memory_allocated()`` over the timed steps; ``kept_calls``: how many of the head's
calls in the warm-up and timed steps kept their logits for the backward (surgery's contenders;
None for the others).

``--profile``: each worker also writes ``train_step.profile_step``'s tables of one more
step into ``--out``, ``profile_<model>_<contender>_<objective>_<padded|packed>.txt`` (the top ops;
on CUDA also the GPU time by kernel class and the matrix products by shape, and ``memory_...txt``:
what is alive at the memory peak).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    GIB,
    RESULTS_DIR,
    environment,
    fmt,
    import_surgery,
    save_figure,
    short_error,
    table,
    write_json,
)

CONTENDERS = ["trl", "trl_liger", "trl_surgery", "trl_surgery_options", "trl_surgery_recompute"]
ONLY = {"trl_surgery_options": "sft", "trl_surgery_recompute": "grpo"}
"""The contenders that run one objective only."""
OPTIONS = {"loss_reduction": "sequence", "z_loss_scale": 1e-4}
"""The loss options of ``trl_surgery_options``."""
MODELS = ["llama", "qwen3_moe"]
SCENARIOS = [("sft", "padded"), ("sft", "packed"), ("grpo", "padded")]
BATCH, SEQ, PROMPT = 2, 4096, 1024
WARMUP, TIMED = 3, 10


SURGERY = ("trl_surgery", "trl_surgery_options", "trl_surgery_recompute")
KEPT_CALLS = [0]
"""How many head calls of this worker kept their logits for the backward (surgery's)."""


def count_kept(decline: bool) -> None:
    """Count the head calls that keep their logits (``KEPT_CALLS``); with ``decline``, none does
    (the recompute schedule). Patches surgery's op module in this worker's process only."""
    import importlib

    ops = importlib.import_module(f"{import_surgery().kernels.__name__}.linear_cross_entropy.ops")
    reserve = ops._reserve_kept

    def counted(device):
        slot = None if decline else reserve(device)
        KEPT_CALLS[0] += slot is not None
        return slot

    ops._reserve_kept = counted


def prepare(model, contender):
    if contender in SURGERY:
        import_surgery().patch(model, **(OPTIONS if contender == "trl_surgery_options" else {}))
        count_kept(decline=contender == "trl_surgery_recompute")
    elif contender == "trl_liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False,
                                        cross_entropy=False)  # fmt: skip


def step_fn(model, objective, batch, contender):
    import torch

    labels = batch.pop("labels")
    config = model.config
    routed = getattr(config, "output_router_logits", False)
    coef = getattr(config, "router_aux_loss_coef", 0.0) if routed else 0.0
    if objective == "grpo":
        labels = labels.clone()
        labels[:, : min(PROMPT, labels.shape[1] // 4)] = -100  # a quarter of a smoke row
        g = torch.Generator().manual_seed(1)
        advantage = torch.randn(labels.shape[0], 1, generator=g).to(labels.device)

    own_loss = contender == "trl_surgery_options"
    extra = {}
    if own_loss:
        import_surgery()
        from surgery.integrations.trl import SFT_LOSS_KWARG

        extra[SFT_LOSS_KWARG] = True

    def run():
        out = model(**batch, labels=labels, fused_lm_head=True, **extra)
        count = out.label_mask.sum().clamp(min=1)
        if own_loss:
            loss = out.loss
        elif objective == "grpo":
            loss = -(advantage * out.log_probs).sum() / count
        else:
            loss = -out.log_probs.sum() / count
        if coef and out.aux_loss is not None:
            loss = loss + coef * out.aux_loss
        loss.backward()
        return loss

    return run


def worker(job):
    import torch
    from train_step import build_model, make_batch
    from trl.trainer.utils import add_fused_lm_head

    smoke, device = job["smoke"], torch.device("cpu" if job["smoke"] else "cuda")
    torch.manual_seed(0)
    model = build_model(job["model"], smoke, device)
    prepare(model, job["contender"])
    objective, kind = job["objective"], job["kind"]
    if objective == "sft":
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    else:
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    seq = 64 if smoke else SEQ
    batch, _ = make_batch(kind, BATCH, seq, model.config.vocab_size, device, seed=0)
    run = step_fn(model, objective, batch, job["contender"])
    optimizer = None
    if objective == "sft":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        loss = run()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for i in range(WARMUP + TIMED):
        if i == WARMUP and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    median = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
    kept = KEPT_CALLS[0] if job["contender"] in SURGERY else None  # before the profiled steps
    if job.get("profile"):
        from train_step import profile_step

        spec = {**job, "contender": f"{job['contender']}_{objective}", "seed": 0, "warmup": 0,
                "profile_scenario": kind, "profile_batch": BATCH,
                "step_kind": "AdamW" if optimizer is not None else "no optimizer step"}  # fmt: skip
        profile_step(model, lambda _: step(), lambda *_: (None, None, None), seq, spec)
    served = getattr(model, "_surgery_trl_request", None)
    return {
        **job,
        "tokens_per_s": BATCH * seq / median,
        "step_ms": median * 1e3,
        "peak_gib": peak,
        "losses": losses,
        "served_by_surgery": served is not None and served[1] is not None,
        "kept_calls": kept,
    }


def run_job(job, timeout):
    cmd = [sys.executable, __file__, "--worker", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**job, "error": f"timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**job, "error": " | ".join(tail)[-400:]}
    return json.loads(lines[-1][len("RESULT ") :])


def render(rows):
    headers = ["model", "step", "batch", "contender", "k tok/s", "GiB", "x TRL", "mem x TRL",
               "kept"]  # fmt: skip
    out = []
    base = {(r["model"], r["objective"], r["kind"]): r for r in rows if r["contender"] == "trl"}
    for r in rows:
        b = base.get((r["model"], r["objective"], r["kind"]), {})
        ok = "tokens_per_s" in r and "tokens_per_s" in b
        out.append([
            r["model"], r["objective"], r["kind"], r["contender"],
            fmt(r["tokens_per_s"] / 1e3) if "tokens_per_s" in r else r.get("error", "-")[:40],
            fmt(r.get("peak_gib")),
            fmt(r["tokens_per_s"] / b["tokens_per_s"]) if ok else "-",
            fmt(r["peak_gib"] / b["peak_gib"]) if ok and b.get("peak_gib") else "-",
            "-" if r.get("kept_calls") is None else r["kept_calls"],
        ])  # fmt: skip
    return table(headers, out)


def plot(rows, path: Path) -> str | None:
    """Tokens/s (bars) of every contender per (model, step, batch), peak GiB written on them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = sorted({(r["model"], r["objective"], r["kind"]) for r in rows}, key=str)
    contenders = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
    fig, ax = plt.subplots(figsize=(1.9 * len(groups) + 2, 4.2))
    width = 0.8 / len(contenders)
    labelled = set()  # each contender's first bar drawn names it in the legend
    for i, contender in enumerate(contenders):
        for j, group in enumerate(groups):
            match = [r for r in rows if (r["model"], r["objective"], r["kind"]) == group
                     and r["contender"] == contender and "tokens_per_s" in r]  # fmt: skip
            if not match:
                continue
            r = match[0]
            x = j + (i - (len(contenders) - 1) / 2) * width
            ax.bar(x, r["tokens_per_s"] / 1e3, width, color=f"C{i}",
                   label=None if contender in labelled else contender)  # fmt: skip
            labelled.add(contender)
            if r.get("peak_gib") is not None:
                ax.text(x, r["tokens_per_s"] / 1e3, f"{r['peak_gib']:.0f}", ha="center",
                        va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(groups)), [" ".join(g) for g in groups], fontsize=8)
    ax.set_ylabel("k tokens/s (peak GiB above each bar)")
    ax.set_title(
        "TRL's step, TRL alone / with Liger's layer kernels / with surgery (bf16, 2 x 4096)"
    )
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--scenarios", default=",".join(f"{o}:{k}" for o, k in SCENARIOS),
                        help="objective:batch pairs, e.g. grpo:padded")  # fmt: skip
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per worker")
    parser.add_argument("--profile", action="store_true", help="profiler tables (docstring)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plot", type=Path, nargs="+", metavar="JSON",
                        help="only merge these result files and plot them into --out")  # fmt: skip
    args = parser.parse_args(argv)
    if args.worker:
        try:
            print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        except Exception as e:
            print("RESULT " + json.dumps({**json.loads(args.worker), "error": short_error(e)}))
        return 0
    if args.plot:
        files = [json.loads(p.read_text()) for p in args.plot]
        rows = [r for f in files for r in f["rows"]]
        write_json(args.out / "trl_step.json", {"runs": files, "rows": rows})
        print(render(rows))
        print(plot(rows, args.out / "trl_step.png"))
        return 0
    rows = []
    stem = "trl_step_smoke" if args.smoke else f"trl_step_{args.models.replace(',', '_')}"
    for model in args.models.split(","):
        for objective, kind in (pair.split(":") for pair in args.scenarios.split(",")):
            for contender in args.contenders.split(","):
                if ONLY.get(contender, objective) != objective:
                    continue  # surgery's loss options are SFT's; the kept schedule is RL's
                job = dict(model=model, contender=contender, objective=objective, kind=kind,
                           smoke=args.smoke)  # fmt: skip
                if args.profile:
                    job.update(profile=True, out=str(args.out))
                rows.append(run_job(job, args.timeout))
                print(json.dumps(rows[-1]), flush=True)
                write_json(args.out / f"{stem}.json", {"environment": environment(), "rows": rows})
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
