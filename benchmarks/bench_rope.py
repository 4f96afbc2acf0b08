"""RoPE on one GPU: surgery's kernels beside transformers' eager path, torch.compile and Liger.

    python benchmarks/bench_rope.py --out benchmarks/results/rope [--sweep] [--mrope]

Shapes (bf16, Llama-3-8B heads): q (4, 32, 2048, 128) / k (4, 8, 2048, 128) and q (1, 32, 8192, 128)
/ k (1, 8, 8192, 128), both made as (B, T, H, D) and viewed ``.transpose(1, 2)``: the layout
transformers hands over. Every contender is first checked against the fp32 reference at these
shapes (output and both gradients), then timed with ``triton.testing.do_bench`` (median). Achieved
bandwidth counts the bytes that must move (q and k read once and written once per pass) and is
compared with a plain copy of q + k timed in the same run. Writes ``rope.json`` and ``rope.png``
to ``--out`` and prints a table last. ``--sweep`` also times other launch configurations of the
surgery kernel (to check the fixed default). ``--rounds`` (default 3) repeats the timings over all
contenders in turn and keeps each figure's median: the GPU machine's host is shared, and host-bound
figures (forward+backward in eager mode) move by up to 2x between minutes of one run.

``--mrope`` times multimodal RoPE instead (writes ``rope_mrope.json`` / ``.png``): Qwen2.5-VL-7B's
heads and position ids, whose cases bench_mrope.py describes. This file holds the text cases, the
command line and the report; rope_timing.py the contenders, correctness gate and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from rope_timing import (
    BUDGET_FACTOR,
    BUDGET_FLOOR,
    DEVICE,
    TARGET_FRACTION_OF_COPY,
    TARGET_FRACTION_OF_LIGER,
    Mode,
    bench_case,
    import_liger,
    rotary_module,
    sweep,
)

SHAPES = [(4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128)]  # (B, Hq, Hk, T, D)
# Llama-3.1-8B's rotary configuration.
ROPE_PARAMETERS = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def build_rotary(head_dim, device):
    """Llama-3.1-8B's rotary module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return rotary_module(LlamaConfig, LlamaRotaryEmbedding, 32, 8, head_dim, 131072,
                         ROPE_PARAMETERS, device)  # fmt: skip


def text_positions(B, T, device):
    return torch.arange(T, device=device)[None]  # what transformers builds for an unpacked batch


