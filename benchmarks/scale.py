"""Past one GPU at real size (issue 37): a Llama-3-8B-shaped and a Qwen3-30B-A3B-shaped model on
any number of GPUs, unpatched transformers, Liger and surgery side by side.

    torchrun --standalone --nproc_per_node 4 benchmarks/scale.py --out $OUT/scale
    torchrun --standalone --nproc_per_node 4 benchmarks/scale.py --engines tp --tp 2 --out ...
    torchrun --standalone --nproc_per_node 2 benchmarks/scale.py --cpu --tiny --out /tmp/scale

For each model, engine and contender, ``--steps`` AdamW steps of a bf16 model on ``--batch`` x
``--seq`` random tokens per data-parallel rank (after ``--warmup`` steps): tokens per second per
GPU (from the median step), peak memory per GPU (``torch.cuda.max_memory_allocated`` over the
steps, after sharding; the largest rank's) and the per-step global loss; then the longest sequence
each fits (doubling from ``--seq`` until a step runs out of memory on any rank, at most
``--max-seq-doublings`` times).

Engines:
- ``fsdp2``: ``fully_shard`` on every decoder layer, then the root, over every rank;
- ``accelerate``: accelerate's FSDP2 plugin (``fsdp_version=2``, transformer-based wrap);
- ``tp``: a ``dp`` x ``tp`` mesh (``--tp`` ranks per group): the attention and MLP projections
  and the head tensor-parallel over ``tp`` with torch's ``parallelize_module`` (torchtitan's Llama
  plan: q/k/v, gate and up column-wise, o and down row-wise, the head column-wise), FSDP2 over
  ``dp``. Dense models only (the experts have no plan here);
- ``tp_plan``: transformers' own tensor parallelism (``from_pretrained(..., distributed_config=
  DistributedConfig(tp_plan="auto", tp_size=--tp, fsdp_size=ranks / --tp))`` of a checkpoint rank
  0 writes once into ``--checkpoint-dir``: the model's own plan, the head's logits gathered on
  every rank), with transformers' FSDP2 over the other mesh dimension when ``--tp`` is below the
  number of ranks. MoE models too (transformers' plan shards their experts).

Contenders: ``unpatched``, ``liger`` (``_apply_liger_kernel_to_instance``: its fused loss reads
the whole head weight, so it cannot run under ``tp`` or ``tp_plan``) and ``surgery``
(``surgery.patch``), each with every decoder layer checkpointed (transformers'
``gradient_checkpointing_enable``, non-reentrant); ``surgery_noac``: surgery without
checkpointing (its own recompute options only); and ``loss_parallel`` (``tp`` only): the
unpatched model with its head's logits left sharded over the vocabulary and torch's
``loss_parallel`` taking the loss from the slices (torchtitan's loss).

Every rank builds the whole model with the same seed on its GPU (16 GB for the 8B shape, 61 GB
for the 30B-A3B one, in bf16), so every contender trains the same weights, and shards it before
the steps. NVLink multicast stays off (set before torch is imported).

Writes ``scale.json`` into ``--out`` after every run and prints the table last. ``--profile``
also records one more step of each run with torch.profiler on every rank and writes rank 0's
tables into ``--out/profile_{model}_{engine}_{contender}.txt``: GPU time by kernel class
(collectives included) against the step's span, with the products' time beside a collective;
the matrix products by operand shapes; the ops by GPU and by host time.

torchtitan's own Llama-3 8B recipe, the issue's anchor, is run beside it with torchtitan's
launcher (see docs/benchmarks.md), not from here.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Imported first: it sets MULTICAST_OFF before it imports torch.
from fsdp_two_gpu import MULTICAST_OFF, Unavailable  # noqa: I001

import torch
import torch.distributed as dist
from common import GIB, environment, fmt, import_surgery, short_error, table, write_json

MODELS: dict[str, dict[str, Any]] = {
    "llama3_8b": {
        "model_type": "llama",
        "layer": "LlamaDecoderLayer",
        "dense": True,
        "config": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                       rope_theta=500000.0, max_position_embeddings=131072,
                       tie_word_embeddings=False),
    },
    "qwen3_30b_a3b": {
        "model_type": "qwen3_moe",
        "layer": "Qwen3MoeDecoderLayer",
        "dense": False,
        "config": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                       moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=False, output_router_logits=False),
    },
}  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, vocab_size=1003)  # fmt: skip
CONTENDERS = ("unpatched", "liger", "surgery", "surgery_noac", "loss_parallel")
ENGINES = ("fsdp2", "accelerate", "tp", "tp_plan")
LR = 1e-4
SEED = 0


def modeling_module(name: str) -> str:
    model_type = MODELS[name]["model_type"]
    return f"transformers.models.{model_type}.modeling_{model_type}"


def build_model(name: str, tiny: bool, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = MODELS[name]
    kwargs = {**spec["config"], **(TINY if tiny else {})}
    config = AutoConfig.for_model(spec["model_type"], use_cache=False, **kwargs)
    torch.manual_seed(SEED)
    with device:
        # dtype= at construction, not model.to(): that would also cast the fp32 RoPE buffers.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.train()


def prepare_contender(model, contender: str, surgery) -> None:
    """The contender's kernels, and activation checkpointing where it takes it."""
    if contender == "liger":
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance
        except ImportError as err:
            raise Unavailable(f"liger-kernel not importable: {short_error(err)}") from err
        _apply_liger_kernel_to_instance(model=model)
    elif contender.startswith("surgery"):
        surgery.patch(model)
    if not contender.endswith("_noac"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def tensor_parallel_plan(model, vocab_sharded: bool = False) -> dict:
    """torchtitan's Llama plan over the ``tp`` mesh dimension, in transformers' module names; the
    head's logits gathered, or (``vocab_sharded``, for ``loss_parallel``) left sharded over the
    vocabulary as a DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    head = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if vocab_sharded
            else ColwiseParallel(output_layouts=Replicate()))  # fmt: skip
    plan: dict[str, Any] = {"lm_head": head}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):  # fmt: skip
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


class Runner:
    def __init__(self, args, rank: int, world: int, device: torch.device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"
        self.surgery = import_surgery()
        from torch.distributed.device_mesh import init_device_mesh

        tp = args.tp
        if world % tp:
            raise SystemExit(f"--tp {tp} does not divide the {world} ranks")
        self.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        self.mesh2d = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))

    def _clean(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def sharded(self, name: str, engine: str, contender: str):
        """The model of ``name`` prepared for ``contender``, sharded by ``engine``; its
        optimizer, the backward to call and the data-parallel rank and size."""
        from torch.distributed.fsdp import fully_shard

        if engine == "tp" and not MODELS[name]["dense"]:
            raise Unavailable(f"the {engine} engine runs dense models only")
        if engine in ("tp", "tp_plan") and contender == "liger":
            raise Unavailable(
                "Liger's fused loss reads the whole head weight (no tensor parallelism)"
            )
        if contender == "loss_parallel" and engine != "tp":
            raise Unavailable("loss_parallel needs the tp engine (a vocabulary-sharded head)")
        if contender == "liger" and not self.cuda:
            raise Unavailable("Liger's kernels run on GPUs only")
        if engine == "accelerate" and not self.cuda:
            raise Unavailable("accelerate shards with FSDP only on GPUs")
        if engine == "tp_plan":
            model = self._tp_plan_model(name)
            prepare_contender(model, contender, self.surgery)
            # transformers' plan leaves some parameters plain tensors beside DTensors, which
            # AdamW's multi-tensor path refuses on a GPU ("got mixed torch.Tensor and DTensor",
            # H200 x2): one parameter at a time.
            opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
            dp = self.mesh2d["dp"]  # transformers' fsdp dimension, ranked as it ranks it
            return model, opt, torch.Tensor.backward, dp.get_local_rank(), dp.size()
        model = build_model(name, self.args.tiny, self.device)
        if engine != "tp":
            prepare_contender(model, contender, self.surgery)
        if engine == "accelerate":
            return self._accelerate(name, model)
        mesh, dp_rank, dp_size = self.mesh, self.rank, self.world
        if engine == "tp":
            from torch.distributed.tensor.parallel import parallelize_module

            plan = tensor_parallel_plan(model, vocab_sharded=contender == "loss_parallel")
            model = parallelize_module(model, self.mesh2d["tp"], plan)
            # Patched after: surgery's projections then run on their local shards, torch's layout
            # hooks lifted (surgery.forwards.tensor_parallel).
            prepare_contender(model, contender, self.surgery)
            mesh = self.mesh2d["dp"]
            dp_rank, dp_size = mesh.get_local_rank(), mesh.size()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        return model, opt, torch.Tensor.backward, dp_rank, dp_size

    def _tp_plan_model(self, name: str):
        """The model of ``name`` (the weights every engine trains) loaded with transformers'
        tensor parallelism over every rank, from a checkpoint rank 0 writes once."""
        from transformers import AutoModelForCausalLM, DistributedConfig

        path = self.args.checkpoint_dir / f"{name}{'-tiny' if self.args.tiny else ''}"
        if self.rank == 0 and not (path / "config.json").exists():
            build_model(name, self.args.tiny, self.device).save_pretrained(path)
            self._clean()
        dist.barrier()
        # tp_plan= itself: deprecated since 5.17. With --tp below the ranks, transformers' FSDP2
        # over the rest (an (fsdp, tp) mesh, rank f * tp + t, as mesh2d's (dp, tp)).
        tp, fsdp = self.args.tp, self.world // self.args.tp
        config = DistributedConfig(tp_plan="auto", tp_size=tp, fsdp_size=fsdp)
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config,
                                                     dtype=torch.bfloat16)  # fmt: skip
        return model.train()

    def _accelerate(self, name: str, model):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import FullyShardedDataParallelPlugin

        AcceleratorState._reset_state(reset_partial_state=True)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[MODELS[name]["layer"]],
            reshard_after_forward=True,
            state_dict_type="SHARDED_STATE_DICT",
        )
        accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="no")
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = accelerator.prepare(model, opt)
        return model, opt, accelerator.backward, self.rank, self.world

    def batch(self, vocab: int, seq: int, dp_rank: int, step: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(SEED + 1 + dp_rank + 1000 * step)
        ids = torch.randint(0, vocab, (self.args.batch, seq), generator=g).to(self.device)
        return {"input_ids": ids, "labels": ids}

    def step(self, train, opt, batch) -> tuple[float, bool, float]:
        """One optimizer step: ``train(batch)`` (the loss's forward and backward: ``_model_loss``
        or ``_loss_parallel``, returning the loss and whether no logits were made), then AdamW;
        the loss, that flag and the seconds."""
        self._sync()
        t0 = time.perf_counter()
        loss, fused = train(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._sync()
        return loss, fused, time.perf_counter() - t0

    def run(self, name: str, engine: str, contender: str) -> dict[str, Any]:
        if contender != "liger":
            return self._run(name, engine, contender)
        # Liger's instance patch also replaces the module classes of transformers' modeling file
        # (RMSNorm, MLP, ...) for the whole process: every model built after it would carry them.
        module = importlib.import_module(modeling_module(name))
        saved = dict(vars(module))
        try:
            return self._run(name, engine, contender)
        finally:
            for key in set(vars(module)) - set(saved):
                delattr(module, key)
            for key, value in saved.items():
                setattr(module, key, value)

    def _run(self, name: str, engine: str, contender: str) -> dict[str, Any]:
        self._clean()
        model, opt, backward, dp_rank, dp_size = self.sharded(name, engine, contender)
        loss_of = _loss_parallel if contender == "loss_parallel" else _model_loss
        train = functools.partial(loss_of, model, backward=backward)
        vocab = model.config.vocab_size
        batch = self.batch(vocab, self.args.seq, dp_rank)
        self._clean()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        losses, times, fused = [], [], []
        for i in range(self.args.warmup + self.args.steps):
            if self.args.fresh_batches:
                batch = self.batch(vocab, self.args.seq, dp_rank, i + 1)
            loss, was_fused, seconds = self.step(train, opt, batch)
            dist.all_reduce(loss)  # every rank's mean over the same token count: the mean
            losses.append(loss.item() / self.world)
            fused.append(was_fused)
            if i >= self.args.warmup:
                times.append(seconds)
        peak = torch.cuda.max_memory_allocated() / GIB if self.cuda else 0.0
        peaks: list[Any] = [None] * self.world
        dist.all_gather_object(peaks, peak)
        step_s = sorted(times)[len(times) // 2]
        # Each data-parallel group trains batch x seq tokens a step on its tp ranks.
        tokens_per_gpu = self.args.batch * self.args.seq * dp_size / self.world / step_s
        result = dict(losses=losses, fused=all(fused), step_s=step_s,
                      tokens_per_s_per_gpu=tokens_per_gpu, peak_gib=max(peaks),
                      peak_gib_per_gpu=peaks)  # fmt: skip
        if self.args.profile:
            self.profile(f"{name}_{engine}_{contender}", train, opt, batch)
        result["max_seq"] = self.longest(train, opt, vocab, dp_rank)
        del model, opt, batch, train
        return result

    def profile(self, label: str, train, opt, batch) -> None:
        """One more step under torch.profiler on every rank (the collectives need them all);
        rank 0 writes its tables to ``--out/profile_{label}.txt``."""
        from torch.profiler import ProfilerActivity, profile
        from train_step import kernel_time_by_class, products_by_shape

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            self.step(train, opt, batch)
        if self.rank != 0:
            return
        events = prof.key_averages()
        sections = [
            f"== top ops by host time (self)\n{events.table('self_cpu_time_total', row_limit=30)}"
        ]
        if self.cuda:
            sections[:0] = [
                f"== GPU time by kernel class (rank 0)\n{kernel_time_by_class(prof)}",
                f"== matrix products by shape (rank 0)\n{products_by_shape(prof)}",
                f"== top ops by GPU time\n{events.table('device_time_total', row_limit=30)}",
            ]
        header = (
            f"one step of {label} on rank 0 of {self.world}, {self.args.batch} x"
            f" {self.args.seq} tokens per data-parallel rank, after the timed steps\n\n"
        )
        path = self.args.out / f"profile_{label}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + "\n\n".join(sections) + "\n")
        print(f"wrote {path}", flush=True)

    def longest(self, train, opt, vocab: int, dp_rank: int) -> int | None:
        """The longest sequence (doubling from ``--seq``) whose step runs on every rank."""
        fits, seq = self.args.seq, self.args.seq
        for _ in range(self.args.max_seq_doublings):
            seq *= 2
            self._clean()
            ok = torch.ones((), device=self.device)
            try:
                self.step(train, opt, self.batch(vocab, seq, dp_rank))
            except torch.OutOfMemoryError:
                ok.zero_()
                opt.zero_grad(set_to_none=True)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item():
                break
            fits = seq
        return fits


def _model_loss(model, batch, *, backward) -> tuple[torch.Tensor, bool]:
    """The model's own loss (transformers', or a patched model's fused one) through ``backward``;
    the detached loss and whether the forward made no logits."""
    out = model(**batch)
    backward(out.loss)
    return out.loss.detach(), out.logits is None


def _loss_parallel(model, batch, *, backward) -> tuple[torch.Tensor, bool]:
    """torchtitan's loss over a vocabulary-sharded head: the logits stay sharded (a DTensor) and
    torch's ``loss_parallel`` takes the cross entropy from each rank's slice, forward and
    backward; the next-token mean over the labels, as transformers' loss takes it."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(input_ids=batch["input_ids"]).logits
    labels = batch["labels"][:, 1:].flatten()
    with loss_parallel():
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels, ignore_index=-100)
        backward(loss)
    loss = loss.detach()
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss), False


