"""Fused linear cross entropy, side by side: ours against HF eager, torch.compile, Liger, CCE
and the bare GEMM floor, in one run on one GPU.

    python benchmarks/bench_linear_cross_entropy.py --out benchmarks/results
    python benchmarks/bench_linear_cross_entropy.py --cases llama3-8b,gemma2-2b --quick
    python benchmarks/bench_linear_cross_entropy.py --smoke      # CPU, tiny shapes, plumbing only

What is measured (README.md beside this file has the full definitions):

- time: ``triton.testing.do_bench`` median of forward+backward (``loss.backward()`` included,
  ``.grad`` reset to None before every repetition) and of the forward alone (inputs requiring grad,
  as in training), after a warm-up call that also compiles.
- memory: ``torch.cuda.max_memory_allocated()`` over one forward+backward, minus
  ``torch.cuda.memory_allocated()`` just before it (inputs, weights, labels, the fp32 reference
  already allocated; ``.grad`` None). Reported twice: including the gradient outputs dX and dW,
  and excluding their bytes, which every method must produce.
- accuracy: ‖a − b‖ / ‖b‖ of loss, dX and dW against an fp32 reference computed here in row chunks
  from the same bf16 inputs.
- gemm_floor: the three bf16 matmuls every exact method must do, ``x @ W.T``, ``dlogits @ W``,
  ``dlogits.T @ x``, timed alone. Ratios are to it.

Data: near-uniform logits (logit std 1, uniform labels) and peaked logits (logit std 4 plus a few
boosted tokens per row that the labels mostly pick); ``make_inputs`` says exactly how.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    environment,
    fmt,
    gib,
    import_surgery,
    short_error,
    table,
    write_json,
)

IGNORE_INDEX = -100
# CCE skips gradient tiles whose softmax is below bf16 eps / 32; counting tokens above it per row
# tells how much filtering the data allows.
CCE_FILTER_EPS_BF16 = 2.0**-7 / 32

# Peaked data: base logit std, and the boosts (in logits) of the favoured tokens of each row.
PEAKED_LOGIT_STD = 4.0
PEAKED_BOOSTS = (20.0, 18.0, 16.0, 14.0)
# Which favoured token a label picks: the first with p 0.5, each other one with 0.15, and a token
# drawn uniformly from the vocabulary with the remaining 0.05 (the model's "surprises").
PEAKED_LABEL_PROBS = (0.5, 0.15, 0.15, 0.15)
UNIFORM_LOGIT_STD = 1.0


@dataclass(frozen=True)
class Case:
    name: str
    n: int
    d: int
    v: int
    softcap: float | None = None
    ignore_frac: float = 0.0
    dists: tuple[str, ...] = ("uniform", "peaked")


# BENCHMARKS.md's shapes. The scaling rows were reported on peaked data only.
CASES = [
    Case("llama3-8b", 8192, 4096, 128256, ignore_frac=0.1),
    Case("gemma2-2b", 8192, 2304, 256000, softcap=30.0),
    Case("qwen2.5-7b", 16384, 3584, 152064),
    Case("scaling-2k", 2048, 4096, 128256, dists=("peaked",)),
    Case("scaling-8k", 8192, 4096, 128256, dists=("peaked",)),
    Case("scaling-32k", 32768, 4096, 128256, dists=("peaked",)),
]
SMOKE_CASES = [
    Case("tiny-llama", 64, 32, 1000, ignore_frac=0.1),
    Case("tiny-gemma", 48, 24, 777, softcap=30.0, dists=("peaked",)),
    Case("tiny-scaling", 96, 32, 1000, dists=("peaked",)),
]
CONTENDERS = [
    "gemm_floor",
    "hf_eager",
    "torch_compile",
    "liger",
    "cce",
    "ours",
    "ours_low_memory",
]
# Not run by default: CCE with its gradient filter off (exact), to separate filtering from the rest.
EXTRA_CONTENDERS = ["cce_exact"]


CONTENDER_CALLS = {
    "gemm_floor": "x @ W.T; dlogits @ W; dlogits.T @ x (bf16, dlogits random (N, V) bf16)",
    "hf_eager": "F.cross_entropy(cap(x @ W.T).float(), labels, ignore_index=-100); Gemma-2's"
    " softcap tanh(z / c) * c applied in bf16 before the upcast, as Gemma2ForCausalLM does",
    "torch_compile": "torch.compile(hf_eager, dynamic=False), inductor, one compile per shape",
    "liger": "liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss(ignore_index=-100,"
    " softcap=c, reduction='mean')(W, x, labels); other options default (accum_dtype None)",
    "cce": "cut_cross_entropy.linear_cross_entropy(x, W, labels, ignore_index=-100, softcap=c,"
    " reduction='mean'); impl 'cce', filter_eps 'high' (bf16 eps / 32) by default",
    "cce_exact": "the same with filter_eps=None (no gradient filtering)",
    "ours": "surgery.kernels.linear_cross_entropy(x, W, labels, softcap=c, ignore_index=-100).loss",
    "ours_low_memory": "the same with low_memory=True",
}


class Unavailable(Exception):
    """A contender that cannot run here (package missing, option not implemented, needs CUDA)."""


@dataclass
class Settings:
    device: str
    smoke: bool
    warmup_ms: int
    rep_ms: int
    min_samples: int
    accuracy: bool
    time_forward: bool
    seed: int


@dataclass
class Outcome:
    status: str = "ok"  # ok | unavailable | error | skipped
    error: str | None = None
    note: str | None = None
    fwd_bwd_ms: float | None = None
    fwd_ms: float | None = None
    x_floor: float | None = None
    fwd_x_floor: float | None = None
    peak_extra_incl_grads_gib: float | None = None
    peak_extra_excl_grads_gib: float | None = None
    fwd_peak_extra_gib: float | None = None
    retained_after_fwd_gib: float | None = None
    loss: float | None = None
    loss_rel_err: float | None = None
    grad_x_rel_err: float | None = None
    grad_w_rel_err: float | None = None


# --------------------------------------------------------------------------------------------------
# data and the fp32 reference


def make_inputs(case: Case, dist: str, settings: Settings, seed: int):
    """bf16 ``x`` (N, D) and ``W`` (V, D) requiring grad, int64 labels (N,), all non-zero random.

    uniform: x ~ N(0, 1), W ~ N(0, 1/D), so logits x @ W.T have std 1 and the softmax is close to
    uniform (max p about 4e-4 at V = 128k); labels uniform over the vocabulary.

    peaked: W ~ N(0, 16/D), so the base logits have std 4 (a Gaussian tail: about 50-200 tokens per
    row within exp(-8.3) of the top, as in a trained model's softmax). Each row then favours 4
    vocabulary rows s_1..s_4 drawn at random: x_i += sum_k b_k W[s_k] / |W[s_k]|^2 with
    b = (20, 18, 16, 14), which raises logit (i, s_k) by exactly b_k and moves every other logit by
    about b_k / sqrt(D). Labels follow the model: s_1 with p 0.5, s_2..s_4 with p 0.15 each, a
    uniform token with p 0.05. That gives a top-1 probability around 0.6 and a mean loss of a few
    nats; the reference pass records the measured statistics next to the results.

    ``ignore_frac`` of the labels, at random positions, are set to ignore_index.
    """
    import torch

    dev = torch.device(settings.device)
    g = torch.Generator(device=dev).manual_seed(seed)
    n, d, v = case.n, case.d, case.v
    std = PEAKED_LOGIT_STD if dist == "peaked" else UNIFORM_LOGIT_STD
    x = torch.randn(n, d, generator=g, device=dev)
    w = torch.randn(v, d, generator=g, device=dev).mul_(std / math.sqrt(d))
    if dist == "peaked":
        k = len(PEAKED_BOOSTS)
        fav = torch.randint(0, v, (n, k), generator=g, device=dev)
        boosts = torch.tensor(PEAKED_BOOSTS, device=dev).view(1, k, 1)
        for s in range(0, n, 4096):
            ws = w[fav[s : s + 4096]]  # (rows, k, d)
            x[s : s + 4096] += (boosts * ws / ws.square().sum(-1, keepdim=True)).sum(1)
            del ws
        u = torch.rand(n, generator=g, device=dev)
        edges = torch.tensor(PEAKED_LABEL_PROBS, device=dev).cumsum(0)
        pick = torch.bucketize(u, edges, right=True).clamp_(max=k)  # k means "uniform token"
        labels = fav.gather(1, pick.clamp(max=k - 1).view(-1, 1)).view(-1)
        random_tok = torch.randint(0, v, (n,), generator=g, device=dev)
        labels = torch.where(pick == k, random_tok, labels)
    elif dist == "uniform":
        labels = torch.randint(0, v, (n,), generator=g, device=dev)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    if case.ignore_frac > 0:
        drop = torch.rand(n, generator=g, device=dev) < case.ignore_frac
        labels = labels.masked_fill(drop, IGNORE_INDEX)
    x = x.to(torch.bfloat16).requires_grad_()
    w = w.to(torch.bfloat16).requires_grad_()
    return x, w, labels


def reference(x, w, labels, softcap: float | None, ignore_index: int = IGNORE_INDEX):
    """fp32 loss (mean over non-ignored tokens), dX and dW of cross_entropy(cap(x @ W.T), labels),
    computed from the bf16 inputs upcast, one block of rows at a time so that no full (N, V) fp32
    matrix exists. Also returns statistics of the logits that describe the data."""
    import torch

    xf = x.detach().float()
    wf = w.detach().float()
    n, v = xf.shape[0], wf.shape[0]
    valid = labels != ignore_index
    n_valid = max(int(valid.sum()), 1)
    rows = max(64, min(n, (1 << 30) // (4 * v)))  # about 1 GiB of fp32 logits per block
    gx = torch.empty_like(xf)
    gw = torch.zeros_like(wf)
    loss_sum = torch.zeros((), dtype=torch.float64, device=xf.device)
    std_sum = torch.zeros((), dtype=torch.float64, device=xf.device)
    top_p_all = []
    above_sum = torch.zeros((), dtype=torch.float64, device=xf.device)
    for s in range(0, n, rows):
        z = xf[s : s + rows] @ wf.T
        if softcap is not None:
            t = torch.tanh(z / softcap)
            z = t * softcap
        lab = labels[s : s + rows]
        ok = valid[s : s + rows]
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(1, lab.clamp(min=0).view(-1, 1)).view(-1)
        loss_sum += torch.where(ok, lse - picked, torch.zeros_like(lse)).sum(dtype=torch.float64)
        std_sum += z.std(dim=-1).sum(dtype=torch.float64)
        p = torch.exp(z - lse.view(-1, 1))
        del z
        top_p_all.append(p.max(dim=-1).values)
        above_sum += (p > CCE_FILTER_EPS_BF16).sum(dtype=torch.float64)
        rows_idx = torch.arange(p.shape[0], device=p.device)
        p[rows_idx, lab.clamp(min=0)] -= 1.0
        p *= (ok.float() / n_valid).view(-1, 1)
        if softcap is not None:
            p *= 1.0 - t * t
            del t
        gx[s : s + rows] = p @ wf
        gw.addmm_(p.T, xf[s : s + rows])
        del p
    del wf
    stats = {
        "ref_loss": float(loss_sum) / n_valid,
        "logit_std_mean": float(std_sum) / n,
        "top1_prob_median": float(torch.cat(top_p_all).median()),
        "tokens_above_cce_eps_per_row": float(above_sum) / n,
        "ignored_frac": 1.0 - n_valid / n,
    }
    return float(loss_sum) / n_valid, gx, gw, stats


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in fp64 accumulation, a block of rows at a time (b is the fp32 reference)."""
    import torch

    num = torch.zeros((), dtype=torch.float64, device=b.device)
    den = torch.zeros((), dtype=torch.float64, device=b.device)
    step = max(1, (1 << 28) // max(1, b[0].numel()))
    for s in range(0, b.shape[0], step):
        bb = b[s : s + step]
        num += (a[s : s + step].float() - bb).square().sum(dtype=torch.float64)
        den += bb.square().sum(dtype=torch.float64)
    return math.sqrt(float(num) / max(float(den), 1e-300))


# --------------------------------------------------------------------------------------------------
# contenders: each builder returns loss_fn(x, W, labels) -> scalar loss (mean over valid tokens)


def hf_eager_loss(x, w, labels, softcap, ignore_index):
    """What transformers does: bf16 logits, Gemma-2's final softcap applied to them in the model
    dtype (Gemma2ForCausalLM.forward), then ForCausalLMLoss's ``.float()`` and F.cross_entropy."""
    import torch
    import torch.nn.functional as F

    logits = x @ w.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="mean")


_compiled_key: tuple | None = None


def build_contender(name: str, case: Case, settings: Settings):
    import torch

    softcap = case.softcap
    if name == "hf_eager":
        return lambda x, w, y: hf_eager_loss(x, w, y, softcap, IGNORE_INDEX)
    if name == "torch_compile":
        global _compiled_key
        key = (case.n, case.d, case.v, softcap)
        if key != _compiled_key:
            torch._dynamo.reset()  # a fresh, shape-specialised compile per case
            _compiled_key = key

        def eager(x, w, y):
            return hf_eager_loss(x, w, y, softcap, IGNORE_INDEX)

        # On CPU (smoke) aot_eager checks the dynamo/AOTAutograd plumbing without a C++ build.
        backend = "aot_eager" if settings.smoke else "inductor"
        return torch.compile(eager, dynamic=False, backend=backend)
    if name == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as e:
            raise Unavailable(f"liger-kernel not importable: {short_error(e)}") from e
        mod = LigerFusedLinearCrossEntropyLoss(
            ignore_index=IGNORE_INDEX, softcap=softcap, reduction="mean"
        )
        return lambda x, w, y: mod(w, x, y)  # Liger's order: (lin_weight, _input, target)
    if name in ("cce", "cce_exact"):
        if settings.device != "cuda":
            raise Unavailable("needs CUDA (its kernels fail in the Triton interpreter)")
        try:
            from cut_cross_entropy import linear_cross_entropy as cce_lce
        except ImportError as e:
            raise Unavailable(f"cut-cross-entropy not importable: {short_error(e)}") from e
        kw: dict[str, Any] = {"ignore_index": IGNORE_INDEX, "softcap": softcap, "reduction": "mean"}
        if name == "cce_exact":
            kw["filter_eps"] = None
        return lambda x, w, y: cce_lce(x, w, y, **kw)
    if name in ("ours", "ours_low_memory"):
        surgery = import_surgery()
        lce = surgery.kernels.linear_cross_entropy
        kw = {"softcap": softcap, "ignore_index": IGNORE_INDEX}
        if name == "ours_low_memory":
            kw["low_memory"] = True
            _probe_low_memory(lce, settings)

        def ours(x, w, y):
            out = lce(x, w, y, **kw)
            return out.loss if hasattr(out, "loss") else out

        return ours
    raise ValueError(f"unknown contender {name!r}")


def _probe_low_memory(lce, settings: Settings) -> None:
    """A tiny call with ``low_memory=True``: a TypeError naming it means the option is not there."""
    import torch

    dev = torch.device(settings.device)
    x = torch.randn(4, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 32, (4,), device=dev)
    try:
        lce(x, w, y, low_memory=True)
    except TypeError as e:
        if "low_memory" in str(e):
            raise Unavailable(f"linear_cross_entropy has no low_memory option ({e})") from e
        raise


# --------------------------------------------------------------------------------------------------
# measurement


def sync(settings: Settings) -> None:
    import torch

    if settings.device == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, settings: Settings, grad_to_none) -> float:
    """Median milliseconds of ``fn``: do_bench on CUDA, one wall-clock call on CPU (smoke).

    do_bench repeats ``fn`` for ``rep`` ms, but at least once: a 200 ms call would get a median of
    one sample. One timed call first sizes ``rep`` so that every median has ``min_samples``."""
    if settings.device == "cuda":
        import torch
        import triton.testing

        for t in grad_to_none:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        one = start.elapsed_time(end)
        return float(
            triton.testing.do_bench(
                fn,
                warmup=max(settings.warmup_ms, one),
                rep=max(settings.rep_ms, settings.min_samples * one),
                grad_to_none=grad_to_none,
                return_mode="median",
            )
        )
    for t in grad_to_none:  # CPU smoke: the Triton interpreter is slow; the time means nothing
        t.grad = None
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_gemm_floor(x, w, settings: Settings) -> Outcome:
    import torch

    xd, wd = x.detach(), w.detach()
    dlogits = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

    def fwd_bwd():
        xd @ wd.T
        dlogits @ wd
        dlogits.T @ xd

    def fwd():
        xd @ wd.T

    out = Outcome(note="three bf16 matmuls, no loss; memory not applicable")
    fwd_bwd()
    sync(settings)
    out.fwd_bwd_ms = bench_ms(fwd_bwd, settings, [])
    out.fwd_ms = bench_ms(fwd, settings, [])
    out.x_floor = 1.0
    out.fwd_x_floor = 1.0
    return out  # dlogits is freed with the closures


