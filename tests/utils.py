"""Shared test helpers: poisoning, error measures and the one tolerance table."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode

from tests import margins

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Error budget per dtype: a kernel's relative error against an fp32/fp64 reference may
# exceed eager PyTorch's own error in the same dtype by this factor plus this floor.
# Loosening an entry needs a written reason next to it.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    # strict_rtol: elementwise, fp32 inputs and arithmetic against an fp64 reference, where a
    # kernel's own rounding is what a test checks (the softcap's tanh): a few fp32 roundings
    # (eps 1.2e-7) per value, which torch's own fp32 ops stay within.
    torch.float32: {"rtol": 1e-5, "atol": 1e-5, "factor": 2.0, "floor": 1e-5, "strict_rtol": 1e-6},
    # bf16: 8 mantissa bits (eps 7.8e-3); accumulation happens in fp32 inside every kernel.
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2, "factor": 1.5, "floor": 2e-3},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3, "factor": 1.5, "floor": 5e-4},
}

# Looser bf16 budget under the Triton interpreter (CPU CI) only. Reason: the interpreter converts
# fp32 -> bf16 without round-to-nearest-even (measured with triton 3.9: 49% of N(0, 1) values
# differ from torch's conversion, mean bias 5.7e-6 against torch's 8.5e-7), so bf16 gradients
# written by a kernel carry a biased rounding error that adds up coherently in a weight gradient.
# On a GPU the conversion rounds to nearest and the table above applies.
INTERPRETER_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2, "factor": 4.0, "floor": 2e-3},
}


# Whole training steps, patched against unpatched under the same autocast, every parameter's
# gradient held to the fp32 answer (tests/surgery/test_autocast.py). The two runs round the same
# math differently and a model carries rounding through every layer, so one parameter's error in
# one run is a draw with a wide spread (a correct patch's error over the unpatched one's reached
# 8x on a single 4-value parameter of one model, 3.9x the 1.5x budget): ``assert_step_within_
# drift`` holds the parameters' median ratio tight and each parameter loosely. Measured on a
# 2-core Xeon (torch 2.13, transformers 5.24), each comparison pooling 4 models
# (``test_autocast.INSTANCES``): over 228 comparisons (19 architectures, bf16 and fp16, three
# layouts, two groups of seeds) the median ratio ranged 0.79-1.04; over 1,026 (nine groups) the
# largest single parameter's ratio was 2.2 (Gemma 3n bf16, a q_proj weight). A kernel that loses
# precision everywhere moves the median past 1.25; one that keeps more than autocast asks (fp32
# where the unpatched module rounds to bf16) moves it under 0.5; one parameter 3x worse than
# transformers' own rounding is a bug of its own.
MODEL_STEP: dict[str, float] = {"median_low": 0.5, "median_high": 1.25, "param_factor": 3.0}

FP32_CLOSE: dict[str, float] = {k: TOLERANCES[torch.float32][k] for k in ("rtol", "atol")}
"""``torch.testing.assert_close``'s rtol/atol at fp32's tolerance (patched against unpatched)."""


def tolerance(dtype: torch.dtype, device: torch.device = DEVICE) -> dict[str, float]:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return INTERPRETER_TOLERANCES.get(dtype, TOLERANCES[dtype])
    return TOLERANCES[dtype]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (or the integer minimum): an element a kernel never writes fails."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


def poisoned_empty(*shape, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    return poison_(torch.empty(*shape, dtype=dtype, device=device))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in fp64 (absolute error when the reference is zero). NaN never passes."""
    x64, r64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    denom = r64.norm()
    num = (x64 - r64).norm()
    return float(num / denom) if denom > 0 else float(num)


def assert_close_budget(x, ref, eager, dtype, what=""):
    """The kernel's error against ``ref`` may exceed eager PyTorch's error (``eager`` computed in
    ``dtype``) by at most the table's factor and floor."""
    tol = tolerance(dtype, x.device)
    err, err_eager = rel_err(x, ref), rel_err(eager, ref)
    bound = tol["factor"] * err_eager + tol["floor"]
    margins.record(what, err, bound)
    assert err <= bound, f"{what}: rel err {err:.3e} > budget {bound:.3e} (eager {err_eager:.3e})"


