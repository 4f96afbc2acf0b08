"""``python -m surgery.convergence``: train original and patched mini models side by side and say
whether they train alike.

With no arguments: llama, fp32, tiny on CPU (the Triton kernels through the interpreter) or full
size on CUDA; padded and packed batches; HF's token-mean loss, and the per-sequence mean with
z-loss. The full GPU suite is ``--model all --dtype fp32`` and ``--model all --dtype bf16``.

``--pretrained PATH_OR_HUB_ID [--data FILE]``: the same check on the user's own checkpoint (and
tokenizer) and data, bf16 by default, the sides one after another (``pretrained``); it prints
where its rules differ from the mini configs'. Exits 1 when any check fails.

``--multimodal``: the mini multimodal wrappers (``--model qwen2_5_vl``, ``gemma3``, ... or
``all``) on chat samples with images (``multimodal``), padded and packed for every wrapper.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_Z_LOSS = 1e-2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m surgery.convergence",
        description="Prove that a surgery-patched model trains like the original: same init, "
        "same data, same AdamW steps; compare every step's loss, the gradients and the final "
        "weights. Exits 1 when a check fails.",
    )
    from .configs import ARCHITECTURES
    from .multimodal import MULTIMODAL

    p.add_argument(
        "--model",
        metavar="NAME[,NAME...]",
        help="'all', or a comma list of: "
        + ", ".join(ARCHITECTURES)
        + " (default llama; surgery.supported()'s model_type keys too, e.g. gemma3_text); "
        "with --multimodal of: " + ", ".join(MULTIMODAL) + " (default qwen2_5_vl)",
    )
    p.add_argument(
        "--multimodal",
        action="store_true",
        help="train the mini multimodal wrapper (vision tower, projector, language model) on "
        "chat samples with synthetic images, prompts and images masked; padded and packed "
        "(the Qwen-VL family's packed rows with their multimodal positions)",
    )
    p.add_argument(
        "--pretrained",
        metavar="PATH_OR_HUB_ID",
        help="check this checkpoint (from_pretrained, with its tokenizer) instead of a mini model",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "all"],
        help="default fp32; bf16 with --pretrained (the model is loaded in it)",
    )
    _add_training_arguments(p)
    _add_pretrained_arguments(p)
    p.add_argument(
        "--lr", type=float, help="AdamW learning rate (default: per size; 1e-5 with --pretrained)"
    )
    p.add_argument(
        "--controls",
        action="store_true",
        help="run the negative controls instead: every planted bug of surgery.convergence."
        "controls must fail the checks, the bug-free imitation must pass (--dtype, --size, "
        "--device apply)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        default="convergence_out",
        type=Path,
        help="folder the json and png go to (default: %(default)s, in the current directory)",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-step progress")
    return p


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """How each run trains: steps, layouts, the loss's options, device, size and data."""
    p.add_argument("--steps", type=int, default=32, help="AdamW steps (default 32)")
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--packed", action="store_true", help="only packed batches")
    layout.add_argument("--padded", action="store_true", help="only padded batches")
    p.add_argument(
        "--reduction",
        choices=["mean", "sequence", "all"],
        help="loss reduction (default: mean, and sequence with z-loss)",
    )
    p.add_argument(
        "--z-loss",
        type=float,
        nargs="?",
        const=DEFAULT_Z_LOSS,
        metavar="SCALE",
        help=f"z-loss scale for every run (bare flag: {DEFAULT_Z_LOSS:g})",
    )
    p.add_argument("--label-smoothing", type=float, metavar="EPS")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--size", choices=["tiny", "full"], help="default: tiny on cpu, full on cuda")
    p.add_argument(
        "--data",
        default="mixed",
        metavar="KIND|FILE",
        help="synthetic data: mixed (default), lm or sft; with --pretrained also a .jsonl of "
        '{"text": ...} or {"messages": [...]} rows, or a .txt (paragraphs)',
    )


def _add_pretrained_arguments(p: argparse.ArgumentParser) -> None:
    """What applies with ``--pretrained``: the batch, the documents' length, the yardstick."""
    p.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="--pretrained: documents a step (default 4)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=512,
        help="--pretrained: tokens a document is cut to (default 512)",
    )
    p.add_argument(
        "--yardstick",
        choices=["auto", "full", "init"],
        default="auto",
        help="--pretrained: train the run one precision up (full), measure it at the initial "
        "weights only and take the drift budget from a same-dtype twin (init), or full when it "
        "fits (auto, default)",
    )