def run_contender(name, case, x, w, labels, ref, floor: Outcome | None, settings) -> Outcome:
    import torch

    out = Outcome()
    fn = build_contender(name, case, settings)

    # warm-up: compiles (torch.compile, Triton JIT, autotuning) outside every measurement
    loss = fn(x, w, labels)
    loss.backward()
    del loss
    x.grad = w.grad = None
    sync(settings)

    def fwd_bwd():
        fn(x, w, labels).backward()

    out.fwd_bwd_ms = bench_ms(fwd_bwd, settings, [x, w])
    if settings.time_forward:
        out.fwd_ms = bench_ms(lambda: fn(x, w, labels), settings, [x, w])
    x.grad = w.grad = None
    gc.collect()
    sync(settings)

    # one measured forward+backward: memory, and the gradients the accuracy is judged on
    cuda = settings.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    loss = fn(x, w, labels)
    sync(settings)
    if cuda:
        out.fwd_peak_extra_gib = gib(torch.cuda.max_memory_allocated() - before)
        out.retained_after_fwd_gib = gib(torch.cuda.memory_allocated() - before)
    loss.backward()
    sync(settings)
    if cuda:
        incl = torch.cuda.max_memory_allocated() - before
        grad_bytes = x.numel() * x.element_size() + w.numel() * w.element_size()
        out.peak_extra_incl_grads_gib = gib(incl)
        out.peak_extra_excl_grads_gib = gib(incl - grad_bytes)
    out.loss = float(loss.detach().float())
    if ref is not None:
        ref_loss, ref_gx, ref_gw = ref
        out.loss_rel_err = abs(out.loss - ref_loss) / max(abs(ref_loss), 1e-30)
        out.grad_x_rel_err = rel_err(x.grad, ref_gx) if x.grad is not None else None
        out.grad_w_rel_err = rel_err(w.grad, ref_gw) if w.grad is not None else None
    if floor is not None and floor.fwd_bwd_ms:
        out.x_floor = out.fwd_bwd_ms / floor.fwd_bwd_ms
        if out.fwd_ms is not None and floor.fwd_ms:
            out.fwd_x_floor = out.fwd_ms / floor.fwd_ms
    del loss
    x.grad = w.grad = None
    return out


