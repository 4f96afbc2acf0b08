"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU: two processes, gloo, a CPU device mesh.

A patched model sharded by FSDP2 must train like the unpatched model on one process. The fused loss
reads the lm_head weight inside the lm_head's call, where FSDP2 has all-gathered it; these tests
cover every place the head can sit: in a group of its own, with the root, tied to the embeddings
(Gemma), and in a multi-module group (what accelerate's FSDP2 plugin builds). Each case trains a
few AdamW steps of a tiny fp32 model on a global batch split across the two ranks and compares the
per-step global loss and the final full parameters against one process, unpatched, on the whole
batch.

How the loss averages: FSDP2 averages gradients over ranks (reduce-scatter, mean). With the
token-mean loss, each rank's mean over its own target tokens, averaged over ranks, is the global
token mean only when the ranks hold equal numbers of target tokens, so the "mean" cases build the
batch that way (rows of unequal lengths, equal totals per rank). The "num_items" case has unequal
counts and does what the HF Trainer does with ``average_tokens_across_devices``: every rank passes
the global count as ``num_items_in_batch`` (its loss is then its token sum over the global count)
and multiplies the loss by the world size before ``backward`` to undo FSDP's mean.

All cases run in one pair of worker processes (forked: no second import of torch and transformers)
to stay within the CPU budget; the parent computes the references and compares, one test a case.
"""

from __future__ import annotations

import datetime
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import surgery
from surgery.kernels import linear_cross_entropy
from surgery.kernels.dispatch import interpreter_enabled
from tests.models.tiny import VOCAB, tiny_model
from tests.utils import run_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

WORLD = 2
STEPS = 3
LR = 1e-3
# Adam turns a gradient at rounding level (1e-9 against a typical 1e-3) into a step of up to LR,
# so two correct runs can differ there by a good part of LR; an eps above that level damps it.
ADAM_EPS = 1e-6
ROW_LEN = 12
# Row lengths of the global batch (pads after them); ranks take consecutive halves. Target tokens
# per row = length - 1 (next-token labels): equal: 11 + 6 = 9 + 8 per rank; unequal: 11 + 3 vs 17.
EQUAL_TOKENS = (12, 7, 10, 9)
UNEQUAL_TOKENS = (12, 4, 10, 9)
# fp32 on both sides; what differs is the order of reductions (the gradient reduce-scatter, the
# per-rank loss sums), a few ulps, which three Adam steps do not blow up beyond this.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class Case:
    arch: str
    layout: str  # how fully_shard is applied, see _shard
    loss: str = "mean"  # "mean" (equal tokens per rank) | "num_items" (unequal, global count)
    patch_after_shard: bool = False
    triton: bool = False  # the kernels through Triton's interpreter, else their PyTorch path


CASES = {
    # lm_head in a group of its own: all-gathered by its own pre-forward hook
    "llama-head": Case("llama", "head"),
    # lm_head in the root's group, which is unsharded for the whole forward
    "llama-root": Case("llama", "root"),
    # [final norm, lm_head] in one group, as accelerate's FSDP2 plugin does
    "llama-tail_group": Case("llama", "tail_group"),
    # patched after fully_shard: the head's class is then FSDPLinear
    "llama-head-patch_after_shard": Case("llama", "head", patch_after_shard=True),
    # unequal token counts per rank, num_items_in_batch = global count
    "llama-head-num_items": Case("llama", "head", loss="num_items"),
    # tied lm_head (Gemma): the weight is the embedding's, in the root's group
    "gemma-tied_root": Case("gemma", "root"),
    # tied, softcap: [embed, final norm, lm_head] in one group (accelerate's tied layout)
    "gemma2-tied_group": Case("gemma2", "tail_group"),
}
# tests/conftest.py sets TRITON_INTERPRET before triton is imported when there is no GPU; only
# then can Triton run on CPU tensors.
if interpreter_enabled():
    CASES["gemma2-tied_group-triton"] = Case("gemma2", "tail_group", triton=True)


def _shard(model, layout: str, mesh) -> None:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if layout == "head":
        fully_shard(model.lm_head, mesh=mesh)
    elif layout == "tail_group":
        # A tied weight must sit in one group with every module that uses it (torch raises
        # otherwise), and the group's pre-forward hook fires at its first module's call.
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        tail = [model.model.norm, model.lm_head]
        fully_shard([model.model.embed_tokens, *tail] if tied else tail, mesh=mesh)
    else:
        assert layout == "root", layout
    fully_shard(model, mesh=mesh)


def _global_batch(loss: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = EQUAL_TOKENS if loss == "mean" else UNEQUAL_TOKENS
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (len(lengths), ROW_LEN), generator=g)
    mask = (torch.arange(ROW_LEN)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _target_count(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


# ---------------------------------------------------------------------------------------------
# the workers


def _train_sharded(case: Case, mesh, rank: int) -> dict:
    model = tiny_model(case.arch)  # the same seed on every rank: the same initial weights
    if not case.patch_after_shard:
        surgery.patch(model)
    _shard(model, case.layout, mesh)
    if case.patch_after_shard:
        surgery.patch(model)
    head = model.lm_head.weight
    sharded = isinstance(head, DTensor) and head.to_local().shape[0] < head.shape[0]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    ids, mask, labels = _global_batch(case.loss)
    rows = slice(rank * len(ids) // WORLD, (rank + 1) * len(ids) // WORLD)
    extra = {}
    if case.loss == "num_items":
        extra["num_items_in_batch"] = _target_count(labels)
    losses, fused = [], []
    for _ in range(STEPS):
        out = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], **extra)
        scale = WORLD if case.loss == "num_items" else 1
        (out.loss * scale).backward()
        if not losses:  # the first step's gradients, reduced across ranks by FSDP
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        fused.append(out.logits is None)
        # the global loss: the mean of equal-count token means, or the sum of sum/global count
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / (WORLD if case.loss == "mean" else 1))
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "fused": all(fused),
        "head_sharded": sharded,
        "grads": grads,
        "params": params,
    }


def _direct_weight(mesh) -> dict:
    """``linear_cross_entropy`` called on the sharded lm_head weight outside the module's call, and
    the supported way: the call through the (patched) lm_head module."""
    model = surgery.patch(tiny_model("llama"))
    _shard(model, "head", mesh)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, model.config.hidden_size, generator=g)
    labels = torch.randint(0, model.config.vocab_size, (2, 5), generator=g)
    with torch.no_grad():
        # FSDP2 takes the first module called as its root: let that be the model.
        model(input_ids=labels.clamp(min=1), labels=labels)
        result: dict = {}
        try:
            linear_cross_entropy(hidden, model.lm_head.weight, labels)
            result["error"] = None
        except Exception as err:
            result["error"] = (type(err).__name__, str(err))
        through_module = model.lm_head(hidden, labels=labels).loss
        want = linear_cross_entropy(hidden, model.lm_head.weight.full_tensor(), labels).loss
    result["through_module"] = (through_module, want)
    return result


def _worker(rank: int, port: int, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)  # two processes on a shared small machine
    # The kernels take their PyTorch path (fast) unless a case asks for Triton: what is under test
    # is the sharding around them.
    os.environ.pop("TRITON_INTERPRET", None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for name in names:
            if CASES[name].triton:
                os.environ["TRITON_INTERPRET"] = "1"
            results[name] = _train_sharded(CASES[name], mesh, rank)
            os.environ.pop("TRITON_INTERPRET", None)
        results["direct_weight"] = _direct_weight(mesh)
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")
    except Exception:
        # the traceback reaches pytest through torch.multiprocessing; print the rank too
        print(f"rank {rank}:\n{traceback.format_exc()}", flush=True)
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict:
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("fsdp"), list(CASES))


# ---------------------------------------------------------------------------------------------
# the reference: one process, unpatched, the whole batch


def _train_single(case: Case) -> dict:
    model = tiny_model(case.arch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    ids, mask, labels = _global_batch(case.loss)
    losses = []
    for _ in range(STEPS):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        if not losses:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return {"losses": losses, "grads": grads, "params": dict(model.named_parameters())}


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_trains_like_one_process(sharded_runs, name):
    got, want = sharded_runs[name], _train_single(CASES[name])
    assert got["head_sharded"], "the lm_head weight was not sharded: the case tests nothing"
    assert got["fused"], "the fused loss did not run (logits were returned)"
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), **LOSS_TOL
    )
    # the first step's gradients: Adam hardly sees a wrong scale (a sum where a mean belongs),
    # the gradients do
    for what, tol in (("grads", GRAD_TOL), ("params", PARAM_TOL)):
        assert got[what].keys() == want[what].keys()
        for n, t in want[what].items():
            torch.testing.assert_close(
                got[what][n], t.detach(), **tol, msg=lambda m, n=n, w=what: f"{w} {n}: {m}"
            )


def test_equal_tokens_per_rank():
    # the premise of the "mean" cases, and the "num_items" case is really unequal
    for loss, equal in (("mean", True), ("num_items", False)):
        _, _, labels = _global_batch(loss)
        counts = [_target_count(half) for half in labels.chunk(WORLD)]
        assert (len(set(counts)) == 1) == equal, counts


def test_sharded_weight_passed_to_the_kernel(sharded_runs):
    """The sharded ``DTensor`` weight handed to ``linear_cross_entropy`` directly fails loudly
    (never a silent loss over one shard of the vocabulary); through the lm_head's call it works."""
    result = sharded_runs["direct_weight"]
    assert result["error"] is not None
    kind, message = result["error"]
    assert kind == "TypeError" and "lm_head(hidden" in message, result["error"]
    got, want = result["through_module"]
    torch.testing.assert_close(got, want, **LOSS_TOL)