def model_names(arg: str | None, known, default: str) -> list[str]:
    """The models ``--model`` names: every one of ``known`` for ``all``, else its comma list in
    order (a ``surgery.supported()`` key such as ``gemma3_text`` read as its name ``gemma3``)."""
    if arg == "all":
        return list(known)
    names = [name.strip() for name in (arg or default).split(",") if name.strip()]
    return [name if name in known else name.removesuffix("_text") for name in names]


def _use_interpreter_on_cpu(argv: list[str]) -> str:
    """On CPU, run the real Triton kernels through the interpreter. Triton decides at decoration
    time, when ``surgery.kernels`` is imported; ``python -m surgery.convergence`` has imported it
    already (as part of the parent package), so the process restarts itself once with the
    variable set. An explicit TRITON_INTERPRET (e.g. 0, for the PyTorch fallback) is respected."""
    if "TRITON_INTERPRET" in os.environ:
        return os.environ["TRITON_INTERPRET"]
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "surgery.convergence", *argv])
    return "1"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    refused = _check_arguments(parser, args)
    if refused is not None:
        return refused

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    interpret = _use_interpreter_on_cpu(argv) if device == "cpu" else None
    size = args.size or ("full" if device == "cuda" else "tiny")
    plan = _plan(args, size)
    if isinstance(plan, int):
        return plan
    models, dtype_arg, dtypes, layouts, variants, lr = plan
    print(f"surgery.convergence on {_set_up_device(device, interpret, args.pretrained)}")
    t0 = time.perf_counter()
    say = (
        (lambda msg: None)
        if args.quiet
        else (lambda msg: print(f"  [{time.perf_counter() - t0:6.1f}s] {msg}", flush=True))
    )
    if args.controls:
        return _run_controls(args, size, device, dtypes, t0)
    if args.pretrained:
        outcome = _run_pretrained(args, device, dtypes, variants, layouts, lr, say)
        if isinstance(outcome, int):
            return outcome
        records, checks, stem = outcome
        return _report(args, records, checks, stem, t0)
    records, checks = _run_minis(args, models, size, device, dtypes, layouts, variants, lr, say)
    # One json and png for the run: named by its model, "all", or its models joined by "+".
    named = "all" if args.model == "all" else "+".join(models)
    stem = f"{named}-{dtype_arg}-{size}"
    return _report(args, records, checks, stem + ("-multimodal" if args.multimodal else ""), t0)


def _check_arguments(parser, args) -> int | None:
    """Arguments that do not go together end the program (``parser.error``); a data file that
    does not exist returns status 2; None when the run can go on."""
    from .data import DATA_KINDS

    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.multimodal and (args.pretrained or args.controls):
        parser.error("--multimodal trains the mini wrappers: drop --pretrained and --controls")
    if args.controls and args.pretrained:
        parser.error("--controls runs on the mini models: drop --pretrained")
    if args.pretrained:
        if args.model or args.size:
            parser.error("--pretrained checks one checkpoint: drop --model and --size")
        if args.batch_size < 1 or args.max_length < 2:
            parser.error("--batch-size must be at least 1 and --max-length at least 2")
        if args.data not in DATA_KINDS and not Path(args.data).is_file():
            print(f"--data {args.data}: no such file", file=sys.stderr)
            return 2
    elif args.data not in DATA_KINDS:
        parser.error(
            f"--data: a file needs --pretrained (its tokenizer); without it, one of {DATA_KINDS}"
        )
    return None