TEXT = Mode(
    "rope", "RoPE", SHAPES, build_rotary, text_positions,
    "transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
    ("liger_kernel.transformers.rope", "liger_rotary_pos_emb"), None,
    rope_parameters=ROPE_PARAMETERS,
    positions_doc="(1, T) arange, as transformers builds for an unpacked batch",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for rope.json and rope.png")
    p.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    p.add_argument(
        "--mrope", action="store_true", help="multimodal RoPE at Qwen2.5-VL-7B's heads instead"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument(
        "--rounds", type=int, default=3, help="timing rounds over all contenders (median kept)"
    )
    return p.parse_args(argv)


def plot(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, case in zip(axes[0], results):
        names = list(case["contenders"])
        names = [n for n in names if "fwd_bwd_ms" in case["contenders"][n]]
        fwd = [case["contenders"][n]["fwd_ms"] for n in names]
        both = [case["contenders"][n]["fwd_bwd_ms"] for n in names]
        x = range(len(names))
        bars_f = ax.bar([i - 0.2 for i in x], fwd, width=0.4, label="forward")
        bars_b = ax.bar([i + 0.2 for i in x], both, width=0.4, label="forward + backward")
        ax.bar_label(bars_f, fmt="%.3f", fontsize=7)
        ax.bar_label(bars_b, fmt="%.3f", fontsize=7)
        copy_ms = case["copy"]["ms"]
        ax.axhline(copy_ms, color="k", ls="--", lw=1, label="copy of q+k (forward floor)")
        ax.axhline(2 * copy_ms, color="gray", ls=":", lw=1, label="2x copy (fwd+bwd floor)")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("ms (median)")
        ax.set_title(case["name"])
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}, bf16, transformers layout; cos/sin computation included for peers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_rope.py: no CUDA device found; this benchmark times GPU kernels only.")
    # Measure the checkout beside this script, never another surgery on sys.path (a wheel in
    # PYTHONPATH): later ``from surgery.kernels import ...`` find this one in sys.modules.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import import_surgery

    surgery_from = os.path.dirname(os.path.dirname(import_surgery().__file__))
    import transformers
    import triton
    from triton.testing import do_bench

    os.makedirs(args.out, exist_ok=True)
    device = torch.device(DEVICE)
    torch.manual_seed(0)
    if args.mrope:
        from bench_mrope import MROPE as mode
    else:
        mode = TEXT
    liger_fn, liger_info = import_liger(*mode.liger)

    def bench(fn, grad_to_none=None):
        return do_bench(
            fn, warmup=args.warmup, rep=args.rep, grad_to_none=grad_to_none, return_mode="median"
        )

    results = []
    for shape in mode.shapes:
        case, sweep_inputs = bench_case(
            mode, shape, bench, liger_fn, not args.no_compile, device, args.rounds
        )
        if args.sweep:
            case["sweep"] = sweep(mode, shape, *sweep_inputs, bench)
        results.append(case)
        del sweep_inputs
        torch.cuda.empty_cache()

    report = {
        "benchmark": mode.name,
        "surgery_loaded_from": surgery_from,
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
        },
        "liger": liger_info,
        "dtype": "bfloat16",
        "layout": "q, k made as (B, T, H, D) and viewed .transpose(1, 2), as transformers does",
        "rope_parameters": mode.rope_parameters,
        "positions": mode.positions_doc,
        "transformers_rotation": mode.hf_apply,
        "timing": (
            "triton.testing.do_bench median in ms, L2 flushed between runs. Inputs require grad. "
            "fwd: the forward alone; fwd_bwd: forward + autograd.backward with fixed upstream "
            "grads in transformers' layout, .grad reset between runs. *_graph_ms: the same pass "
            "captured in a CUDA graph and replayed (GPU time alone, no host overhead); "
            "targets_met uses the do_bench times, targets_met_graph the graph times. "
            "host_*_us: host (CPU) time per call at q (1, 32, 16, 128) / k (1, 8, 16, 128), "
            "where the GPU work is negligible: a loop of calls, synchronised once. Every figure "
            "is the median over `rounds` rounds of all contenders in turn (each round's values "
            "in contenders.*.rounds). autograd_floor: the same do_bench loops through an "
            "autograd.Function whose forward and backward only allocate their outputs (no GPU "
            "work): the host-time floor of any eager autograd implementation."
        ),
        "rounds": args.rounds,
        "cos_sin": (
            "hf_eager, torch_compile, liger and surgery_cos_sin are timed INCLUDING the cos/sin "
            "computation by transformers' rotary module (part of their cost in a model; for "
            "Liger's multimodal RoPE, the cos/sin of all three position rows, (3, B, T, D)); "
            "the *_apply_only fields time the rotation alone with cos/sin precomputed. surgery "
            "computes cos/sin inside its kernel from position_ids and inv_freq."
        ),
        "bytes": (
            "must-move bytes: forward reads q and k once and writes them once, "
            "2 * (|q| + |k|) * 2 B; forward + backward twice that. *_frac_copy = achieved "
            "bandwidth / copy bandwidth."
        ),
        "copy": "clone of one contiguous bf16 buffer of |q| + |k| elements (reads + writes)",
        "correctness": (
            "before timing, each contender's output and q/k gradients vs the fp32 reference at "
            f"the benchmark shape; correct if rel err <= {BUDGET_FACTOR} x hf_eager's + "
            f"{BUDGET_FLOOR}"
        ),
        "targets": {
            "fraction_of_copy_bandwidth": TARGET_FRACTION_OF_COPY,
            "fraction_of_liger_time": TARGET_FRACTION_OF_LIGER,
        },
        "cases": results,
    }
    json_path = os.path.join(args.out, f"{mode.name}.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot(results, os.path.join(args.out, f"{mode.name}.png"), mode.title)
    print_table(report, json_path)
    if not all(case["contenders"]["surgery"].get("correct") for case in results):
        sys.exit("bench_rope.py: surgery's kernel failed the correctness check (see rope.json)")


def print_table(report, json_path):
    print(f"\n{report['benchmark']} on {report['device']} (bf16); peers include cos/sin; liger: "
          f"{report['liger']}")  # fmt: skip
    for case in report["cases"]:
        sweep = case.get("sweep", [])
        for row in sweep[:3] + [r for r in sweep[3:] if r["default"]]:
            print(f"sweep {case['name']}: block_t={row['block_t']} tile={row['tile_elems']} "
                  f"warps={row['num_warps']}{' (default)' if row['default'] else ''}: fwd "
                  f"{row['fwd_kernel_ms']:.4f} ms ({100 * row['fwd_frac_copy']:.0f}% copy), bwd "
                  f"{row['bwd_kernel_ms']:.4f} ms")  # fmt: skip
    for case in report["cases"]:
        copy = case["copy"]
        print(f"\n{case['name']}   copy of q+k: {copy['ms']:.4f} ms = {copy['GBps']:.0f} GB/s")
        print(f"{'contender':<16}{'fwd ms':>9}{'%copy':>6}{'fwd+bwd ms':>12}{'%copy':>6}"
              f"{'graph f/fb ms':>17}{'apply-only f/fb':>17}{'host f/fb us':>14}{'max err':>9}"
              f"{'ok':>6}")  # fmt: skip
        for name, e in case["contenders"].items():
            if "error" in e:
                print(f"{name:<16} error: {e['error'][:90]}")
                continue
            ao = (f"{e['fwd_apply_only_ms']:.3f}/{e['fwd_bwd_apply_only_ms']:.3f}"
                  if "fwd_apply_only_ms" in e else "-")  # fmt: skip
            gr = "/".join(
                f"{e[k]:.3f}" if k in e else "-" for k in ("fwd_graph_ms", "fwd_bwd_graph_ms")
            )
            host = "/".join(
                f"{e[k]:.0f}" if k in e else "-" for k in ("host_fwd_us", "host_fwd_bwd_us")
            )
            print(f"{name:<16}{e['fwd_ms']:>9.4f}{100 * e['fwd_frac_copy']:>5.0f}%"
                  f"{e['fwd_bwd_ms']:>12.4f}{100 * e['fwd_bwd_frac_copy']:>5.0f}%{gr:>17}{ao:>17}"
                  f"{host:>14}{max(e['rel_err'].values()):>9.1e}"
                  f"{e.get('correct', '?')!s:>6}")  # fmt: skip
        floor = case["autograd_floor"]
        print(f"{'no-op Function':<16}{floor['fwd_ms']:>9.4f}{'':>6}{floor['fwd_bwd_ms']:>12.4f}"
              "   (autograd + timing floor, no GPU work)")  # fmt: skip
        for kind in ("", "_graph"):
            met = ", ".join(f"{k}: {v}" for k, v in case[f"targets_met{kind}"].items())
            print(f"targets ({'do_bench' if not kind else 'CUDA graph'}): {met}")
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