def report(runs: list[dict[str, Any]]) -> str:
    rows = []
    for r in runs:
        if r.get("status"):
            rows.append([r["model"], r["engine"], r["contender"], r["status"], "", "", "", ""])
            continue
        rows.append([r["model"], r["engine"], r["contender"], "ok" if r["fused"] or
                     not r["contender"].startswith("surgery") else "NOT FUSED",
                     fmt(r["tokens_per_s_per_gpu"], ".0f"), fmt(r["peak_gib"], ".1f"),
                     str(r["max_seq"]), fmt(r["losses"][-1], ".4f")])  # fmt: skip
    headers = ["model", "engine", "contender", "status", "tok/s/GPU", "peak GiB", "max seq",
               "last loss"]  # fmt: skip
    return table(headers, rows)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in runs if not r.get("status")]
    if not done:
        return
    labels = [f"{r['model']}\n{r['engine']}\n{r['contender']}" for r in done]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(done) * 0.9), 4.5))
    for ax, key, title in ((axes[0], "tokens_per_s_per_gpu", "tokens/s per GPU"),
                           (axes[1], "peak_gib", "peak GiB per GPU")):  # fmt: skip
        ax.bar(range(len(done)), [r[key] for r in done])
        ax.set_xticks(range(len(done)), labels, fontsize=6)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for scale.json and scale.png")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list from {list(MODELS)}")
    p.add_argument("--engines", default="fsdp2,accelerate", help=f"comma list from {ENGINES}")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"from {CONTENDERS}")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per group (tp)")
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("/tmp/scale_checkpoints"),
        help="where the tp_plan engine's checkpoint is written once (16 GB for the 8B shape)",
    )
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-seq-doublings", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (plumbing; with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes")
    p.add_argument("--profile", action="store_true", help="profile one more step of each run")
    p.add_argument(
        "--fresh-batches",
        action="store_true",
        help="new random tokens every step (default: one batch, which the model memorises: its "
        "gradients shrink, and GPU clocks, hence product speeds, depend on the data)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun --standalone --nproc_per_node N (see the docstring)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=5)
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    runner = Runner(args, rank, world, device)
    env = environment() if rank == 0 else None
    runs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for name in args.models.split(","):
        for engine in args.engines.split(","):
            for contender in args.contenders.split(","):
                record: dict[str, Any] = dict(model=name, engine=engine, contender=contender)
                try:
                    record.update(runner.run(name, engine, contender))
                except Unavailable as err:
                    record.update(status="unavailable", error=str(err))
                except torch.OutOfMemoryError as err:  # the same shapes on every rank
                    record.update(status="out of memory", error=short_error(err))
                if rank == 0:
                    runs.append(record)
                    elapsed = time.perf_counter() - t_start
                    settings = {**vars(args), "out": str(args.out), "world_size": world,
                                "checkpoint_dir": str(args.checkpoint_dir),
                                "models": {n: MODELS[n]["config"] for n in MODELS}}  # fmt: skip
                    write_json(args.out / "scale.json",
                               dict(environment=env, settings=settings, runs=runs,
                                    multicast_off=MULTICAST_OFF, wall_s=elapsed))  # fmt: skip
                    print(f"[{elapsed:.0f}s] {name} {engine} {contender}: "
                          f"{record.get('tokens_per_s_per_gpu', record.get('error'))}",
                          flush=True)  # fmt: skip
    if rank == 0:
        plot(runs, args.out / "scale.png")
        print(report(runs))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
