"""DeepSpeed ZeRO-3 through the HF Trainer on CPU: two processes, gloo, DeepSpeed's CPU accelerator.

Under ZeRO-3 every parameter is a partitioned, empty placeholder outside its module's call;
DeepSpeed's pre-forward hook on a module all-gathers the module's parameters and its post-forward
hook releases them. The fused loss reads ``lm_head.weight`` inside the lm_head's call
(``lm_head(hidden, labels=...)``), where that hook has gathered it. These tests check that it is
gathered there (a spy on the kernel call sees the full (V, D) weight, and the weight is empty
outside the call, so the check is not vacuous), that a patched model trains through
``transformers.Trainer`` with a stage-3 DeepSpeed config exactly like the unpatched model under
the same config (per-step losses, final parameters gathered with ``GatheredParameters``) and like
one process without DeepSpeed, with an untied head (Llama) and a tied one (Gemma, Gemma2:
``lm_head.weight`` is ``embed_tokens.weight``, one parameter gathered by two modules), and with a
model built under ``deepspeed.zero.Init`` (what ``from_pretrained`` does under a ZeRO-3 config) and
patched while partitioned. And that no activation rebuilt in the backward
(``surgery.forwards.recompute``) reads a parameter ZeRO-3 has released since the forward.

The config forces ZeRO-3 to keep nothing whole: no parameter persistence (by default parameters
under 100k elements, i.e. all of a tiny model, stay whole on every rank), no prefetch, no live
parameters beyond the module being called.

All runs happen in one pair of worker processes (forked, like tests/surgery/test_fsdp.py): the
Trainer with DeepSpeed leaves process-wide state behind (the default process group, accelerate's
state, transformers' global DeepSpeed config that makes every later ``from_config`` partition),
none of which may leak into the rest of the suite. The parent runs the one-process reference.

DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce op (C++, about a
minute on two cores) that only its inference all-reduce uses; the workers mark it incompatible in
``deepspeed.ops.__compatible_ops__`` (computed once per process, so the edit holds), and nothing is
compiled.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import surgery
from surgery.forwards import head as surgery_head
from surgery.forwards import recompute as surgery_recompute
from surgery.kernels import linear_cross_entropy
from surgery.kernels.dispatch import interpreter_enabled, use_triton
from tests.models.tiny import VOCAB, attn_for, sequences, tiny_config, tiny_model
from tests.utils import ListDataset, run_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)
pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed (a pure-Python wheel, DS_BUILD_OPS=0, is enough: the "
    "tests compile no op)",
)

WORLD = 2
STEPS = 3
MICRO_BATCH = 2
ACCUMULATION = 2
LR = 0.5  # SGD: linear in the gradients (Adam would amplify rounding where a gradient is ~0)
# One epoch of rows of unequal lengths (micro-batches and ranks hold different numbers of target
# tokens), exactly STEPS global batches: the Trainer steps early on an epoch's last, short window.
LENGTHS = [9, 3, 7, 4, 6, 8, 5, 3, 10, 4, 7, 6, 5, 9, 3, 8, 4, 6, 11, 3, 7, 5, 4, 6]
assert len(LENGTHS) == STEPS * ACCUMULATION * MICRO_BATCH * WORLD
ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
    },
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
}
# fp32 on every side; what differs is the order of reductions (DeepSpeed's reduce-scatter of the
# gradients, the per-rank token sums), a few ulps that three SGD steps do not blow up beyond this.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class Case:
    arch: str
    # built under deepspeed.zero.Init (partitioned from the start) and patched while partitioned,
    # instead of built whole and partitioned by deepspeed.initialize
    zero_init: bool = False
    # the kernels through Triton's interpreter, else their PyTorch path; the unpatched model runs
    # none of them, so such a case is compared with the unpatched run of the case named here
    triton_of: str | None = None


CASES = {
    "llama": Case("llama"),
    "gemma-tied": Case("gemma"),
    "gemma2-tied-softcap": Case("gemma2"),
    "llama-zero_init": Case("llama", zero_init=True),
    "gemma-tied-zero_init": Case("gemma", zero_init=True),
}
# tests/conftest.py sets TRITON_INTERPRET before triton is imported when there is no GPU; only
# then can Triton run on CPU tensors.
if interpreter_enabled():
    CASES["gemma2-tied-softcap-triton"] = Case("gemma2", triton_of="gemma2-tied-softcap")


def _unpatched(runs: dict, name: str) -> dict:
    return runs[CASES[name].triton_of or name, False]


def _dataset() -> ListDataset:
    return ListDataset([{"input_ids": s.tolist()} for s in sequences(LENGTHS, seed=5)])


def _train(model, out_dir: Path, args=None, **overrides):
    """``STEPS`` optimizer steps through the Trainer; the logged (global) loss of each step."""
    from transformers import DataCollatorWithFlattening, Trainer

    trainer = Trainer(
        model=model,
        args=args or _args(out_dir, **overrides),
        train_dataset=_dataset(),
        data_collator=DataCollatorWithFlattening(),
    )
    trainer.train()
    return trainer, [log["loss"] for log in trainer.state.log_history if "loss" in log]


def _args(out_dir: Path, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        # batches in dataset order: the DeepSpeed ranks and the one-process reference then see the
        # same global batches (rank r takes the r-th micro-batch of each global one)
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


# ---------------------------------------------------------------------------------------------
# the workers


class KernelSpy:
    """Stands in for ``linear_cross_entropy`` in ``surgery.forwards.head`` (what the patched lm_head
    calls) and records what the weight looked like inside the call."""

    def __init__(self):
        self.calls: list[dict] = []
        self.embedding: torch.nn.Parameter | None = None

    def __call__(self, hidden, weight, labels, **kwargs):
        self.calls.append(
            {
                "shape": tuple(weight.shape),
                "ds_shape": tuple(getattr(weight, "ds_shape", ())),
                "ds_status": getattr(getattr(weight, "ds_status", None), "name", None),
                "tied": weight is self.embedding,
                "triton": use_triton(hidden),
            }
        )
        return linear_cross_entropy(hidden, weight, labels, **kwargs)


class RebuildSpy:
    """Wraps the rebuild of an activation recomputed in the backward
    (``surgery.forwards.recompute``) and records its inputs as the rebuild finds them: a parameter
    among them (an RMSNorm's weight) may have been released by ZeRO-3 since the forward."""

    def __init__(self):
        self.rebuilds: list[list[dict]] = []
        self.original = surgery_recompute._Source.rebuild

    def install(self) -> None:
        spy = self

        def rebuild(source):
            spy.rebuilds.append(
                [{"shape": tuple(t.shape), "zero3": hasattr(t, "ds_id")} for t in source.inputs]
            )
            return spy.original(source)

        surgery_recompute._Source.rebuild = rebuild


def _zero3_run(case: Case, patched: bool, out_dir: Path, spy: KernelSpy, rebuilds: RebuildSpy):
    from transformers.integrations import deepspeed as hf_deepspeed

    rebuilds.rebuilds.clear()
    try:
        return {**_zero3_train(case, patched, out_dir, spy), "rebuilds": list(rebuilds.rebuilds)}
    finally:
        # transformers holds the ZeRO-3 config by a weak reference to the TrainingArguments' copy,
        # which reference cycles keep alive after the run: the next run's tiny_model would be
        # built under deepspeed.zero.Init (and its norm weights left as initialised).
        hf_deepspeed.unset_hf_deepspeed_config()


def _zero3_train(case: Case, patched: bool, out_dir: Path, spy: KernelSpy) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    if not case.zero_init:
        # built whole, before transformers' ZeRO-3 config exists: deepspeed.initialize partitions
        model = tiny_model(case.arch)
    # the config lives as long as `args` (transformers holds it by a weak reference)
    args = _args(out_dir, deepspeed=ZERO3)
    if case.zero_init:
        # transformers builds the model under deepspeed.zero.Init now, partitioned from the start;
        # the process group must exist first (zero.Init partitions over it)
        assert args.world_size == WORLD
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            tiny_config(case.arch), attn_implementation=attn_for(case.arch)
        )
        partitioned_at_patch = model.lm_head.weight.numel() == 0
    else:
        partitioned_at_patch = False
    if patched:
        surgery.patch(model)
    spy.embedding = model.model.embed_tokens.weight
    spy.calls.clear()
    trainer, losses = _train(model, out_dir, args=args)
    module = trainer.model_wrapped.module
    assert module is model
    head = model.lm_head.weight
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "engine": type(trainer.model_wrapped).__name__,
        "partitioned_at_patch": partitioned_at_patch,
        "tied": head is model.model.embed_tokens.weight,
        "head_outside_call": tuple(head.shape),
        "head_ds_shape": tuple(getattr(head, "ds_shape", ())),
        "kernel_calls": list(spy.calls),
        "direct": _direct_weight(model) if patched else None,
    }


