"""Host time per eager call of ``rms_norm``, ``apply_rope``, ``apply_rotary_pos_emb`` and
``gated_activation`` on tiny tensors, where the kernels' own work is negligible and what is timed
is the Python around them: argument checks, autograd (the torch.library op's registered autograd
and its dispatch) and the launches.

    python benchmarks/eager_overhead.py [--device cpu|cuda] [--rounds 15] [--calls 300] [--out DIR]

Each function is timed two ways: "fwd, no grad", the forward under ``torch.no_grad()``, and
"fwd+bwd", the forward on inputs that require grad followed by ``torch.autograd.grad`` of every
differentiable input (nothing accumulates into ``.grad``). A round runs ``--calls`` calls of one
case; rounds go through the cases in turn, so that a busy machine slows all of them alike, and
each case reports the minimum and the median over its rounds, in microseconds per call. On CUDA
(bf16) every round ends with a synchronize; the kernels take a few microseconds at these sizes, so
the time is the host's. On CPU (fp32) the PyTorch path runs, whose small tensor ops are part of
the figure; ``TRITON_INTERPRET=1`` would time the interpreter instead and is refused.

``import_surgery`` loads the checkout beside this script, so the same script copied into another
checkout (e.g. a worktree of an earlier commit) times that checkout's code; the result file
records which one (``kernels_loaded_from``). A no-op ``torch.autograd.Function`` (one ``clone``
each way) is timed alongside as the scale of the machine's autograd cost.

Writes ``eager_overhead-<device>.json`` under DIR (default benchmarks/results) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

ROWS, HIDDEN = 8, 64  # rms_norm and gated_activation: (8, 64)
B, HQ, HK, T, D = 1, 2, 1, 8, 16  # apply_rope: q (1, 2, 8, 16), k (1, 1, 8, 16)
WARMUP_CALLS = 20


def build_cases(device: str):
    """{name: (inputs requiring grad, forward taking them, upstream grads)}; the forward returns
    a tuple of outputs."""
    import torch

    kernels = common.import_surgery().kernels
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, w = rand(ROWS, HIDDEN), rand(HIDDEN)
    gate, up = rand(ROWS, HIDDEN), rand(ROWS, HIDDEN)
    q, k = rand(B, HQ, T, D), rand(B, HK, T, D)
    pos = torch.arange(T, device=device)[None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    angle = pos[..., None].float() * inv_freq
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()

    class NoOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad.clone()

    return {
        "rms_norm": ((x, w), lambda a, b: (kernels.rms_norm(a, b, 1e-6),), (rand(ROWS, HIDDEN),)),
        "apply_rope": (
            (q, k),
            lambda a, b: kernels.apply_rope(a, b, pos, inv_freq),
            (rand(B, HQ, T, D), rand(B, HK, T, D)),
        ),
        "apply_rotary_pos_emb": (
            (q, k),
            lambda a, b: kernels.apply_rotary_pos_emb(a, b, cos, sin),
            (rand(B, HQ, T, D), rand(B, HK, T, D)),
        ),
        "gated_activation": (
            (gate, up),
            lambda a, b: (kernels.gated_activation(a, b),),
            (rand(ROWS, HIDDEN),),
        ),
        "no-op autograd.Function": ((x,), lambda a: (NoOp.apply(a),), (rand(ROWS, HIDDEN),)),
    }


def timed_calls(inputs, forward, grads, backward: bool):
    """A function running one call of the case (forward, or forward and backward)."""
    import torch

    if not backward:
        detached = tuple(t.detach() for t in inputs)

        def call():
            with torch.no_grad():
                forward(*detached)

        return call
    leaves = tuple(t.detach().requires_grad_() for t in inputs)

    def call():
        torch.autograd.grad(forward(*leaves), leaves, grads)

    return call


def measure(cases, device: str, rounds: int, calls: int) -> dict:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = {}
    for name, (inputs, forward, grads) in cases.items():
        for mode, backward in (("fwd, no grad", False), ("fwd+bwd", True)):
            runs[(name, mode)] = timed_calls(inputs, forward, grads, backward)
    for call in runs.values():
        for _ in range(WARMUP_CALLS):
            call()
    sync()
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for key, call in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            sync()
            times[key].append((time.perf_counter() - start) / calls * 1e6)
    result: dict = {}
    for (name, mode), us in times.items():
        result.setdefault(name, {})[mode] = {
            "us_min": round(min(us), 1),
            "us_median": round(statistics.median(us), 1),
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("eager_overhead: unset TRITON_INTERPRET (it would time the interpreter)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("eager_overhead: --device cuda needs a CUDA device")
    cases = build_cases(args.device)
    results = measure(cases, args.device, args.rounds, args.calls)
    kernels_file = sys.modules["surgery.kernels"].__file__
    record = {
        "environment": common.environment(),
        "kernels_loaded_from": kernels_file,
        "device": args.device,
        "sizes": {"x, gate, up": [ROWS, HIDDEN], "q": [B, HQ, T, D], "k": [B, HK, T, D]},
        "rounds": args.rounds,
        "calls_per_round": args.calls,
        "us_per_call": results,
    }
    common.write_json(args.out / f"eager_overhead-{args.device}.json", record)
    rows = [
        [name, *(f"{r[m]['us_min']:.1f} / {r[m]['us_median']:.1f}" for m in r)]
        for name, r in results.items()
    ]
    print(f"{args.device}, {kernels_file}: us per call, min / median over {args.rounds} rounds")
    print(common.table(["function", "fwd, no grad", "fwd+bwd"], rows))


if __name__ == "__main__":
    main()
