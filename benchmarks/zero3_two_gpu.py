"""DeepSpeed ZeRO-3 through the HF Trainer on two GPUs: a patched model trains like the unpatched
one and like one GPU without DeepSpeed, in less memory.

    torchrun --standalone --nproc_per_node 2 benchmarks/zero3_two_gpu.py --out $OUT/zero3
    deepspeed --num_gpus 2 benchmarks/zero3_two_gpu.py --out $OUT/zero3        # the same
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/zero3_two_gpu.py --cpu --tiny --out /tmp/zero3          # CPU, gloo: plumbing

DeepSpeed must be importable. Where it is not installed (the GPU image has no DeepSpeed, and no
network), install the wheels kept in the git-ignored folder ``.whl/`` (a pure-Python DeepSpeed
built with ``DS_BUILD_OPS=0``, and the dependencies the image lacks), carried to the machine:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Models and data are fsdp_two_gpu.py's (Llama-shaped, untied; Gemma2-shaped: tied lm_head,
final-logit softcap, eager attention), with the same initial weights on every rank and the same
global batch (4 x 1024 tokens, no padding) trained for every step. For each model:

1. ``single``: rank 0 alone, no DeepSpeed, the whole global batch, unpatched and patched, with
   DeepSpeed's bf16 recipe written out: bf16 parameters for the forward and backward, fp32 master
   weights that torch's AdamW steps, copied back into the bf16 parameters after every step;
2. ``zero3``: ``transformers.Trainer`` with a ZeRO-3 DeepSpeed config (bf16, no offload, HF's
   "auto" bucket sizes and persistence threshold), unpatched and patched, each rank training on
   its half of the batch. No DeepSpeed optimizer: the Trainer's ``optim="adamw_torch"``, which
   DeepSpeed wraps with its ZeRO-3 partitioning (fp32 master partitions). Constant learning rate,
   no weight decay, no gradient clipping: what the single-GPU loop does.

Each model is built whole on every rank before the Trainer exists (so not under
``deepspeed.zero.Init``) and partitioned by ``deepspeed.initialize``; rank 0's weights are
broadcast first.

Checks (the exit status is 1 when one fails): every run's per-step loss within ``--rtol`` (1e-2,
bf16) of the single-GPU unpatched loss; in every patched ZeRO-3 run the fused loss ran once per
step on every rank and saw the lm_head weight gathered (full shape) inside the lm_head's call,
while outside it the weight is an empty ZeRO-3 placeholder; and DeepSpeed compiled nothing (its
op builders' JIT path is replaced by an error for the whole run). Recorded per GPU: memory after
the engine is set up (``on_train_begin``: partitions, fp32 masters) and the peak over the training
steps (``torch.cuda.max_memory_allocated``: partitions, gathered weights, gradients, AdamW state,
activations), and the median step time. Writes ``zero3.json`` into ``--out`` (or to ``--out``
itself when it ends in ``.json``) after every run and prints the table last.

NVLink multicast stays off in every process (fsdp_two_gpu sets the variables at its import,
before torch is imported); nothing here uses symmetric memory or NVLS.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Shared with the FSDP2 benchmark, so the two results describe the same models, batch and learning
# rate. Imported first: it sets MULTICAST_OFF before it imports torch.
from fsdp_two_gpu import (
    GLOBAL_BATCH,
    LR,
    MODELS,
    MULTICAST_OFF,
    SEED,
    SEQ,
    TINY_SEQ,
    broadcast_weights,
    build_model,
    global_batch,
    max_rel_diff,
)

# isort: split
import torch
import torch.distributed as dist
from common import GIB, environment, fmt, import_surgery, short_error, table, write_json

assert all(os.environ.get(k) == v for k, v in MULTICAST_OFF.items())


def zero3_config(cpu: bool) -> dict[str, Any]:
    """Stage 3, bf16, no offload; HF's "auto" values (filled from the model and the arguments).
    With "auto", parameters under 10 x hidden_size elements stay whole (norms); the embeddings,
    the decoder projections and the lm_head are partitioned."""
    return {
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": not cpu,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }


def forbid_op_builds() -> None:
    """Turn any JIT build of a DeepSpeed C++/CUDA op into an error: this benchmark's config needs
    none (no DeepSpeed optimizer, no offload, no quantised communication), and a build would need
    a compiler, minutes, and on the GPU image may fail half-way."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"DeepSpeed tried to JIT-compile its op {self.name!r}")

    OpBuilder.jit_load = refuse


