"""FSDP2 on two GPUs: a patched model trains like the unpatched model on one GPU, in less memory.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_two_gpu.py --out $OUT/fsdp
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/fsdp_two_gpu.py --cpu --tiny --out /tmp/fsdp       # CPU, gloo: plumbing

For each model (Llama-shaped, untied; Gemma2-shaped, tied lm_head, final-logit softcap, eager
attention), with the same initial weights and the same global batch (4 x 1024 tokens, no padding,
trained for every step: the model memorises it, so a gradient that goes missing shows in the loss):

1. the single-GPU reference, on rank 0 alone: the unpatched model on the whole global batch, and
   the patched one (to tell a kernel difference from a sharding one should a check fail);
2. FSDP2 (``fully_shard`` on every decoder layer, then the lm_head in one of the layouts below,
   then the root), unpatched and patched, each rank training on its half of the batch;
3. accelerate's FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``), unpatched and
   patched, when accelerate is installed.

lm_head layouts: ``head`` (its own group), ``root`` (in the root's group), ``tail_group`` (one
group with the final norm, and the embeddings when tied: what accelerate builds; a tied weight
must sit in one group with every module that uses it).

Numerics: bf16 parameters everywhere (no ``MixedPrecisionPolicy``), AdamW, gradients reduced in
bf16. The single-GPU reference then does exactly the arithmetic of each rank, so what the check
measures is the sharding and nothing else; with fp32 master weights (``MixedPrecisionPolicy(
param_dtype=bf16, reduce_dtype=fp32)``) the reference would have to reproduce that recipe on one
GPU. Each rank holds the same number of target tokens (no padding), so the mean of the ranks'
token-mean losses, which FSDP's gradient mean trains, is the global token mean.

Checks (the exit status is 1 when one fails): every run's per-step loss within ``--rtol`` (1e-2,
bf16) of the single-GPU unpatched loss, and every patched FSDP2 run really fused (no logits
returned). Recorded: per-GPU peak memory (``torch.cuda.max_memory_allocated`` over the training
steps, after the model is sharded: shards, gradients, AdamW state, all-gathered weights,
activations) of patched vs unpatched under the same layout, and the median step time. Writes
``fsdp.json`` into ``--out`` and prints the table last.

NVLink multicast stays off in every process: the variables below are set before torch is imported
(NCCL and torch read them when a communicator or symmetric memory is first set up), and nothing
here uses symmetric memory or NVLS.
"""

from __future__ import annotations

import os

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(MULTICAST_OFF)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import GIB, environment, fmt, import_surgery, short_error, table, write_json  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "attn": "sdpa",
        "layer": "LlamaDecoderLayer",
        "layouts": ["head", "root"],
        "config": {
            "hidden_size": 1024,
            "num_hidden_layers": 4,
            "intermediate_size": 2816,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
    },
    "gemma2": {
        "model_type": "gemma2",
        "attn": "eager",  # the attention-logit softcap has no sdpa path
        "layer": "Gemma2DecoderLayer",
        "layouts": ["root", "tail_group"],
        "config": {
            "hidden_size": 1024,
            "num_hidden_layers": 4,
            "intermediate_size": 4096,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 256000,  # Gemma's: where the fused loss saves the most
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "query_pre_attn_scalar": 128,
            "sliding_window": 512,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
    },
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}
TINY_GEMMA2 = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16}

GLOBAL_BATCH = 4
SEQ = 1024
TINY_SEQ = 32
LR = 1e-3  # large enough that bf16 weights move and the losses fall visibly in a few steps
SEED = 0


# --------------------------------------------------------------------------------------------------
# models, data, layouts


def build_model(name: str, tiny: bool, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = MODELS[name]
    kwargs = dict(spec["config"])
    if tiny:
        kwargs.update(TINY)
        if name == "gemma2":
            kwargs.update(TINY_GEMMA2)
    kwargs["use_cache"] = False
    config = AutoConfig.for_model(spec["model_type"], **kwargs)
    torch.manual_seed(SEED)
    with device:
        # dtype= at construction, not model.to(): that would also cast the fp32 RoPE buffers.
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=spec["attn"]
        )
    model.train()
    return model