def _direct_weight(model) -> dict:
    """The kernel called on ``lm_head.weight`` outside the module's call (a released, 0-element
    ZeRO-3 placeholder), and the supported way: through the lm_head's call, which gathers it."""
    import deepspeed

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, model.config.hidden_size, generator=g)
    labels = torch.randint(0, model.config.vocab_size, (2, 5), generator=g)
    result: dict = {"weight_shape": tuple(model.lm_head.weight.shape)}
    with torch.no_grad():
        try:
            loss = linear_cross_entropy(hidden, model.lm_head.weight, labels).loss
            result["error"] = None
            result["loss"] = loss
        except Exception as err:
            result["error"] = (type(err).__name__, str(err))
        through_module = model.lm_head(hidden, labels=labels).loss
        with deepspeed.zero.GatheredParameters([model.lm_head.weight]):
            want = linear_cross_entropy(hidden, model.lm_head.weight, labels).loss
    result["through_module"] = (through_module, want)
    return result


def zero3_on_cpu(world: int) -> None:
    """This process set up for DeepSpeed on CPU, as rank ``RANK`` of ``world`` (the environment
    torchrun would set, completed), with nothing compiled."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import deepspeed.ops
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    # Also on a GPU machine: these tests are about CPU tensors and gloo.
    set_accelerator(CPU_Accelerator())
    # The shared-memory all-reduce op serves DeepSpeed's inference all-reduce only; marked
    # incompatible, the CPU backend uses gloo for everything instead of compiling it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _worker(rank: int, port: int, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)  # two processes on a shared small machine
    # The kernels take their PyTorch path (fast): what is under test is ZeRO-3 around them.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    zero3_on_cpu(WORLD)
    # a forked child: the parent keeps the originals
    spy = KernelSpy()
    surgery_head.linear_cross_entropy = spy
    rebuilds = RebuildSpy()
    rebuilds.install()
    try:
        results = {}
        for name in names:
            case = CASES[name]
            if case.triton_of:
                os.environ["TRITON_INTERPRET"] = "1"
            for patched in (True,) if case.triton_of else (False, True):
                run_dir = Path(out) / f"{name}-{patched}-rank{rank}"
                results[name, patched] = _zero3_run(case, patched, run_dir, spy, rebuilds)
            os.environ.pop("TRITON_INTERPRET", None)
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")
    except Exception:
        # the traceback reaches pytest through torch.multiprocessing; print the rank too
        print(f"rank {rank}:\n{traceback.format_exc()}", flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory) -> dict:
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("zero3"), list(CASES))


# ---------------------------------------------------------------------------------------------
# the tests


def _one_process(case: Case, tmp_path) -> tuple[list[float], dict]:
    """The unpatched model, one process, no DeepSpeed, the same global batches."""
    model = tiny_model(case.arch)
    _, losses = _train(model, tmp_path / "one", per_device_train_batch_size=MICRO_BATCH * WORLD)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, **PARAM_TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_zero3_patched_trains_like_unpatched(zero3_runs, name):
    got, want = zero3_runs[name, True], _unpatched(zero3_runs, name)
    assert got["engine"] == want["engine"] == "DeepSpeedEngine"
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), **LOSS_TOL
    )
    _assert_params_close(got["params"], want["params"])
    if CASES[name].zero_init:
        assert got["partitioned_at_patch"], "the model was not partitioned when patched"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.zero_init])
def test_zero3_trains_like_one_process(zero3_runs, name, tmp_path):
    want_losses, want_params = _one_process(CASES[name], tmp_path)
    for got in (zero3_runs[name, True], _unpatched(zero3_runs, name)):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want_losses), **LOSS_TOL
        )
        _assert_params_close(got["params"], want_params)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_loss_sees_the_gathered_weight(zero3_runs, name):
    got = zero3_runs[name, True]
    full = (VOCAB, tiny_config(CASES[name].arch).hidden_size)
    # outside the call the weight is a released placeholder: the check below is not vacuous
    assert got["head_outside_call"] == (0,) and got["head_ds_shape"] == full
    assert got["tied"] == (CASES[name].arch != "llama")
    calls = got["kernel_calls"]
    # one fused call per micro-batch: the patched forward really took the fused path
    assert len(calls) == STEPS * ACCUMULATION
    for call in calls:
        assert call["shape"] == full and call["ds_status"] == "AVAILABLE", call
        assert call["tied"] == got["tied"]
        assert call["triton"] == bool(CASES[name].triton_of)
    assert not _unpatched(zero3_runs, name)["kernel_calls"]  # the unpatched model never fuses


def test_released_weight_passed_to_the_kernel(zero3_runs):
    """The 0-element placeholder handed to ``linear_cross_entropy`` directly fails loudly (never a
    silent loss); through the lm_head's call it is gathered and the loss is right."""
    result = zero3_runs["llama", True]["direct"]
    assert result["weight_shape"] == (0,)
    assert result["error"] is not None, f"no error; loss {result.get('loss')}"
    kind, _ = result["error"]
    assert kind in ("ValueError", "TypeError"), result["error"]
    got, want = result["through_module"]
    torch.testing.assert_close(got, want, **LOSS_TOL)


def test_released_weight_error_names_zero3(zero3_runs):
    _, message = zero3_runs["llama", True]["direct"]["error"]
    assert "ZeRO-3" in message and "lm_head(hidden" in message, message


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_never_reads_a_released_parameter(zero3_runs, name):
    """An activation rebuilt in the backward from a parameter (an RMSNorm's output, from its
    weight) would read whatever ZeRO-3 left in that parameter by then: an empty placeholder once
    the norm's call has ended. Under ZeRO-3 no rebuild reads a parameter at all (ZeRO-3 hands on a
    new tensor for every module output, so a norm output registered for recompute is never the one
    the projections save); the gated MLP's product, rebuilt from activations, still is."""
    rebuilds = zero3_runs[name, True]["rebuilds"]
    assert rebuilds, "nothing was recomputed: the spy saw nothing"
    for inputs in rebuilds:
        assert not any(i["zero3"] for i in inputs), inputs
        assert all(0 not in i["shape"] for i in inputs), inputs