def extra_requirements(extra: str) -> set[str]:
    """The names of the packages ``pip install "transformers-surgery[<extra>]"`` brings beside
    the core dependencies, read from the installed distribution's metadata (what pip resolves)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    requirements = [
        Requirement(r) for r in importlib.metadata.requires("transformers-surgery") or []
    ]
    return {
        r.name
        for r in requirements
        if r.marker is not None and "extra" in str(r.marker) and r.marker.evaluate({"extra": extra})
    }


def assert_step_within_drift(grads, ref, eager, dtype, what=""):
    """Every parameter's gradient of a patched step (``grads``, name -> tensor) against ``ref``
    (fp32) within the drift of ``eager`` (the unpatched step in ``dtype``): the median over the
    parameters of their error ratios inside ``MODEL_STEP``'s band, each parameter within
    ``param_factor`` times its unpatched error plus the dtype's floor (``MODEL_STEP``)."""
    floor = tolerance(dtype, next(iter(grads.values())).device)["floor"]
    ratios = []
    for name in ref:
        err, err_eager = rel_err(grads[name], ref[name]), rel_err(eager[name], ref[name])
        bound = MODEL_STEP["param_factor"] * err_eager + floor
        margins.record(f"{what} grad {name}", err, bound)
        assert err <= bound, (
            f"{what} grad {name}: rel err {err:.3e} > budget {bound:.3e} (eager {err_eager:.3e})"
        )
        if err_eager > 0:
            ratios.append(err / err_eager)
    median = float(torch.tensor(ratios).median()) if ratios else 1.0
    low, high = MODEL_STEP["median_low"], MODEL_STEP["median_high"]
    margins.record(f"{what} median grad error ratio", median, high)
    assert low <= median <= high, (
        f"{what}: the median over {len(ratios)} parameters of (patched error / unpatched error) "
        f"is {median:.2f}, outside [{low}, {high}]"
    )


