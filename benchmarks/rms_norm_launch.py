"""Launch sweep of the RMSNorm backward (``surgery.kernels.rms_norm.rms_norm_bwd``: the row kernel
and the column sum of its dw buffer) at one shape, timed with CUDA graphs so that the host's
launch cost is left out, as it is in a compiled step where the host runs ahead of the GPU.

    python benchmarks/rms_norm_launch.py [--rows 8192] [--hidden 2048] [--out DIR]

Writes ``rms_norm_bwd_launch.json`` and ``.txt`` under DIR (default benchmarks/results): every
configuration's microseconds, fastest first, the default's, and dw's error against an fp32 sum.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

surgery = common.import_surgery()
# The module (surgery.kernels exports the function under the same name).
rn = importlib.import_module("surgery.kernels.rms_norm")

TILES = (2048, 4096, 8192, 16384)
PROGRAMS_PER_SM = (1, 2, 4, 8)
WARPS = (None, 4, 8, 16)
SUM_TILES = ((32, 32), (64, 32), (128, 32), (128, 64), (64, 64), (256, 16))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rms_norm_launch: needs a CUDA device (run it on the GPU machine)")
    from triton.testing import do_bench_cudagraph

    torch.manual_seed(0)
    x = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _, rstd = rn.rms_norm_fwd(x, w, 1e-5)

    def us(launch: rn.RmsNormLaunch | None) -> float:
        return round(
            do_bench_cudagraph(lambda: rn.rms_norm_bwd(dy, x, w, rstd, launch=launch)) * 1e3, 1
        )

    _, dw = rn.rms_norm_bwd(dy, x, w, rstd)
    normed = (x.float() * rstd[:, None]).to(x.dtype).float()
    ref = (dy.float() * normed).sum(0)
    rows = []
    for tile, pps, warps in itertools.product(TILES, PROGRAMS_PER_SM, WARPS):
        launch = rn.RmsNormLaunch(tile_elems=tile, bwd_programs_per_sm=pps, num_warps=warps)
        rows.append({"tile_elems": tile, "bwd_programs_per_sm": pps, "num_warps": warps,
                     "us": us(launch)})  # fmt: skip
    for sum_rows, sum_cols in SUM_TILES:
        launch = rn.RmsNormLaunch(sum_rows=sum_rows, sum_cols=sum_cols)
        rows.append({"sum_rows": sum_rows, "sum_cols": sum_cols, "us": us(launch)})
    rows.sort(key=lambda r: r["us"])
    result = {
        "shape": [args.rows, args.hidden],
        "dtype": "bfloat16",
        "gpu": torch.cuda.get_device_name(),
        "default": {**rn.DEFAULT_LAUNCH.__dict__, "us": us(None)},
        "dw_max_rel_err_vs_fp32_sum": float((dw.float() - ref).abs().max() / ref.abs().max()),
        "configs": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rms_norm_bwd_launch.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"rms_norm_bwd ({args.rows} x {args.hidden} bf16) on {result['gpu']}, CUDA-graph timed",
        f"default {result['default']}",
        f"dw max relative error vs an fp32 sum: {result['dw_max_rel_err_vs_fp32_sum']:.2e}",
    ] + [json.dumps(r) for r in rows[:15]]
    (args.out / "rms_norm_bwd_launch.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