def cleanup(settings: Settings) -> None:
    import torch

    gc.collect()
    if settings.device == "cuda":
        torch.cuda.empty_cache()


def progress_line(case: str, dist: str, name: str, o: Outcome) -> str:
    head = f"[{case}/{dist}] {name}:"
    if o.status != "ok":
        return f"{head} {o.status}: {o.error}"
    parts = [f"fwd+bwd {fmt(o.fwd_bwd_ms, '.2f')} ms ({fmt(o.x_floor, '.2f')}x floor)"]
    if o.fwd_ms is not None:
        parts.append(f"fwd {fmt(o.fwd_ms, '.2f')} ms")
    if o.peak_extra_excl_grads_gib is not None:
        parts.append(
            f"extra {fmt(o.peak_extra_excl_grads_gib, '.3f')} GiB excl. grads"
            f" / {fmt(o.peak_extra_incl_grads_gib, '.3f')} incl."
        )
    if o.grad_x_rel_err is not None:
        parts.append(
            f"err loss {fmt(o.loss_rel_err, '.1e')} dX {fmt(o.grad_x_rel_err, '.1e')}"
            f" dW {fmt(o.grad_w_rel_err, '.1e')}"
        )
    return f"{head} " + ", ".join(parts)


def estimate_seconds(cases: list[Case], contenders: list[str], settings: Settings) -> float:
    """A rough guess for an H100: methods at ~1.8x the floor (700 TFLOP/s bf16) on average, the
    calls ``bench_ms`` makes (warm-up, sizing, do_bench's 5-call estimate, its warm-up and
    repetitions), the fp32 reference at ~40 TFLOP/s, one inductor compile per shape."""

    def bench_s(t_ms: float) -> float:
        calls = 7 * t_ms + max(settings.warmup_ms, t_ms)
        return (calls + max(settings.rep_ms, settings.min_samples * t_ms)) / 1e3

    total = 20.0  # imports, CUDA init, Triton JIT of the peers
    for c in cases:
        flops = 6.0 * c.n * c.d * c.v
        t_ms = 1.8 * flops / 700e12 * 1e3
        per = bench_s(t_ms) + (bench_s(t_ms / 3) if settings.time_forward else 0.0) + t_ms / 1e3
        ref = flops / 40e12 if settings.accuracy else 0.0
        total += len(c.dists) * (len(contenders) * per + ref)
        total += 15.0 if "torch_compile" in contenders else 0.0
    return total


