"""TRL's fused LM head served by surgery on a sharded model, on CPU, two processes, gloo: FSDP2
(``fully_shard``, the head's weight a ``DTensor`` sharded over the ranks) and DeepSpeed ZeRO-3
(every weight a partitioned, empty placeholder outside its module's call).

TRL's trainers install their fused head (``add_fused_lm_head``) on the model before accelerate
shards it, so a patched model reaches surgery's serving with its head weight sharded; the served
kernel reads the weight inside the lm_head's call, where FSDP2 (or ZeRO-3's pre-forward hook) has
gathered it. Each case runs TRL's fused call on each rank's half of a batch, with every per-token
output TRL can ask for and a loss that reaches the loss, the log-probabilities and the entropy (an
RL objective with an entropy bonus), and compares against TRL's own head on an unpatched,
unsharded copy of the model run on the same half: every output on each rank, and every
parameter's gradient against the mean of the two halves' gradients (FSDP2 and ZeRO-3 average the
ranks' gradients). fp32: tight.

The head's layouts are those of tests/surgery/test_fsdp.py: in a group of its own, and tied to
the embeddings in one group with the final norm (accelerate's layout), with Gemma 2's softcap.
ZeRO-3 keeps nothing whole (tests/surgery/test_deepspeed.py's settings), its engine built by
``deepspeed.initialize`` (what accelerate does for TRL's trainers), its gradients read whole with
``safe_get_full_grad``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

import surgery
import surgery.forwards.head as head_module
from tests.models.tiny import tiny_model, twin
from tests.surgery.test_trl import ALL_OUTPUTS, PER_TOKEN, _batch, _with_top1_targets
from tests.utils import gloo_rank, run_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)
trl = pytest.importorskip("trl")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from tests.surgery.test_deepspeed import ZERO3, zero3_on_cpu  # noqa: E402
from tests.surgery.test_fsdp import _shard  # noqa: E402

WORLD = 2
CASES = {
    # a sampling temperature, every statistic; the head in a group of its own
    "llama-head": dict(arch="llama", layout="head", temperature=0.7),
    # tied head, final-logit softcap, in one group with the embeddings and the final norm
    "gemma2-tied_group": dict(arch="gemma2", layout="tail_group", temperature=1.0),
}


def _inputs(case: dict, rank: int):
    """The rows of ``rank`` (two a rank: a three-row padded batch and a fourth row, the first's
    tokens reversed under its mask and labels): the inputs, labels with top-1 targets among them,
    and the upstream weights of the log-probabilities and the entropy."""
    inputs, labels = _batch("padded")
    inputs = {k: torch.cat([v, v[:1].flip(1) if k == "input_ids" else v[:1]]) for k, v in
              inputs.items()}  # fmt: skip
    labels = torch.cat([labels, labels[:1]])
    labels = _with_top1_targets(tiny_model(case["arch"]), inputs, labels)
    g = torch.randn(2, labels.shape[1], generator=torch.Generator().manual_seed(3))
    rows = slice(rank * len(labels) // WORLD, (rank + 1) * len(labels) // WORLD)
    return {k: v[rows] for k, v in inputs.items()}, labels[rows], g


def _step(model, case: dict, rank: int, backward=torch.Tensor.backward, full_grad=None):
    """TRL's fused call on ``rank``'s rows and its backward: the outputs and each parameter's
    whole gradient (``full_grad(p)``; by default ``p.grad``, a ``DTensor`` made whole)."""
    inputs, labels, g = _inputs(case, rank)
    out = model(**inputs, labels=labels, fused_lm_head=True)
    width = out.log_probs.shape[1]
    backward(out.loss + (out.log_probs * g[0, :width]).sum() + (out.entropy * g[1, :width]).sum())
    outputs = {f: getattr(out, f).detach() for f in (*PER_TOKEN, "is_top1", "loss")}
    module = getattr(model, "module", model)  # a DeepSpeed engine's module
    grads = {n: (full_grad or _whole_grad)(p).clone() for n, p in module.named_parameters()}
    return outputs, grads


def _whole_grad(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def _install(model, case: dict) -> None:
    add_fused_lm_head(model, outputs=ALL_OUTPUTS, temperature=case["temperature"])


@contextlib.contextmanager
def _served():
    """The calls of surgery's per-token kernel while inside (each its requested outputs)."""
    calls: list = []
    original = head_module.linear_log_probs

    def spy(*args, **kwargs):
        calls.append(kwargs.get("outputs"))
        return original(*args, **kwargs)

    head_module.linear_log_probs = spy
    try:
        yield calls
    finally:
        head_module.linear_log_probs = original


