"""A run's report: the printed table of verdicts, the png of its curves and the json of its records
and checks (``compare`` makes the checks), with the environment they ran in."""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .compare import GRADS, TOLERANCES, Check, ratio, worst


def _fmt(x: float) -> str:
    return f"{x:.1e}" if math.isfinite(x) else str(x)


def format_table(records: list[dict[str, Any]], checks: list[Check]) -> str:
    """One line per (run, patched side): the headline numbers and the verdict.

    Δloss: the worst step's loss difference. grad@0: the worst step-0 gradient difference.
    accuracy: step-0 gradient error against the run one precision up, as a multiple of the
    unpatched model's. Δparams: weight-delta difference after the run. drift: the weights' distance
    from the run one precision up, as a multiple of the unpatched run's. logits: eval batch.
    """
    by_key: dict[tuple[str, str], list[Check]] = {}
    for c in checks:
        by_key.setdefault((c.run, c.side), []).append(c)
    header = (
        f"{'model':8} {'dtype':5} {'loss':16} {'layout':7} {'Δloss':>8} {'grad@0':>8} "
        f"{'accuracy':>8} {'Δparams':>8} {'drift':>7} {'logits':>8}  verdict"
    )
    lines = [header, "-" * len(header)]
    for record in records:
        cfg, exact = record["config"], record["exact"]
        ref_exact = record["steps"][f"reference~{exact}"]
        for side, info in record["sides"].items():
            if not info["patched"]:
                continue
            direct = record["steps"][f"{side}~reference"]
            vs_exact = record["steps"][f"{side}~{exact}"]
            accuracy = max(ratio(vs_exact[k][0], ref_exact[k][0]) for k in GRADS)
            drift = ratio(
                record["final"][f"{side}~{exact}"]["param_delta_global"],
                record["final"][f"reference~{exact}"]["param_delta_global"],
            )
            eval_logits = record["eval_init"][f"{side}~reference"]["logits"]
            failed = [c.name for c in by_key.get((cfg["name"], side), []) if not c.passed]
            verdict = "PASS" if not failed else "FAIL: " + ", ".join(failed)
            lines.append(
                f"{cfg['model']:8} {cfg['dtype']:5} {cfg['variant']['name']:16} "
                f"{info['layout']:7} {_fmt(worst(direct['loss'])[0]):>8} "
                f"{_fmt(max(direct[k][0] for k in GRADS)):>8} {accuracy:>7.2f}x "
                f"{_fmt(record['final'][f'{side}~reference']['param_delta_global']):>8} "
                f"{drift:>6.2f}x {_fmt(eval_logits):>8}  {verdict}"
            )
    return "\n".join(lines)


OVERLAP_NOTE = (
    "patched lines are drawn over the reference: where they agree they coincide\n"
    "(the lower panels show how far apart they are)"
)


def plot(records: list[dict[str, Any]], path: Path) -> Path | None:
    """``figure(records)`` written to ``path``; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = figure(records)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(records: list[dict[str, Any]]):
    """Per model: training-loss curves (reference thick and faint, patched dashed when padded and
    dotted when packed, one colour per dtype and loss; ``OVERLAP_NOTE`` under the title) and,
    below, the worst relative loss difference so far against the tolerance."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(r["config"]["model"] for r in records))
    ncols = min(4, len(models))
    nrows = -(-len(models) // ncols)
    fig, axes = plt.subplots(
        2 * nrows,
        ncols,
        figsize=(max(4.3 * ncols, 8.0), 5.0 * nrows + 0.8),
        squeeze=False,
        sharex=True,
        gridspec_kw={"height_ratios": [3, 2] * nrows},
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"padded": "--", "packed": ":"}
    keys = list(dict.fromkeys(f"{r['config']['dtype']} {r['config']['variant']['name']}"
                              for r in records))  # fmt: skip
    color_of = {k: colors[i % len(colors)] for i, k in enumerate(keys)}
    for i, model in enumerate(models):
        top, bottom = axes[2 * (i // ncols)][i % ncols], axes[2 * (i // ncols) + 1][i % ncols]
        for r in (r for r in records if r["config"]["model"] == model):
            key = f"{r['config']['dtype']} {r['config']['variant']['name']}"
            color = color_of[key]
            top.plot(r["sides"]["reference"]["loss"], color=color, lw=3, alpha=0.3)
            for side, info in r["sides"].items():
                if not info["patched"]:
                    continue
                ls = styles.get(info["layout"], "-")
                top.plot(info["loss"], color=color, ls=ls, lw=1.1)
                running, worst = [], 0.0
                for x in r["steps"][f"{side}~reference"]["loss"]:
                    worst = max(worst, x)
                    running.append(max(worst, 1e-9))
                bottom.semilogy(running, color=color, ls=ls, lw=1.1)
            bottom.axhline(TOLERANCES[r["config"]["dtype"]].loss, color=color, lw=0.8, ls="-.")
        top.set_title(model)
        top.set_ylabel("training loss")
        bottom.set_ylabel("worst |Δloss|/loss so far")
        bottom.set_xlabel("step")
    for j in range(len(models), nrows * ncols):
        axes[2 * (j // ncols)][j % ncols].axis("off")
        axes[2 * (j // ncols) + 1][j % ncols].axis("off")
    handles = [Line2D([], [], color=color_of[k], lw=2, label=k) for k in keys] + [
        Line2D([], [], color="gray", lw=3, alpha=0.3, label="reference (unpatched)"),
        Line2D([], [], color="gray", ls="--", label="patched, padded"),
        Line2D([], [], color="gray", ls=":", label="patched, packed"),
        Line2D([], [], color="gray", ls="-.", lw=0.8, label="loss tolerance"),
    ]
    per_row = 7 if ncols > 2 else 3
    fig.legend(handles=handles, loc="lower center", ncol=per_row, fontsize=8)
    fig.suptitle(f"surgery.convergence: patched vs unpatched training loss\n{OVERLAP_NOTE}",
                 fontsize="medium")  # fmt: skip
    legend_rows = -(-len(handles) // per_row)
    fig.tight_layout(rect=(0, 0.03 * legend_rows / nrows + 0.01, 1, 1))
    return fig


def environment() -> dict[str, Any]:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }


def write_json(records: list[dict[str, Any]], checks: list[Check], path: Path) -> Path:
    payload = {
        "passed": all(c.passed for c in checks),
        "environment": environment(),
        "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
        "checks": [{**asdict(c), "passed": c.passed} for c in checks],
        "runs": records,
    }
    path.write_text(json.dumps(payload, indent=1, default=float, allow_nan=True))
    return path