def broadcast_weights(model) -> None:
    """Rank 0's weights on every rank (the same seed gives the same ones; this makes sure)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)


def global_batch(vocab: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def rank_rows(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    n = GLOBAL_BATCH // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def shard(model, layout: str, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if layout == "head":
        fully_shard(model.lm_head, mesh=mesh)
    elif layout == "tail_group":
        tail = [model.model.norm, model.lm_head]
        if model.lm_head.weight is model.model.embed_tokens.weight:
            tail.insert(0, model.model.embed_tokens)
        fully_shard(tail, mesh=mesh)
    elif layout != "root":
        raise ValueError(layout)
    fully_shard(model, mesh=mesh)


# --------------------------------------------------------------------------------------------------
# training


class Unavailable(Exception):
    """A run this machine cannot do (reported, not a failure)."""


class Runner:
    def __init__(self, args, rank: int, world: int, device: torch.device, mesh):
        self.args, self.rank, self.world, self.device, self.mesh = args, rank, world, device, mesh
        self.cuda = device.type == "cuda"
        self.surgery = import_surgery()

    def _clean(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _train(self, model, opt, batch, backward, distributed: bool) -> dict[str, Any]:
        """``--steps`` steps on ``batch``; the global loss of each step and the peak memory."""
        self._clean()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if self.cuda else None
        losses, times, fused = [], [], []
        for _ in range(self.args.steps):
            self._sync()
            t0 = time.perf_counter()
            out = model(**batch)
            loss = out.loss.detach()
            fused.append(out.logits is None)
            backward(out.loss)
            del out  # the unpatched output holds the logits: not into the next step
            opt.step()
            opt.zero_grad(set_to_none=True)
            self._sync()
            times.append(time.perf_counter() - t0)
            if distributed:  # equal token counts per rank: the mean of the means is the mean
                dist.all_reduce(loss)
                loss /= self.world
            losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        return {
            "losses": losses,
            "fused": all(fused),
            "step_s": sorted(times)[len(times) // 2],
            "allocated_before_gib": None if before is None else before / GIB,
            "peak_gib": None if peak is None else peak / GIB,
        }

    def _gather_peaks(self, result: dict[str, Any]) -> None:
        peaks: list[Any] = [None] * self.world
        dist.all_gather_object(peaks, result.pop("peak_gib"))
        result["peak_gib_per_gpu"] = peaks
        result["peak_gib"] = None if peaks[0] is None else max(peaks)

    def single(self, name: str, patched: bool) -> dict[str, Any]:
        """Rank 0 alone, the whole global batch."""
        model = build_model(name, self.args.tiny, self.device)
        if patched:
            self.surgery.patch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        batch = global_batch(model.config.vocab_size, self.seq, self.device)
        result = self._train(model, opt, batch, lambda loss: loss.backward(), distributed=False)
        result["peak_gib_per_gpu"] = [result["peak_gib"]]
        del model, opt
        return result

    def fsdp(self, name: str, layout: str, patched: bool) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        model = build_model(name, self.args.tiny, self.device)
        broadcast_weights(model)
        if patched:
            self.surgery.patch(model)
        shard(model, layout, self.mesh)
        weight = model.lm_head.weight
        assert isinstance(weight, DTensor), "the lm_head weight is not sharded"
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        batch = global_batch(model.config.vocab_size, self.seq, self.device)
        batch = rank_rows(batch, self.rank, self.world)
        result = self._train(model, opt, batch, lambda loss: loss.backward(), distributed=True)
        self._gather_peaks(result)
        del model, opt
        return result

    def accelerate(self, name: str, patched: bool) -> dict[str, Any]:
        """accelerate's FSDP2 plugin, as a user would write it: patch, then ``prepare``."""
        if not self.cuda:
            raise Unavailable("accelerate shards with FSDP only on GPUs")
        try:
            from accelerate import Accelerator
            from accelerate.state import AcceleratorState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
        except ImportError as err:
            raise Unavailable(short_error(err)) from err
        from torch.distributed.fsdp import FSDPModule

        # accelerate keeps one state per process and binds its wrap policy to the first model's
        # layer class: start each run afresh (the process group stays).
        AcceleratorState._reset_state(reset_partial_state=True)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[MODELS[name]["layer"]],
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
            state_dict_type="SHARDED_STATE_DICT",
        )
        accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="no")
        if accelerator.distributed_type != DistributedType.FSDP:
            raise Unavailable(f"accelerate chose {accelerator.distributed_type}, not FSDP")
        model = build_model(name, self.args.tiny, self.device)
        broadcast_weights(model)
        if patched:
            self.surgery.patch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = accelerator.prepare(model, opt)
        if not all(isinstance(m, FSDPModule) for m in (model, *model.model.layers)):
            raise RuntimeError("accelerate did not shard the model and each decoder layer")
        batch = global_batch(model.config.vocab_size, self.seq, self.device)
        batch = rank_rows(batch, self.rank, self.world)
        result = self._train(model, opt, batch, accelerator.backward, distributed=True)
        self._gather_peaks(result)
        accelerator.free_memory()  # it holds the prepared model and optimizer
        del model, opt
        return result

    @property
    def seq(self) -> int:
        return TINY_SEQ if self.args.tiny else SEQ


# --------------------------------------------------------------------------------------------------
# checks and the report


def max_rel_diff(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))