def _plan(args, size: str):
    """What the arguments ask for: ``(models, dtype argument, dtypes, layouts, variants, lr)``,
    or exit status 2 for a model the suite does not know."""
    from .configs import ARCHITECTURES
    from .side import Variant

    if args.multimodal:
        from .multimodal import MULTIMODAL as known

        default = "qwen2_5_vl"
    else:
        known, default = ARCHITECTURES, "llama"
    models = model_names(args.model, known, default)
    unknown = [m for m in models if m not in known] if not args.pretrained else []
    if unknown:
        print(f"unknown model {', '.join(map(repr, unknown))}; expected 'all' or a comma list "
              f"of {', '.join(known)}")  # fmt: skip
        return 2
    dtype_arg = args.dtype or ("bf16" if args.pretrained else "fp32")
    dtypes = ["fp32", "bf16"] if dtype_arg == "all" else [dtype_arg]
    layouts = ("packed",) if args.packed else ("padded",) if args.padded else ("padded", "packed")
    if args.reduction is None and args.z_loss is None and args.label_smoothing is None:
        variants = [Variant("mean"), Variant("sequence", DEFAULT_Z_LOSS)]
    else:
        reductions = ["mean", "sequence"] if args.reduction in (None, "all") else [args.reduction]
        variants = [Variant(r, args.z_loss or 0.0, args.label_smoothing or 0.0) for r in reductions]
    # Full size at 1e-3 spiked (Gemma2 bf16 packed: loss 1.8 apart at step 13 between two
    # correct runs, H200): a gentler rate keeps the run a comparison, not a coin toss. A
    # pretrained model is fine-tuned: at the rates above its loss jumps rather than falls.
    lr = args.lr or (1e-5 if args.pretrained else {"tiny": 2e-3, "full": 3e-4}[size])
    return models, dtype_arg, dtypes, layouts, variants, lr


def _set_up_device(device: str, interpret, pretrained) -> str:
    """Threads and TF32 for the runs on ``device``; says where the kernels run."""
    import torch

    from surgery.kernels.dispatch import interpreter_enabled, triton_available

    if device == "cpu" and not pretrained:
        # Tiny models: a second intra-op thread only spins against the interpreter (and anything
        # else on the machine); one is faster.
        torch.set_num_threads(1)
    if device == "cuda":
        # fp32 means fp32: no TF32 in the reference's matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        where = f"CUDA ({torch.cuda.get_device_name()}): Triton kernels compiled for the GPU"
        if interpreter_enabled():
            where += " (but TRITON_INTERPRET is set: they run through the slow interpreter)"
        return where
    if interpret not in (None, "", "0") and triton_available():
        return "CPU: Triton kernels through the interpreter (TRITON_INTERPRET=1)"
    return "CPU: PyTorch fallback path (TRITON_INTERPRET is off), not the Triton kernels"


def _run_minis(args, models, size, device, dtypes, layouts, variants, lr, say):
    """Every run of the mini models (or wrappers): ``(records, checks)``."""
    from .compare import evaluate
    from .train import RunConfig, train_and_compare

    print(
        f"models {', '.join(models)} | size {size} | dtype {', '.join(dtypes)} | "
        f"{args.steps} AdamW steps, lr {lr:g} | layouts {'+'.join(layouts)} | "
        f"losses {', '.join(v.name for v in variants)} | "
        + ("data chat samples with images" if args.multimodal else f"data {args.data}"),
        flush=True,
    )
    records, checks = [], []
    for dtype in dtypes:
        for model in models:
            for variant in variants:
                cfg = RunConfig(
                    model=model,
                    size=size,
                    dtype=dtype,
                    device=device,
                    steps=args.steps,
                    variant=variant,
                    layouts=layouts,
                    data=args.data,
                    lr=lr,
                    seed=args.seed,
                    multimodal=args.multimodal,
                )
                record = train_and_compare(cfg, progress=say)
                run_checks = evaluate(record)
                records.append(record)
                checks += run_checks
                failed = [f"{c.side}:{c.name}" for c in run_checks if not c.passed]
                print(
                    f"{cfg.name}: {'PASS' if not failed else 'FAIL ' + ', '.join(failed)} "
                    f"({record['seconds']:.1f}s)",
                    flush=True,
                )
    return records, checks


