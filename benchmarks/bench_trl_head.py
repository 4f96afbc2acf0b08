"""TRL's fused LM head against surgery's, the head alone, side by side in one run on one GPU.

    python benchmarks/bench_trl_head.py --out benchmarks/results
    python benchmarks/bench_trl_head.py --smoke        # CPU, tiny shapes, plumbing only
    python benchmarks/bench_trl_head.py --profile --out DIR   # where surgery's SFT head idles

Each case is a head shape (N tokens, D, V) in bf16 and a training objective over its per-token
outputs, as TRL's trainers ask for them:

- ``sft``: SFTTrainer's, outputs log_probs, entropy and is_top1; loss = -sum(log_probs) / N (the
  token mean: the same upstream gradient on every token).
- ``grpo``: a policy-gradient pass, outputs log_probs and entropy, temperature 0.7; loss =
  -sum(advantage * log_probs) / N with a random advantage per token (a gradient per token).

Contenders: TRL's ``ChunkedLogProbFunction`` (its 1.16 wheel, TRL's own chunk size), surgery's
``linear_log_probs`` with an ``UpstreamHint``, as TRL's integration passes one (for ``sft`` taught
by one call first, as in training from the second step on; for ``grpo`` the logits' gradient for
a unit coefficient kept from the forward where one chunk holds it; a softcapped head, in both,
keeps its fused product's Q instead), for ``sft`` also
surgery's ``linear_cross_entropy`` (the token mean alone, no per-token outputs: what the
per-token contract costs beside it), for ``grpo`` also surgery with the kept schedule declined
(``surgery_recompute``: the backward recomputes the logits, four products, as before
2026-12-01) and with the logits kept (``surgery_kept_logits``: the backward sweeps them, as
before the kept unit gradient, a Q's neither), for ``sft`` also surgery keeping the unit
gradient instead of speculating (``surgery_unit``: a hint that has seen a non-uniform gradient),
and the floor:
the three bf16 matrix products every exact head does (``x @ W.T``, ``dlogits @ W``,
``dlogits.T @ x``). Time: ``triton.testing.do_bench``
median of forward+backward, the floor and the contenders timed in turn in ``ROUNDS`` rounds: a
contender's ms is its median over them, its multiple of the floor the median of its rounds'
ratios to the same round's floor. Memory: peak allocated over one forward+backward minus what was
allocated before it, the gradients dX, dW excluded. Accuracy: ||a - b|| / ||b|| of log_probs
and dX, dW between surgery and TRL (both accumulate in fp32).

``--profile``: for each head, surgery's SFT head and its loss alone (``surgery_lce``), 3 steps then
5 under ``torch.profiler``: the wall per step, the GPU's span and its idle gaps over 30 us
(``trace_gaps.gaps``) by the kernel after them, printed and written with the chrome traces
(gzipped) into ``--out``. The hint's host read in the backward shows as idle time here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import types
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trace_gaps
from common import (
    RESULTS_DIR,
    environment,
    fmt,
    gib,
    import_surgery,
    save_figure,
    table,
    write_json,
)

CASES = {  # name: (N, D, V, softcap)
    "llama3-8b": (8192, 4096, 128256, None),
    "gemma2": (8192, 2304, 256000, 30.0),
    "qwen2.5-7b": (16384, 3584, 152064, None),
}
SMOKE = {"tiny": (64, 32, 300, None), "tiny-softcap": (64, 32, 300, 5.0)}
OBJECTIVES = {
    "sft": dict(outputs=("log_probs", "entropy", "is_top1"), temperature=1.0),
    "grpo": dict(outputs=("log_probs", "entropy"), temperature=0.7),
}


def trl_function():
    """TRL's ChunkedLogProbFunction and chunk size, without importing ``trl.trainer`` (pandas,
    datasets): its backward imports ``maybe_gather_lm_head_ctx`` from there at call time, a
    no-op without ZeRO-3, given here as one."""
    import trl.kernels.chunked_logprob as chunked

    if "trl.trainer.utils" not in sys.modules:
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *a, **k: contextlib.nullcontext()
        sys.modules.setdefault("trl.trainer", types.ModuleType("trl.trainer"))
        sys.modules["trl.trainer.utils"] = stub
    return chunked.ChunkedLogProbFunction, 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE


def make_inputs(n, d, v, device, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * 1.0).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 2.0 / d**0.5).to(device, torch.bfloat16)
    w.requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    advantage = torch.randn(n, generator=g).to(device)
    return x, w, labels, advantage


def contenders(objective, softcap, advantage):
    import torch

    kernels = import_surgery().kernels
    chunked, chunk = trl_function()
    opts = OBJECTIVES[objective]
    n = advantage.numel()
    coef = advantage if objective == "grpo" else torch.ones_like(advantage)

    def loss_of(log_probs):
        return -(coef * log_probs).sum() / n

    def trl(x, w, labels):
        out = chunked.apply(x, w, None, labels, opts["temperature"], chunk, softcap, 1.0,
                            opts["outputs"])  # fmt: skip
        return out[0], loss_of(out[0])

    def surgery_with(hint):
        def surgery(x, w, labels):
            out = kernels.linear_log_probs(x, w, labels, outputs=opts["outputs"],
                                           temperature=opts["temperature"], softcap=softcap,
                                           upstream=hint)  # fmt: skip
            return out.log_probs, loss_of(out.log_probs)

        return surgery

    # as TRL's integration passes one, whatever the objective
    surgery = surgery_with(kernels.UpstreamHint())

    def surgery_lce(x, w, labels):  # the loss alone: what the per-token contract costs
        loss = kernels.linear_cross_entropy(x, w, labels, softcap=softcap).loss
        return -loss.detach().expand(n), loss

    ops = importlib.import_module(f"{kernels.__name__}.linear_cross_entropy.ops")

    def surgery_recompute(x, w, labels):  # the kept schedule declined, as when logits wait
        with mock.patch.object(ops, "_reserve_kept", lambda device: None):
            return surgery(x, w, labels)

    class LogitsHint(kernels.UpstreamHint):
        """A hint that always expects the entropy's gradient: the kept schedule keeps the
        logits (neither a Q nor the unit gradient), and the backward sweeps them (the kept
        schedule as before 2026-12-01's unit gradient)."""

        entropy_grad = property(lambda self: True, lambda self, value: None)

    unit_hint = kernels.UpstreamHint()
    unit_hint.uniform = False  # as after a non-uniform step: no speculation, nothing learned

    fns = {"trl": trl, "surgery": surgery}
    if objective == "sft":
        fns["surgery_lce"] = surgery_lce
        fns["surgery_unit"] = surgery_with(unit_hint)  # in place of speculating
    else:
        fns["surgery_recompute"] = surgery_recompute
        fns["surgery_kept_logits"] = surgery_with(LogitsHint())
    return fns


def bench(fn, device, grads):

    if device != "cuda":
        fn()
        return None
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=100, rep=500, grad_to_none=grads,
                                         return_mode="median"))  # fmt: skip