def check(runs: list[dict[str, Any]], rtol: float) -> list[str]:
    """Fill in each run's comparison with its model's single-GPU unpatched run; the failures."""
    failures = []
    refs = {r["model"]: r for r in runs if r["mode"] == "single" and not r["patched"]}
    unpatched = {
        (r["model"], r["mode"], r["layout"]): r for r in runs if not r["patched"] and "losses" in r
    }
    for r in runs:
        forward = "surgery" if r["patched"] else "unpatched"
        label = " ".join(x for x in (r["model"], r["mode"], r["layout"], forward) if x)
        if "error" in r:
            if r.get("status") != "unavailable":
                failures.append(f"{label}: {r['error']}")
            continue
        ref = refs.get(r["model"])
        if ref is None or "losses" not in ref:
            failures.append(f"{label}: no single-GPU reference")
            continue
        if r is not ref:
            r["max_rel_loss_diff"] = max_rel_diff(r["losses"], ref["losses"])
            finite = all(math.isfinite(x) for x in r["losses"])
            r["loss_ok"] = finite and r["max_rel_loss_diff"] <= rtol
            if not r["loss_ok"]:
                failures.append(
                    f"{label}: loss differs from one GPU by {r['max_rel_loss_diff']:.2e} "
                    f"(> rtol {rtol:g}): {r['losses']} vs {ref['losses']}"
                )
        if r["patched"] and not r["fused"]:
            failures.append(f"{label}: the fused loss did not run (logits were returned)")
        base = unpatched.get((r["model"], r["mode"], r["layout"]))
        if r["patched"] and base is not None and r.get("peak_gib") and base.get("peak_gib"):
            r["peak_saved_gib"] = base["peak_gib"] - r["peak_gib"]
            r["peak_ratio"] = r["peak_gib"] / base["peak_gib"]
    return failures


def report(runs: list[dict[str, Any]]) -> str:
    rows = []
    for r in runs:
        ok = "error" not in r
        rows.append(
            [
                r["model"],
                r["mode"],
                r["layout"] or "-",
                "surgery" if r["patched"] else "unpatched",
                fmt(r["losses"][0], ".4f") if ok else "-",
                fmt(r["losses"][-1], ".4f") if ok else "-",
                fmt(r.get("max_rel_loss_diff"), ".1e"),
                "/".join(fmt(p, ".2f") for p in r.get("peak_gib_per_gpu") or []) or "-",
                fmt(r.get("peak_saved_gib"), ".2f"),
                fmt(1e3 * r["step_s"], ".0f") if ok else "-",
                (r.get("status", "error") + ": " + r["error"][:60]) if not ok else "ok",
            ]
        )
    headers = [
        "model",
        "run",
        "lm_head",
        "forward",
        "loss[0]",
        "loss[-1]",
        "rel diff",
        "peak GiB/GPU",
        "saved GiB",
        "step ms",
        "",
    ]
    return table(headers, rows)


# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for fsdp.json")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list from {list(MODELS)}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rtol", type=float, default=1e-2, help="per-step loss vs one GPU (bf16)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (plumbing; use with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes")
    p.add_argument("--no-accelerate", action="store_true", help="skip the accelerate runs")
    return p.parse_args(argv)


def write_result(args, env, runs, failures, world, device, seq, wall_s) -> None:
    result = {
        "environment": env,
        "settings": {
            "world_size": world,
            "device": str(device),
            "global_batch": GLOBAL_BATCH,
            "seq": seq,
            "steps": args.steps,
            "lr": LR,
            "dtype": "bfloat16 parameters, no MixedPrecisionPolicy",
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
    write_json(args.out / "fsdp.json", result)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun --standalone --nproc_per_node 2 (see the docstring)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if GLOBAL_BATCH % world:
        sys.exit(f"the global batch of {GLOBAL_BATCH} does not split over {world} ranks")
    # A rank left waiting in a collective by the other's failure gives up after this.
    timeout = datetime.timedelta(minutes=3)
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    runner = Runner(args, rank, world, device, mesh)
    names = args.models.split(",")
    plan: list[tuple[str, str, str | None, bool]] = []  # (model, mode, layout, patched)
    for name in names:
        plan += [(name, "single", None, False), (name, "single", None, True)]
        plan += [(name, "fsdp", lay, p) for lay in MODELS[name]["layouts"] for p in (False, True)]
    if not args.no_accelerate:  # last: a failure there costs none of the runs above
        plan += [(name, "accelerate", "accelerate", p) for name in names for p in (False, True)]

    env = environment() if rank == 0 else None
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    t_start = time.perf_counter()
    for name, mode, layout, patched in plan:
        record: dict[str, Any] = {"model": name, "mode": mode, "layout": layout, "patched": patched}
        fatal = None
        try:
            if mode == "single":
                if rank == 0:
                    record.update(runner.single(name, patched))
                dist.barrier()
            elif mode == "fsdp":
                record.update(runner.fsdp(name, layout, patched))
            else:
                record.update(runner.accelerate(name, patched))
        except Unavailable as err:  # raised on every rank alike, before any collective
            record.update(status="unavailable", error=str(err))
        except Exception as err:
            record.update(status="error", error=short_error(err))
            print(f"rank {rank}: {name} {mode} {layout}: {err!r}", file=sys.stderr, flush=True)
            # Both ranks fail alike in the accelerate runs (the same code, the same model), so the
            # next run can go on; anywhere else stop (the other rank may sit in a collective).
            fatal = None if mode == "accelerate" else err
        if rank == 0:
            runs.append(record)
            failures = check(runs, args.rtol)
            elapsed = time.perf_counter() - t_start
            write_result(args, env, runs, failures, world, device, runner.seq, elapsed)
            print(f"[{elapsed:.0f}s] {name} {mode} {layout or ''} "
                  f"{'surgery' if patched else 'unpatched'}: "
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