class ListDataset(torch.utils.data.Dataset):
    """A list of prepared rows as a dataset (what the Trainer tests feed their trainers)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


# Classes whose own forward, in some transformers releases, fails on every call, patched or not:
# class name -> (those releases, the error, why). Only the releases seen failing are named: a test
# of such a class is there a strict expected failure of that error (an unexpected pass, or another
# error, fails it), and elsewhere it runs whole. A new release that still fails, or one that fails
# anew, fails the suite until the entry says so.
TRANSFORMERS_FAILURES: dict[str, tuple[SpecifierSet, type[Exception], str]] = {
    "Llama4ForConditionalGeneration": (
        SpecifierSet("==5.24.*"),
        AttributeError,
        "transformers' forward builds its output from `image_outputs` of its language model's "
        "output, a field that output (MoeCausalLMOutputWithPast) does not have",
    ),
}


def assert_no_sync_and_graph_replay(step, x, w, eager) -> None:
    """``step(x, w)`` (a training step returning tensors) reads nothing on the host (it runs
    under CUDA's sync debug mode "error") and is captured in a CUDA graph, whose replay on fresh
    leaf copies of ``x`` and ``w`` gives ``eager`` (the step's eager results) within bf16's
    tolerance."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(xs, ws)  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(xs, ws)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def expect_transformers_failure(request: pytest.FixtureRequest, model_class: type) -> None:
    """Mark the calling test (``request``) a strict expected failure where the installed
    transformers release is one in which ``model_class``'s own forward fails
    (``TRANSFORMERS_FAILURES``): there is nothing to compare surgery with."""
    known = TRANSFORMERS_FAILURES.get(model_class.__name__)
    if known is None:
        return
    releases, error, why = known
    if Version(transformers.__version__) in releases:
        request.applymarker(
            pytest.mark.xfail(
                raises=error, strict=True, reason=f"transformers {transformers.__version__}: {why}"
            )
        )


class OpCount(TorchDispatchMode):
    """Counts the ops of ``OPS`` (names without the overload: ``mm``, ``_local_scalar_dense``) that
    run below autograd while ``active`` (``count``)."""

    OPS: frozenset[str] = frozenset()

    def __init__(self, ops=None):
        super().__init__()
        self.count = 0
        self.active = True
        if ops is not None:
            self.OPS = frozenset(ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.active and func.__name__.split(".")[0] in self.OPS
        return func(*args, **(kwargs or {}))


class MatrixProducts(OpCount):
    """Counts the matrix products that run: a product a checkpoint's recomputation stops inside,
    before it runs, is not counted."""

    OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"})


def enable_activation_checkpointing(model: torch.nn.Module, use_reentrant: bool) -> None:
    """transformers' activation checkpointing on ``model``, under the names the release has
    (``activation_checkpointing_enable`` from 5.18; the ``gradient_checkpointing`` ones warn
    from 5.24)."""
    options = {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def free_port() -> int:
    """A free TCP port on the loopback interface, for a test's process group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, out, cases: list) -> dict:
    """Run ``worker(rank, port, out, cases)`` in ``world`` processes and return the results it
    saved to ``out/results.pt``. Forked: the children share the parent's imports (a spawned child
    re-imports transformers, ~10 s on a loaded 2-core machine) and nothing distributed exists in
    the parent; a parent that has initialised CUDA (the suite on a GPU machine) spawns instead."""
    import torch.multiprocessing as mp

    mp.start_processes(
        worker,
        args=(free_port(), str(out), list(cases)),
        nprocs=world,
        join=True,
        start_method="spawn" if torch.cuda.is_initialized() else "fork",
    )
    return torch.load(os.path.join(str(out), "results.pt"), weights_only=False)


def gloo_rank(rank: int, port: int, world: int, out, compute) -> None:
    """The body of a ``run_ranks`` worker: this process as ``rank`` of a gloo group of ``world``
    on the loopback (also in the environment, as torchrun sets it: transformers' tensor
    parallelism reads it), ``compute()`` run, and every rank's result gathered into
    ``out/results.pt`` (a list in rank order)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        result = compute()
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, os.path.join(str(out), "results.pt"))
    finally:
        dist.destroy_process_group()


def _flash_readable(x: torch.Tensor) -> bool:
    """What flash attention's kernels read without a misaligned address (an H100 stopped with one
    on a tiny Mistral 4, whose values are a slice of kv_b_proj's output): a head size of whole
    16-byte vectors, unit last stride, and every other stride and the start on 16 bytes."""
    vector = 16 // x.element_size()
    return (
        x.shape[-1] % vector == 0
        and x.stride(-1) == 1
        and all(s % vector == 0 for s in x.stride()[:-1])
        and x.storage_offset() % vector == 0
    )


class ReferenceVarlen:
    """``varlen_attn``'s signature in fp32 (``dense_varlen``), checking what flash attention
    would refuse (layouts, an upper bound below the longest document); records its calls."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert cu_q is cu_k and max_q == max_k and cu_q.dtype == torch.int32
        assert q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0] == cu_q[-1]
        assert max_q >= int(cu_q.diff().max())  # it sizes the grid: an upper bound is exact
        for x in (q, k, v):
            assert _flash_readable(x), (x.shape, x.stride(), x.storage_offset())
        self.calls.append(dict(cu=cu_q.tolist(), max=max_q, scale=scale, window=window_size))
        return dense_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


def dense_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
    """``varlen_attn``'s signature in fp32 from dense masks, traceable (no host reads), for CPU:
    each document attends to itself within flash attention's (left, right) window (-1: no limit
    on that side; (-1, 0) is causal); ``max_q`` may be any upper bound."""
    left, right = window_size
    idx = torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype)
    doc = torch.searchsorted(cu_q[1:].contiguous(), idx, right=True)
    allowed = doc[:, None] == doc[None, :]
    if right >= 0:
        allowed &= idx[None, :] <= idx[:, None] + right
    if left >= 0:
        allowed &= idx[None, :] >= idx[:, None] - left
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(groups, 0), vf.repeat_interleave(groups, 0)
    probs = ((qf @ kf.transpose(1, 2)) * scale).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ vf).transpose(0, 1).to(q.dtype)