# --------------------------------------------------------------------------------------------------
# report


def render_table(results: list[dict]) -> str:
    headers = [
        "case/dist",
        "contender",
        "fwd+bwd ms",
        "x floor",
        "fwd ms",
        "GiB excl",
        "GiB incl",
        "loss err",
        "dX err",
        "dW err",
        "status",
    ]
    rows = []
    for r in results:
        for name, o in r["contenders"].items():
            rows.append(
                [
                    f"{r['case']}/{r['dist']}",
                    name,
                    fmt(o.get("fwd_bwd_ms"), ".2f"),
                    fmt(o.get("x_floor"), ".2f"),
                    fmt(o.get("fwd_ms"), ".2f"),
                    fmt(o.get("peak_extra_excl_grads_gib"), ".3f"),
                    fmt(o.get("peak_extra_incl_grads_gib"), ".3f"),
                    fmt(o.get("loss_rel_err"), ".1e"),
                    fmt(o.get("grad_x_rel_err"), ".1e"),
                    fmt(o.get("grad_w_rel_err"), ".1e"),
                    o["status"] if o["status"] == "ok" else f"{o['status']}: {o.get('error')}"[:60],
                ]
            )
    return table(headers, rows)


def plot(results: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {short_error(e)}"
    groups = [f"{r['case']}\n{r['dist']}" for r in results]
    names = [n for n in CONTENDERS + EXTRA_CONTENDERS if n != "gemm_floor"]
    names = [n for n in names if any(n in r["contenders"] for r in results)]
    if not groups or not names:
        return "no plot: nothing measured"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(groups)), 9))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs, ratio, mem = [], [], []
        for g, r in enumerate(results):
            o = r["contenders"].get(n)
            if not o or o["status"] != "ok":
                continue
            xs.append(g + (i - (len(names) - 1) / 2) * width)
            ratio.append(o.get("x_floor") or float("nan"))
            m = o.get("peak_extra_excl_grads_gib")
            mem.append(max(m, 1e-3) if m is not None else float("nan"))
        ax1.bar(xs, ratio, width, label=n, color=f"C{i}")
        ax2.bar(xs, mem, width, label=n, color=f"C{i}")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.axhline(1.05, color="k", lw=0.8, ls="--", label="target 1.05x")
    ax1.set_ylabel("fwd+bwd time / gemm_floor")
    ax1.set_title("Fused linear cross entropy: time relative to the three bf16 GEMMs")
    ax2.set_yscale("log")
    ax2.axhline(1.0, color="k", lw=0.8, ls="--", label="target 1 GiB")
    ax2.axhline(0.1, color="k", lw=0.8, ls=":", label="low-memory target 0.1 GiB")
    ax2.set_ylabel("peak extra GiB, excl. dX, dW (floor 1e-3)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=8)
        ax.legend(fontsize=7, ncol=4)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"result folder (default {RESULTS_DIR})")
    p.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    p.add_argument("--dists", default=None, help="comma list: uniform,peaked (default per case)")
    p.add_argument(
        "--contenders",
        default=None,
        help=f"comma list from {CONTENDERS + EXTRA_CONTENDERS} (default: all but "
        f"{EXTRA_CONTENDERS}); gemm_floor is always run",
    )
    p.add_argument("--quick", action="store_true", help="warmup 10 ms, rep 40 ms, >= 3 samples")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up budget")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition budget")
    p.add_argument("--no-accuracy", action="store_true", help="skip the fp32 reference")
    p.add_argument("--no-forward", action="store_true", help="skip timing the forward alone")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=420.0,
        help="start no new case after this many seconds (results so far are kept)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU plumbing check on tiny shapes (TRITON_INTERPRET=1; CUDA-only peers unavailable)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # Must happen before triton is first imported (torch may import it).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "bench_linear_cross_entropy: no CUDA device. This benchmark times GPU kernels; run it"
            " on the GPU machine, or use --smoke for a CPU plumbing check on tiny shapes.",
            file=sys.stderr,
        )
        return 2

    all_cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        known = {c.name for c in all_cases}
        bad = [w for w in wanted if w not in known and w != "scaling"]
        if bad:
            print(f"unknown case(s) {bad}; known: {sorted(known)}", file=sys.stderr)
            return 2
        cases = [
            c
            for c in all_cases
            if c.name in wanted or ("scaling" in wanted and c.name.startswith("scaling"))
        ]
    else:
        cases = list(all_cases)
    if args.dists:
        dists = tuple(d.strip() for d in args.dists.split(",") if d.strip())
        cases = [Case(**{**asdict(c), "dists": dists}) for c in cases]
    contenders = CONTENDERS if args.contenders is None else args.contenders.split(",")
    unknown = [c for c in contenders if c not in CONTENDERS + EXTRA_CONTENDERS]
    if unknown:
        print(f"unknown contender(s) {unknown}", file=sys.stderr)
        return 2
    contenders = ["gemm_floor"] + [c for c in contenders if c != "gemm_floor"]

    settings = Settings(
        device="cuda" if torch.cuda.is_available() and not args.smoke else "cpu",
        smoke=args.smoke,
        warmup_ms=10 if args.quick else args.warmup_ms,
        rep_ms=40 if args.quick else args.rep_ms,
        min_samples=3 if args.quick else 5,
        accuracy=not args.no_accuracy,
        time_forward=not args.no_forward,
        seed=args.seed,
    )
    out_dir = args.out or (Path("/tmp/surgery-bench-smoke") if args.smoke else RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "linear_cross_entropy.json"
    torch.set_float32_matmul_precision("highest")  # the fp32 reference must not use TF32

    est = estimate_seconds(cases, contenders, settings)
    print(
        f"bench_linear_cross_entropy on {settings.device}"
        f" ({torch.cuda.get_device_name() if settings.device == 'cuda' else 'CPU smoke'}):"
        f" {len(cases)} case(s), contenders {contenders}; rough estimate {est:.0f} s on an H100",
        flush=True,
    )
    doc: dict[str, Any] = {
        "benchmark": "linear_cross_entropy",
        "environment": environment(),
        "settings": {**asdict(settings), "contenders": contenders},
        "definitions": {
            "fwd_bwd_ms": "triton.testing.do_bench median of loss=f(x, W, labels); loss.backward(),"
            " .grad set to None before each repetition, after one warm-up call",
            "fwd_ms": "the same for the forward alone, inputs requiring grad (as in training)",
            "x_floor": "fwd_bwd_ms / gemm_floor fwd_bwd_ms of the same case and data",
            "fwd_x_floor": "fwd_ms / the time of x @ W.T alone",
            "peak_extra_incl_grads_gib": "max_memory_allocated during one forward+backward minus"
            " memory_allocated just before it (inputs, weights, labels, reference already"
            " allocated, .grad None); includes the dX and dW that backward leaves in .grad",
            "peak_extra_excl_grads_gib": "peak_extra_incl_grads_gib minus the bytes of dX and dW"
            " in the input dtype, which every method must produce; what BENCHMARKS.md's peer"
            " figures report. Assumes the grads are live at the peak: a method that peaks before"
            " allocating them (e.g. hf_eager in its forward) reads lower by up to their size",
            "fwd_peak_extra_gib": "max_memory_allocated during the forward alone minus before",
            "retained_after_fwd_gib": "memory_allocated after the forward minus before: what the"
            " method keeps for its backward (Liger and others compute gradients here)",
            "rel_err": "|a-b|/|b| against an fp32 reference from the same bf16 inputs, computed in"
            " row blocks (loss: mean over non-ignored tokens)",
            "data": make_inputs.__doc__,
            "contenders": CONTENDER_CALLS,
        },
        "results": [],
    }
    t_start = time.perf_counter()
    for case in cases:
        for dist in case.dists:
            elapsed = time.perf_counter() - t_start
            entry: dict[str, Any] = {
                "case": case.name,
                "dist": dist,
                "n": case.n,
                "d": case.d,
                "v": case.v,
                "softcap": case.softcap,
                "ignore_frac": case.ignore_frac,
                "contenders": {},
            }
            if elapsed > args.time_budget_s:
                entry["skipped"] = f"time budget {args.time_budget_s:.0f} s spent"
                print(f"[{case.name}/{dist}] skipped: {entry['skipped']}", flush=True)
                doc["results"].append(entry)
                continue
            t_case = time.perf_counter()
            seed = args.seed * 1000 + len(doc["results"])
            x, w, labels = make_inputs(case, dist, settings, seed)
            ref = None
            if settings.accuracy:
                try:
                    ref_loss, ref_gx, ref_gw, stats = reference(x, w, labels, case.softcap)
                    ref = (ref_loss, ref_gx, ref_gw)
                    entry["data_stats"] = stats
                    print(f"[{case.name}/{dist}] data: {stats}", flush=True)
                except torch.OutOfMemoryError as e:
                    entry["reference_error"] = short_error(e)
                cleanup(settings)
            floor = None
            for name in contenders:
                try:
                    if name == "gemm_floor":
                        o = run_gemm_floor(x, w, settings)
                        floor = o
                    else:
                        o = run_contender(name, case, x, w, labels, ref, floor, settings)
                except Unavailable as e:
                    o = Outcome(status="unavailable", error=str(e))
                except torch.OutOfMemoryError as e:
                    o = Outcome(status="error", error="out of memory: " + short_error(e, 200))
                except Exception as e:
                    o = Outcome(status="error", error=short_error(e))
                x.grad = w.grad = None
                cleanup(settings)
                entry["contenders"][name] = asdict(o)
                print(progress_line(case.name, dist, name, o), flush=True)
            entry["seconds"] = round(time.perf_counter() - t_case, 1)
            del x, w, labels, ref
            ref_gx = ref_gw = None
            cleanup(settings)
            doc["results"].append(entry)
            doc["total_seconds"] = round(time.perf_counter() - t_start, 1)
            write_json(json_path, doc)
    write_json(json_path, doc)
    measured = [r for r in doc["results"] if r["contenders"]]
    note = plot(measured, out_dir / "linear_cross_entropy.png")
    if note:
        print(note)
    print(f"\nwrote {json_path} ({doc.get('total_seconds', 0):.0f} s)\n")
    print(render_table(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