def peak_extra(step, device, grads):
    import torch

    if device != "cuda":
        return None
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in grads)
    return torch.cuda.max_memory_allocated() - base - grad_bytes


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_case(name, shape, objective, device):
    import torch

    n, d, v, softcap = shape
    x, w, labels, advantage = make_inputs(n, d, v, device)
    fns = contenders(objective, softcap, advantage)
    row = {"case": name, "objective": objective, "n": n, "d": d, "v": v, "softcap": softcap}
    results, steps = {}, {}
    for who, fn in fns.items():

        def step(fn=fn):
            _, loss = fn(x, w, labels)
            loss.backward()

        step()  # warm-up (compiles; teaches surgery's hint the upstream)
        x.grad = w.grad = None
        lp, loss = fn(x, w, labels)
        loss.backward()
        results[who] = (lp.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        steps[who] = step
        row[f"{who}_extra_gib"] = gib(peak_extra(step, device, [x, w]))
    if device == "cuda":
        dl = torch.randn(n, v, device=device, dtype=torch.bfloat16)
        xd, wd = x.detach(), w.detach()

        def floor():
            xd @ wd.T
            dl @ wd
            dl.T @ xd

        # rounds of the floor and every contender in turn: each ratio is to its own round's
        # floor, the machine's clock drifting over a run (the floor 42.4 -> 43.4 ms in three
        # rounds one minute apart, 2026-12-01)
        times = {who: [] for who in ("floor", *fns)}
        for _ in range(ROUNDS):
            times["floor"].append(bench(floor, device, []))
            for who in fns:
                times[who].append(bench(steps[who], device, [x, w]))
        del dl
        for who, ms in times.items():
            row[f"{who}_ms"] = statistics.median(ms)
        for who in fns:
            ratios = [t / f for t, f in zip(times[who], times["floor"], strict=True)]
            row[f"{who}_x_floor"] = statistics.median(ratios)
        row["speedup_vs_trl"] = row["trl_ms"] / row["surgery_ms"]
    else:
        for who in fns:
            row[f"{who}_ms"] = bench(steps[who], device, [x, w])
    for i, what in enumerate(("log_probs", "dx", "dw")):
        row[f"rel_diff_{what}"] = rel(results["surgery"][i], results["trl"][i])
    for who in ("surgery_lce", "surgery_recompute", "surgery_kept_logits", "surgery_unit"):
        if who in results:
            row[f"rel_diff_dw_{who.removeprefix('surgery_')}"] = rel(
                results[who][2], results["trl"][2]
            )
    return row


PROFILED_STEPS = 5
ROUNDS = 3


def idle_summary(events: list[dict], steps: int, wall_ms: float, label: str, top: int = 6) -> str:
    """Lines on one profiled run of ``steps`` steps: the wall per step, the GPU's span, its idle
    time in gaps over ``trace_gaps.MIN_GAP_US`` and the kernels those gaps come before (the GPU
    waited for the host to launch them), per step."""
    _, span, found = trace_gaps.gaps(events)
    idle = sum(g for g, _ in found)
    by_next: dict[str, float] = {}
    for g, name in found:
        by_next[name[:70]] = by_next.get(name[:70], 0.0) + g
    lines = [f"== {label}: wall {wall_ms:.2f} ms a step; GPU span {span / steps / 1e3:.2f} ms, "
             f"idle in gaps {idle / steps / 1e3:.2f} ms a step"]  # fmt: skip
    for name, g in sorted(by_next.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {g / steps:8.0f} us a step before {name}")
    return "\n".join(lines)


def profile_case(name, shape, out: Path) -> str:
    """``idle_summary`` of surgery's SFT head and its loss alone at one head shape (CUDA)."""
    import gzip
    import json
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    n, d, v, softcap = shape
    x, w, labels, advantage = make_inputs(n, d, v, "cuda")
    fns = contenders("sft", softcap, advantage)
    parts = []
    for who in ("surgery", "surgery_lce"):
        fn = fns[who]

        def step(fn=fn):
            _, loss = fn(x, w, labels)
            loss.backward()
            x.grad = w.grad = None

        for _ in range(3):  # compiles; teaches the hint
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / PROFILED_STEPS * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                step()
            torch.cuda.synchronize()
        trace = out / f"trl_head_profile_{name}_{who}.trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        with gzip.open(f"{trace}.gz", "wt") as f:
            json.dump(events, f)
        trace.unlink()
        parts.append(idle_summary(events, PROFILED_STEPS, wall, f"{name} sft {who}"))
    return "\n".join(parts)


def plot(rows, path: Path) -> str | None:
    """Milliseconds of the floor and each contender per (case, objective)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series = [("floor", "3-GEMM floor"), ("trl", "TRL 1.16"), ("surgery", "surgery"),
              ("surgery_lce", "surgery linear_cross_entropy (loss only)"),
              ("surgery_recompute", "surgery, logits recomputed (four products)"),
              ("surgery_kept_logits", "surgery, logits kept (swept in the backward)")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.14
    for i, (key, label) in enumerate(series):
        xs = [j + (i - 2.5) * width for j, r in enumerate(rows) if r.get(f"{key}_ms")]
        ys = [r[f"{key}_ms"] for r in rows if r.get(f"{key}_ms")]
        ax.bar(xs, ys, width, label=label, color=f"C{i}")
    ax.set_xticks(range(len(rows)), [f"{r['case']}\n{r['objective']}" for r in rows], fontsize=8)
    ax.set_ylabel("ms, forward + backward (bf16)")
    ax.set_title("TRL's fused head: per-token log-probabilities and their gradients")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--plot", type=Path, metavar="JSON", help="only plot a result file")
    parser.add_argument("--profile", action="store_true",
                        help="only profile surgery's SFT head (CUDA; docstring)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.plot:
        import json

        return (
            0
            if plot(json.loads(args.plot.read_text())["rows"], args.plot.with_suffix(".png"))
            else 1
        )
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    if args.profile:
        if args.smoke:
            parser.error("--profile needs the CUDA run, not --smoke")
        args.out.mkdir(parents=True, exist_ok=True)
        report = "\n".join(profile_case(name, shape, args.out) for name, shape in CASES.items())
        (args.out / "trl_head_profile.txt").write_text(report + "\n")
        print(report)
        return 0
    rows = []
    for name, shape in (SMOKE if args.smoke else CASES).items():
        for objective in OBJECTIVES:
            rows.append(run_case(name, shape, objective, device))
            print(rows[-1], flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    result = {"environment": environment(), "rows": rows}
    stem = "trl_head_smoke" if args.smoke else "trl_head"
    write_json(args.out / f"{stem}.json", result)
    headers = ["case", "objective", "floor ms", "TRL ms", "surgery ms", "x floor", "vs TRL",
               "TRL GiB", "surgery GiB", "dW diff", "LCE ms", "recompute ms",
               "recompute GiB", "kept logits ms", "unit ms"]  # fmt: skip
    print(table(headers, [[
        r["case"], r["objective"], fmt(r.get("floor_ms")), fmt(r.get("trl_ms")),
        fmt(r.get("surgery_ms")), fmt(r.get("surgery_x_floor")), fmt(r.get("speedup_vs_trl")),
        fmt(r.get("trl_extra_gib")), fmt(r.get("surgery_extra_gib")), fmt(r["rel_diff_dw"]),
        fmt(r.get("surgery_lce_ms")), fmt(r.get("surgery_recompute_ms")),
        fmt(r.get("surgery_recompute_extra_gib")), fmt(r.get("surgery_kept_logits_ms")),
        fmt(r.get("surgery_unit_ms")),
    ] for r in rows]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