def _run_pretrained(args, device, dtypes, variants, layouts, lr, say):
    """The runs of ``--pretrained``: ``(records, checks, file stem)``, or an exit status."""
    from transformers import AutoConfig

    import surgery

    from .compare import evaluate
    from .pretrained import PretrainedRun, describe_rules, load_batches
    from .pretrained import train_and_compare_pretrained as train_and_compare

    model_type = AutoConfig.from_pretrained(args.pretrained).model_type
    if model_type not in surgery.supported():
        print(
            f"{args.pretrained}: surgery does not support model_type {model_type!r}; supported: "
            f"{', '.join(sorted(surgery.supported()))}",
            file=sys.stderr,
        )
        return 2

    def run_of(dtype, variant):
        return PretrainedRun(
            checkpoint=args.pretrained,
            data=args.data,
            dtype=dtype,
            device=device,
            steps=args.steps,
            variant=variant,
            layouts=layouts,
            batch_size=args.batch_size,
            max_length=args.max_length,
            lr=lr,
            seed=args.seed,
            yardstick=args.yardstick,
        )

    first = run_of(dtypes[0], variants[0])
    try:
        train_docs, eval_docs, data = load_batches(first)
    except (OSError, ValueError) as err:
        print(f"--data {args.data}: {err}", file=sys.stderr)
        return 2
    tokens = sum(len(d) for docs in train_docs for d in docs) / len(train_docs)
    print(
        f"checkpoint {args.pretrained} ({model_type}) | dtype {', '.join(dtypes)} | "
        f"{args.steps} AdamW steps, lr {lr:g} | layouts {'+'.join(layouts)} | "
        f"losses {', '.join(v.name for v in variants)} | yardstick {args.yardstick}"
    )
    print(
        f"data {data['source']}"
        + (f": {data['documents']} documents" if "documents" in data else "")
        + f" | {args.batch_size} documents of at most {args.max_length} tokens a step, "
        f"{tokens:.0f} tokens a step on average" + (f" ({data['note']})" if "note" in data else ""),
        flush=True,
    )
    records, checks, rules_shown = [], [], None
    for dtype in dtypes:
        for variant in variants:
            run = run_of(dtype, variant)
            record = train_and_compare(run, progress=say, batches=(train_docs, eval_docs))
            record["pretrained"]["data"] = data
            run_checks = evaluate(record)
            records.append(record)
            checks += run_checks
            failed = [f"{c.side}:{c.name}" for c in run_checks if not c.passed]
            peaks = record["pretrained"]["peak_training_memory_gib"]
            print(
                f"{run.name}: {'PASS' if not failed else 'FAIL ' + ', '.join(failed)} "
                f"({record['seconds']:.1f}s)"
                + (
                    "; peak GiB in training: " + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items())
                    if peaks
                    else ""
                ),
                flush=True,
            )
            rules = describe_rules(record)
            if rules != rules_shown:
                print("\n".join(rules), flush=True)
                rules_shown = rules
    return records, checks, f"{first.label}-{args.dtype or 'bf16'}"


def _run_controls(args, size, device, dtypes, t0) -> int:
    """``--controls``: the table of planted bugs and what caught them, a json; the exit status."""
    import json

    from .controls import run_controls
    from .report import environment

    print(f"negative controls | size {size} | dtype {', '.join(dtypes)}", flush=True)
    summary = run_controls(size=size, device=device, dtypes=tuple(dtypes),
                           say=lambda line: print(line, flush=True))  # fmt: skip
    summary["environment"] = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"controls-{args.dtype or 'fp32'}-{size}.json"
    path.write_text(json.dumps(summary, indent=1, default=float))
    rows = summary["controls"]
    missed = [r["control"] for r in rows if not r["caught"]]
    broken = sorted({r["control"] for r in rows if r["correct_fake_failed"]})
    elapsed = time.perf_counter() - t0
    print(f"wrote {path}")
    if missed or broken:
        print(f"FAIL: {len(missed)} of {len(rows)} planted bugs passed every check: {missed}; "
              f"the bug-free imitation failed {broken} ({elapsed:.0f}s)")  # fmt: skip
        return 1
    print(f"PASS: all {len(rows)} planted bugs caught, the bug-free imitation passed "
          f"({elapsed:.0f}s)")  # fmt: skip
    return 0


def _report(args, records, checks, stem, t0) -> int:
    """The table, the json and png, and the verdict; the exit status."""
    from .report import format_table, plot, write_json

    print()
    print(format_table(records, checks))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = write_json(records, checks, args.out / f"{stem}.json")
    png_path = None if args.no_plot else plot(records, args.out / f"{stem}.png")
    print()
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    if not args.no_plot and png_path is None:
        print(
            "(no loss-curve png: matplotlib is not installed; `pip install matplotlib`, or install "
            'surgery with its extra: pip install "transformers-surgery[convergence]")'
        )
    failed = [c for c in checks if not c.passed]
    elapsed = time.perf_counter() - t0
    if failed:
        print(f"FAIL: {len(failed)} of {len(checks)} checks failed ({elapsed:.0f}s):")
        for c in failed:
            print(f"  {c.run} {c.side} {c.name}: {c.value:.3e} > {c.limit:.3e} {c.detail}")
        return 1
    print(f"PASS: all {len(checks)} checks ({len(records)} runs, {elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