def release_zero3_leftovers(model) -> None:
    """Drop what DeepSpeed (0.19) keeps of a finished ZeRO-3 run after ``engine.destroy()``: the
    root module in a module-level list, and the coordinator with every submodule in a class-level
    ``functools.lru_cache`` on one of its methods (filled once a step's trace is complete). Through
    the model's hooks either keeps the engine alive, and with it the partitions and the optimizer
    state, which would then count in every later run's memory."""
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if stack is not None:
        stack[:] = [m for m in stack if m is not model]
    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    method = getattr(coordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    # the cache sits under an NVTX wrapper that does not expose it (no functools.wraps)
    cells = getattr(method, "__closure__", None) or ()
    for fn in (method, *(cell.cell_contents for cell in cells)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


class Rows(torch.utils.data.Dataset):
    """The rows of one (rows, seq) batch, each a dict of 1-D tensors."""

    def __init__(self, batch: dict[str, torch.Tensor]):
        self.batch = {k: v.cpu() for k, v in batch.items()}

    def __len__(self) -> int:
        return GLOBAL_BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class KernelSpy:
    """Stands in for ``linear_cross_entropy`` where the patched lm_head calls it and records the
    weight it was given: its shape, and ZeRO-3's status and full shape for it."""

    def __init__(self, surgery_head):
        self.module = surgery_head
        self.kernel = surgery_head.linear_cross_entropy
        self.calls: list[dict[str, Any]] = []

    def __call__(self, hidden, weight, labels, **kwargs):
        status = getattr(weight, "ds_status", None)
        self.calls.append(
            {
                "shape": list(weight.shape),
                "ds_shape": list(getattr(weight, "ds_shape", [])),
                "ds_status": getattr(status, "name", None),
            }
        )
        return self.kernel(hidden, weight, labels, **kwargs)

    def __enter__(self) -> KernelSpy:
        self.calls.clear()
        self.module.linear_cross_entropy = self
        return self

    def __exit__(self, *exc) -> None:
        self.module.linear_cross_entropy = self.kernel


class Runner:
    def __init__(self, args, rank: int, world: int, device: torch.device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"
        self.surgery = import_surgery()
        self.spy = KernelSpy(sys.modules["surgery.forwards.head"])
        self.scratch = Path(tempfile.mkdtemp(prefix="zero3_"))
        self.engines: list[weakref.ref] = []  # every ZeRO-3 engine so far: each must be freed

    @property
    def seq(self) -> int:
        return TINY_SEQ if self.args.tiny else SEQ

    def _clean(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _memory(self) -> float | None:
        return torch.cuda.memory_allocated() / GIB if self.cuda else None

    def _peak(self) -> float | None:
        return torch.cuda.max_memory_allocated() / GIB if self.cuda else None

    def _per_gpu(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def single(self, name: str, patched: bool) -> dict[str, Any]:
        """Rank 0 alone, the whole global batch, bf16 parameters with fp32 master weights."""
        model = build_model(name, self.args.tiny, self.device)
        if patched:
            self.surgery.patch(model)
        params = list(model.parameters())  # a tied weight once
        masters = [p.detach().float().requires_grad_() for p in params]
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0)
        batch = global_batch(model.config.vocab_size, self.seq, self.device)
        self._clean()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        before = self._memory()
        losses, times, fused = [], [], []
        for _ in range(self.args.steps):
            self._sync()
            t0 = time.perf_counter()
            out = model(**batch)
            fused.append(out.logits is None)
            out.loss.backward()
            losses.append(out.loss.detach())
            del out  # the unpatched output holds the logits: not into the next step
            for master, p in zip(masters, params):
                master.grad = p.grad.float()
                p.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for master, p in zip(masters, params):
                    p.copy_(master)
            self._sync()
            times.append(time.perf_counter() - t0)
        result = {
            "losses": [x.item() for x in losses],
            "fused": all(fused),
            "step_s": sorted(times)[len(times) // 2],
            "after_setup_gib_per_gpu": [before],
            "peak_gib_per_gpu": [self._peak()],
        }
        del model, opt, masters, params
        return result

    def zero3(self, name: str, patched: bool) -> dict[str, Any]:
        import deepspeed
        from transformers import Trainer, TrainerCallback, TrainingArguments
        from transformers.integrations import deepspeed as hf_deepspeed

        runner = self

        class Record(TrainerCallback):
            """Memory once the engine is set up, then per-step times and the peak."""

            def __init__(self):
                self.after_setup: float | None = None
                self.times: list[float] = []
                self.t0 = 0.0

            def on_train_begin(self, args, state, control, **kwargs):
                runner._clean()
                self.after_setup = runner._memory()
                if runner.cuda:
                    torch.cuda.reset_peak_memory_stats()

            def on_step_begin(self, args, state, control, **kwargs):
                runner._sync()
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                runner._sync()
                self.times.append(time.perf_counter() - self.t0)

        # An engine still alive holds its partitions and optimizer state: this run's memory would
        # count them.
        self._clean()
        alive = sum(ref() is not None for ref in self.engines)
        if alive:
            raise RuntimeError(f"{alive} earlier DeepSpeed engine(s) not freed")
        # Built whole, before transformers' ZeRO-3 config exists (a model built while it does is
        # built under deepspeed.zero.Init); deepspeed.initialize partitions it.
        assert not hf_deepspeed.is_deepspeed_zero3_enabled()
        model = build_model(name, self.args.tiny, self.device)
        broadcast_weights(model)
        if patched:
            self.surgery.patch(model)
        batch = global_batch(model.config.vocab_size, self.seq, torch.device("cpu"))
        args = TrainingArguments(
            output_dir=str(self.scratch / f"{name}-{patched}"),
            deepspeed=zero3_config(cpu=not self.cuda),
            bf16=True,
            use_cpu=not self.cuda,
            per_device_train_batch_size=GLOBAL_BATCH // self.world,
            gradient_accumulation_steps=1,
            max_steps=self.args.steps,
            optim="adamw_torch",
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,
            train_sampling_strategy="sequential",  # rank r: rows r*n .. (r+1)*n - 1, every step
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=SEED,
            dataloader_num_workers=0,
        )
        record = Record()
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Rows(batch),
            data_collator=stack_rows,
            callbacks=[record],
        )
        try:
            with self.spy as spy:
                trainer.train()
            engine = trainer.model_wrapped
            if not isinstance(engine, deepspeed.DeepSpeedEngine):
                raise RuntimeError(f"the Trainer wrapped the model in {type(engine).__name__}")
            if engine.zero_optimization_stage() != 3:
                raise RuntimeError(f"ZeRO stage {engine.zero_optimization_stage()}, not 3")
            head = model.lm_head.weight
            result: dict[str, Any] = {
                "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                "step_s": sorted(record.times)[len(record.times) // 2],
                "after_setup_gib_per_gpu": self._per_gpu(record.after_setup),
                "peak_gib_per_gpu": self._per_gpu(self._peak()),
                "tied": head is model.model.embed_tokens.weight,
                "head_outside_call": list(head.shape),
                "head_ds_shape": list(getattr(head, "ds_shape", [])),
            }
            if patched:
                calls = self._per_gpu(spy.calls)
                full = result["head_ds_shape"]
                result["kernel_calls_per_gpu"] = [len(c) for c in calls]
                result["kernel_saw_full_weight"] = all(
                    c["shape"] == full and c["ds_status"] == "AVAILABLE" for r in calls for c in r
                )
                result["fused"] = all(len(c) == self.args.steps for c in calls)
            return result
        finally:
            hf_deepspeed.unset_hf_deepspeed_config()
            engine = trainer.model_wrapped
            if hasattr(engine, "destroy"):  # removes ZeRO-3's hooks and frees its buffers
                engine.destroy()
                self.engines.append(weakref.ref(engine))
            release_zero3_leftovers(model)
            trainer.accelerator.free_memory()
            del trainer, model, engine
            self._clean()


# --------------------------------------------------------------------------------------------------
# checks and the report


def check(runs: list[dict[str, Any]], rtol: float, steps: int) -> list[str]:
    """Fill in each run's comparison with its model's single-GPU unpatched run; the failures."""
    failures = []
    refs = {r["model"]: r for r in runs if r["mode"] == "single" and not r["patched"]}
    unpatched = {(r["model"], r["mode"]): r for r in runs if not r["patched"] and "losses" in r}
    for r in runs:
        label = f"{r['model']} {r['mode']} {'surgery' if r['patched'] else 'unpatched'}"
        if "error" in r:
            failures.append(f"{label}: {r['error']}")
            continue
        if len(r["losses"]) != steps:
            failures.append(f"{label}: {len(r['losses'])} losses logged, not {steps}")
            continue
        ref = refs.get(r["model"])
        if ref is None or "losses" not in ref:
            failures.append(f"{label}: no single-GPU reference")
            continue
        if r is not ref:
            r["max_rel_loss_diff"] = max_rel_diff(r["losses"], ref["losses"])
            r["loss_ok"] = r["max_rel_loss_diff"] <= rtol  # NaN compares False
            if not r["loss_ok"]:
                failures.append(
                    f"{label}: loss differs from one GPU by {r['max_rel_loss_diff']:.2e} "
                    f"(> rtol {rtol:g}): {r['losses']} vs {ref['losses']}"
                )
        if r["patched"] and not r.get("fused", False):
            failures.append(f"{label}: the fused loss did not run once per step on every rank")
        if r["mode"] == "zero3":
            if r["head_outside_call"] != [0]:
                failures.append(f"{label}: lm_head.weight is {r['head_outside_call']} outside its "
                                "call, not a ZeRO-3 placeholder")  # fmt: skip
            if r["patched"] and not r["kernel_saw_full_weight"]:
                failures.append(f"{label}: the fused loss saw a weight that was not gathered")
        base = unpatched.get((r["model"], r["mode"]))
        peak, base_peak = r.get("peak_gib_per_gpu") or [None], (base or {}).get("peak_gib_per_gpu")
        if r["patched"] and base_peak and None not in peak and None not in base_peak:
            r["peak_saved_gib"] = max(base_peak) - max(peak)
            r["peak_ratio"] = max(peak) / max(base_peak)
    return failures


def report(runs: list[dict[str, Any]]) -> str:
    rows = []
    for r in runs:
        ok = "error" not in r
        rows.append(
            [
                r["model"],
                r["mode"],
                "surgery" if r["patched"] else "unpatched",
                fmt(r["losses"][0], ".4f") if ok else "-",
                fmt(r["losses"][-1], ".4f") if ok else "-",
                fmt(r.get("max_rel_loss_diff"), ".1e"),
                "/".join(fmt(m, ".2f") for m in r.get("after_setup_gib_per_gpu") or []) or "-",
                "/".join(fmt(p, ".2f") for p in r.get("peak_gib_per_gpu") or []) or "-",
                fmt(r.get("peak_saved_gib"), ".2f"),
                fmt(1e3 * r["step_s"], ".0f") if ok else "-",
                ("error: " + r["error"][:60]) if not ok else "ok",
            ]
        )
    headers = [
        "model",
        "run",
        "forward",
        "loss[0]",
        "loss[-1]",
        "rel diff",
        "setup GiB/GPU",
        "peak GiB/GPU",
        "saved GiB",
        "step ms",
        "",
    ]
    return table(headers, rows)


# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for zero3.json, or a .json path")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list from {list(MODELS)}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rtol", type=float, default=1e-2, help="per-step loss vs one GPU (bf16)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (plumbing; use with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes")
    # the deepspeed launcher passes --local_rank=N; the environment has it too
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def result_path(out: Path) -> Path:
    return out if out.suffix == ".json" else out / "zero3.json"


def write_result(args, env, runs, failures, world, device, seq, wall_s) -> None:
    import deepspeed

    env = {**env, "deepspeed": deepspeed.__version__}
    result = {
        "environment": env,
        "settings": {
            "world_size": world,
            "device": str(device),
            "global_batch": GLOBAL_BATCH,
            "seq": seq,
            "steps": args.steps,
            "lr": LR,
            "dtype": "bf16 parameters, fp32 master weights (DeepSpeed's bf16; by hand on one GPU)",
            "optimizer": "torch AdamW (Trainer optim=adamw_torch), constant lr, no weight decay, "
            "no clipping",
            "deepspeed_config": zero3_config(cpu=device.type == "cpu"),
            "rtol": args.rtol,
            "tiny": args.tiny,
            "models": {n: MODELS[n]["config"] for n in args.models.split(",")},
            "multicast_off": {k: os.environ.get(k) for k in MULTICAST_OFF},
        },
        "runs": runs,
        "failures": failures,
        "ok": not failures,
        "wall_s": wall_s,
    }
    write_json(result_path(args.out), result)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun --standalone --nproc_per_node 2 (see the docstring)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if GLOBAL_BATCH % world:
        sys.exit(f"the global batch of {GLOBAL_BATCH} does not split over {world} ranks")
    if args.cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed picks its accelerator
    try:
        import deepspeed
    except ImportError as err:
        sys.exit(f"deepspeed is not importable ({err}): install the wheels (see the docstring)")
    forbid_op_builds()
    # A rank left waiting in a collective by the other's failure gives up after this.
    timeout = datetime.timedelta(minutes=3)
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce that only its
        # inference all-reduce uses; marked incompatible, it uses gloo alone.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        deepspeed.init_distributed(dist_backend="nccl", timeout=timeout)
    runner = Runner(args, rank, world, device)
    names = args.models.split(",")
    plan = [
        (name, mode, p) for name in names for mode in ("single", "zero3") for p in (False, True)
    ]

    env = environment() if rank == 0 else None
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    t_start = time.perf_counter()
    for name, mode, patched in plan:
        record: dict[str, Any] = {"model": name, "mode": mode, "patched": patched}
        fatal = None
        try:
            if mode == "single":
                if rank == 0:
                    record.update(runner.single(name, patched))
                dist.barrier()
            else:
                record.update(runner.zero3(name, patched))
        except Exception as err:
            record.update(status="error", error=short_error(err))
            print(f"rank {rank}: {name} {mode}: {err!r}", file=sys.stderr, flush=True)
            fatal = err  # the other rank may sit in a collective: stop
        if rank == 0:
            runs.append(record)
            failures = check(runs, args.rtol, args.steps)
            elapsed = time.perf_counter() - t_start
            write_result(args, env, runs, failures, world, device, runner.seq, elapsed)
            print(f"[{elapsed:.0f}s] {name} {mode} {'surgery' if patched else 'unpatched'}: "
                  f"{record.get('losses', record.get('error'))}", flush=True)  # fmt: skip
        if fatal is not None:
            raise fatal

    status = 0
    if rank == 0:
        print()
        for f in failures:
            print(f"FAIL {f}")
        print(report(runs))
        status = 1 if failures else 0
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