def _fsdp2(case: dict, rank: int) -> dict:
    with _served() as calls:
        model = surgery.patch(tiny_model(case["arch"]))  # the same seed on every rank
        _install(model, case)  # as TRL's trainers do, before accelerate shards the model
        _shard(model, case["layout"], init_device_mesh("cpu", (WORLD,)))
        head = model.lm_head.weight
        outputs, grads = _step(model, case, rank)
    sharded = isinstance(head, DTensor) and head.to_local().shape[0] < head.shape[0]
    return {"outputs": outputs, "grads": grads, "served": calls, "head_sharded": sharded}


def _zero3(case: dict, rank: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    with _served() as calls:
        model = surgery.patch(tiny_model(case["arch"]))
        _install(model, case)
        config = {
            "zero_optimization": ZERO3["zero_optimization"],
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
        }
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer)
        outputs, grads = _step(engine, case, rank, engine.backward, safe_get_full_grad)
    head = model.lm_head.weight  # outside the call: the empty placeholder
    sharded = tuple(head.shape) != tuple(head.ds_shape)
    return {"outputs": outputs, "grads": grads, "served": calls, "head_sharded": sharded}


def _fsdp2_worker(rank: int, port: int, out: str, names: list[str]) -> None:
    # The kernels' PyTorch path (a forked child: the parent keeps its environment): the sharding
    # around them is what is tested.
    os.environ.pop("TRITON_INTERPRET", None)
    gloo_rank(rank, port, WORLD, out, lambda: {n: _fsdp2(CASES[n], rank) for n in names})


def _zero3_worker(rank: int, port: int, out: str, names: list[str]) -> None:
    os.environ.pop("TRITON_INTERPRET", None)

    def compute():
        zero3_on_cpu(WORLD)
        return {n: _zero3(CASES[n], rank) for n in names}

    gloo_rank(rank, port, WORLD, out, compute)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict:
    cases = list(CASES)
    runs = {"fsdp2": run_ranks(_fsdp2_worker, WORLD, tmp_path_factory.mktemp("fsdp"), cases)}
    if importlib.util.find_spec("deepspeed") is not None:
        runs["zero3"] = run_ranks(_zero3_worker, WORLD, tmp_path_factory.mktemp("zero3"), cases)
    return runs


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_served_head_equals_trls_own_unsharded(sharded_runs, engine, name):
    if engine not in sharded_runs:
        pytest.skip("DeepSpeed is not installed")
    case = CASES[name]
    reference = twin(tiny_model(case["arch"]))
    _install(reference, case)
    want = []
    for rank in range(WORLD):
        reference.zero_grad(set_to_none=True)
        want.append(_step(reference, case, rank))
    mean_grads = {n: sum(w[1][n] for w in want) / WORLD for n in want[0][1]}
    for rank in range(WORLD):
        got = sharded_runs[engine][rank][name]
        assert got["head_sharded"], "the head's weight was not sharded: the case tests nothing"
        assert got["served"] == [ALL_OUTPUTS], "surgery's kernel did not serve TRL's head"
        outputs, ref = got["outputs"], want[rank][0]
        for field in PER_TOKEN:
            torch.testing.assert_close(
                outputs[field], ref[field], rtol=1e-4, atol=2e-5,
                msg=lambda m, f=field, r=rank: f"rank {r} {f}: {m}",
            )  # fmt: skip
        assert torch.equal(outputs["is_top1"], ref["is_top1"])
        torch.testing.assert_close(outputs["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        assert got["grads"].keys() == mean_grads.keys()
        for n, g in mean_grads.items():
            torch.testing.assert_close(got["grads"][n], g, rtol=2e-4, atol=2e-6,
                                       msg=lambda m, n=n, r=rank: f"rank {r} {n}: {m}")  # fmt: skip
    assert any(w[0]["is_top1"].any() for w in want), "no top-1 token: that check would be empty"
