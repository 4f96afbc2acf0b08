"""``linear_log_probs``: every per-token output and the gradients of the log-probabilities and
the entropy against an fp64 reference on the full logits, within the dtype's budget beside eager
PyTorch; the argmax rule of ``is_top1``; statistics that cost nothing when not requested."""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch

from surgery.kernels import (
    UpstreamHint,
    linear_cross_entropy,
    linear_cross_entropy_statistics,
    linear_log_probs,
    linear_log_probs_reference,
)
from surgery.kernels.log_probs import OUTPUTS
from tests.utils import DEVICE, assert_close_budget, assert_no_sync_and_graph_replay

CASES = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "scale-softcap": dict(logit_scale=1.3, softcap=5.0),
    "negative-scale": dict(logit_scale=-0.8, temperature=0.9),  # the top-1 is z's minimum
    "shift": dict(shift=True, temperature=1.4),
    "skip_ignored": dict(skip_ignored=True, softcap=30.0),
}
FLOAT_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")


def make_inputs(n, d, v, dtype, seed=0, bias=True, shift=False, sign=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 2 / d**0.5).to(DEVICE, dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(DEVICE, dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    # Some targets are the top-1 (most of a random row's are not).
    with torch.no_grad():
        logits = x.float() @ w.float().T + (0 if b is None else b.float())
    top = (logits * sign).argmax(-1)[::4]  # sign: the logit scale's
    labels[int(shift) :: 4] = top[: len(labels[int(shift) :: 4])]
    return x, w, b, labels.to(DEVICE)


def eager_reference(x, w, b, labels, **kw):
    """The reference over the logits eager PyTorch computes in the inputs' dtype (``x @ w.T``
    rounded to it), the rest in fp32: what the kernel's budget is measured against."""
    logits = x @ w.t() if b is None else torch.addmm(b, x, w.t())
    eye = torch.eye(logits.shape[-1], device=logits.device)
    return linear_log_probs_reference(logits.float(), eye, labels, **kw)


def weighted_grads(out, inputs, g_lp, g_ent):
    total = (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()
    return torch.autograd.grad(total, [t for t in inputs if t is not None])


@pytest.fixture
def schedule(monkeypatch):
    """Which schedule ran: the logits products of ``lce_fwd``'s unfused path (forward and
    recompute) and the calls of each backward op."""
    ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    api = importlib.import_module("surgery.kernels.linear_cross_entropy.api")
    calls = {"logits": 0, "lce_bwd_kept": 0, "lce_bwd_recompute": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(ops, "_logits", counted("logits", ops._logits))
    for name in ("lce_bwd_kept", "lce_bwd_recompute"):
        monkeypatch.setattr(api, name, counted(name, getattr(api, name)))
    return calls


# the default keeps the logits from the forward to the backward; low_memory recomputes them there
BUDGETS = {"kept": {}, "recompute": dict(low_memory=True, chunk_bytes=4096)}


@pytest.mark.parametrize("budget", list(BUDGETS), ids=list(BUDGETS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_output_and_gradient_against_fp64(case, dtype, budget, schedule):
    """Every output, and the gradients for an upstream gradient per token on the
    log-probabilities and the entropy, within the dtype's budget of fp64, in the schedule the
    budget takes: the logits kept from the forward (three products) or recomputed (four)."""
    kw = CASES[case]
    ref_kw = {k: v for k, v in kw.items() if k != "skip_ignored"}
    x, w, b, labels = make_inputs(53, 24, 301, dtype, shift=kw.get("shift", False),
                                  sign=math.copysign(1.0, kw.get("logit_scale", 1.0)))  # fmt: skip
    out = linear_log_probs(x, w, labels, b, outputs=OUTPUTS, **BUDGETS[budget], **kw)
    ref = linear_log_probs_reference(x, w, labels, b, dtype=torch.float64, **ref_kw)
    eager = eager_reference(x, w, b, labels, **ref_kw)
    for name in FLOAT_OUTPUTS:
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == labels.shape, name
        assert_close_budget(got.double(), getattr(ref, name), getattr(eager, name).double(),
                            dtype, name)  # fmt: skip
    assert out.is_top1.dtype == torch.bool
    assert torch.equal(out.is_top1, eager.is_top1)
    assert out.is_top1.any() and not out.is_top1.all()
    assert out.predicted.dtype == torch.int64
    assert torch.equal(out.predicted, eager.predicted)
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = (torch.randn(labels.shape, generator=gen).to(DEVICE) for _ in range(2))
    inputs = (x, w, b)
    got_g = weighted_grads(out, inputs, g_lp, g_ent)
    ref_g = weighted_grads(ref, inputs, g_lp.double(), g_ent.double())
    eager_g = weighted_grads(eager, inputs, g_lp, g_ent)
    for name, a, r, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got_g, ref_g, eager_g):
        assert a.dtype == dtype
        assert_close_budget(a.double(), r, e.double(), dtype, name)
    if budget == "kept":
        assert schedule == {"logits": 1, "lce_bwd_kept": 1, "lce_bwd_recompute": 0}
    else:
        assert schedule["lce_bwd_recompute"] == 1 and schedule["lce_bwd_kept"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_zero_logit_scale_makes_every_row_uniform(dtype):
    """logit_scale=0: every logit the loss sees is 0, a uniform row: log-probabilities -log V,
    entropy log V, the first maximum column 0 (argmax of a row of ties), the gradient 0."""
    x, w, b, labels = make_inputs(24, 16, 301, dtype)
    labels[:3] = 0
    out = linear_log_probs(x, w, labels, b, outputs=OUTPUTS, logit_scale=0.0)
    valid = labels >= 0
    log_v = math.log(301)
    torch.testing.assert_close(out.log_probs[valid], torch.full_like(out.log_probs[valid], -log_v))
    torch.testing.assert_close(out.entropy[valid], torch.full_like(out.entropy[valid], log_v))
    assert (out.predicted[valid] == 0).all() and torch.equal(out.is_top1, valid & (labels == 0))
    grads = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), (x, w, b))
    assert all((g == 0).all() for g in grads)


def test_kept_logits_are_spent_by_the_first_backward(schedule):
    """A second backward through the same graph (``retain_graph``) finds the kept logits turned
    into the first one's gradient: it recomputes, and both are the reference's."""
    x, w, b, labels = make_inputs(40, 16, 97, torch.float32)
    out = linear_log_probs(x, w, labels, b, outputs=("log_probs", "entropy"), temperature=0.8)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        g_lp, g_ent = (torch.randn(labels.shape, generator=gen).to(DEVICE) for _ in range(2))
        total = (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()
        got = torch.autograd.grad(total, (x, w, b), retain_graph=True)
        ref = linear_log_probs_reference(x, w, labels, b, temperature=0.8)
        want = weighted_grads(ref, (x, w, b), g_lp, g_ent)
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)
    assert schedule["lce_bwd_kept"] == 1 and schedule["lce_bwd_recompute"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_are_kept_where_the_eager_plan_takes_one_chunk(dtype, schedule, monkeypatch):
    """The kept schedule holds what the eager schedule's plan would take in one chunk (the
    logits up to twice the budget, with the fp32 weight gradient that several chunks would
    need counted in); beyond it the backward recomputes, and both give the reference's."""
    ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    monkeypatch.setattr(ops, "MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(ops, "_ALIGN", 8)
    n, d, v = 64, 8, 300
    x, w, b, labels = make_inputs(n, d, v, dtype)
    logits = n * v * x.element_size()
    accumulator = v * d * 4 if dtype == torch.bfloat16 else 0
    largest = (logits - 2 * accumulator + 1) // 2  # the least budget that holds them
    gen = torch.Generator().manual_seed(5)
    g_lp = torch.randn(labels.shape, generator=gen).to(DEVICE)
    ref = linear_log_probs_reference(x, w, labels, b, dtype=torch.float64)
    want = torch.autograd.grad((ref.log_probs * g_lp.double()).sum(), (x, w, b))
    eager = eager_reference(x, w, b, labels)
    eager_g = torch.autograd.grad((eager.log_probs * g_lp).sum(), (x, w, b))
    for budget, kept in ((largest, True), (largest - 1, False)):
        schedule.update(dict.fromkeys(schedule, 0))
        out = linear_log_probs(x, w, labels, b, chunk_bytes=budget)
        got = torch.autograd.grad((out.log_probs * g_lp).sum(), (x, w, b))
        assert schedule["lce_bwd_kept" if kept else "lce_bwd_recompute"] == 1, (budget, schedule)
        for name, a, r, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got, want, eager_g):
            assert_close_budget(a.double(), r, e.double(), dtype, name)


def test_one_call_keeps_its_logits_at_a_time(schedule):
    """Several forwards before one backward (a pipeline schedule's micro-batches, losses summed):
    only the first keeps its logits, the others recompute, and once the first backward has run
    the next forward keeps again; every gradient is the reference's."""
    x, w, b, labels = make_inputs(40, 16, 97, torch.float32)
    gen = torch.Generator().manual_seed(6)
    g = [torch.randn(labels.shape, generator=gen).to(DEVICE) for _ in range(3)]
    outs = [linear_log_probs(x, w, labels, b).log_probs for _ in range(3)]
    got = torch.autograd.grad(sum((o * gi).sum() for o, gi in zip(outs, g)), (x, w, b))
    assert schedule["lce_bwd_kept"] == 1 and schedule["lce_bwd_recompute"] == 2
    ref = linear_log_probs_reference(x, w, labels, b).log_probs
    want = torch.autograd.grad(sum((ref * gi).sum() for gi in g), (x, w, b))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)
    out = linear_log_probs(x, w, labels, b).log_probs  # the first graph's outputs still alive
    torch.autograd.grad(out.sum(), (x, w, b))
    assert schedule["lce_bwd_kept"] == 2


def test_two_threads_do_not_both_keep(schedule, monkeypatch):
    """The slot is taken under a lock: of two threads whose forwards overlap on one device, one
    keeps its logits and the other recomputes."""
    import threading

    ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    x, w, b, labels = make_inputs(40, 16, 97, torch.float32)
    arrived, plan, seen = threading.Barrier(2), ops.plan_token_chunk, threading.local()

    def plan_together(*args):  # both threads decide to keep, then both reach for the slot
        if not getattr(seen, "once", False):
            seen.once = True
            arrived.wait(timeout=10)
        return plan(*args)

    monkeypatch.setattr(ops, "plan_token_chunk", plan_together)
    one_at_a_time, sweep = threading.Lock(), ops.cross_entropy_fwd

    def sweep_alone(*args, **kwargs):  # Triton's CPU interpreter runs one kernel at a time
        with one_at_a_time:
            return sweep(*args, **kwargs)

    monkeypatch.setattr(ops, "cross_entropy_fwd", sweep_alone)
    outs = [None, None]

    def forward(i):
        outs[i] = linear_log_probs(x, w, labels, b).log_probs

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.autograd.grad(sum(o.sum() for o in outs), (x, w, b))
    assert schedule["lce_bwd_kept"] == 1 and schedule["lce_bwd_recompute"] == 1, schedule


@pytest.mark.parametrize("live", [0.9, 0.5], ids=["most-rows", "half-the-rows"])
def test_skip_ignored_recomputes_where_few_rows_have_a_gradient(live, schedule):
    """``skip_ignored``: rows with a target whose upstream gradient is 0 (GRPO's groups of equal
    rewards) take no part in the recompute schedule's products; the kept logits' two products
    over every row cost no more than its three over the others while at least two thirds have a
    gradient, and recomputing is taken below that. Both give the plain path's gradients."""
    x, w, b, labels = make_inputs(60, 16, 97, torch.float32)
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(labels.shape, generator=gen).to(DEVICE)
    g[torch.rand(labels.shape, generator=gen).to(DEVICE) >= live] = 0.0
    out = linear_log_probs(x, w, labels, b, outputs=("log_probs", "entropy"), skip_ignored=True)
    got = torch.autograd.grad((out.log_probs * g).sum(), (x, w, b))
    kept = live > 2 / 3
    assert schedule["lce_bwd_kept" if kept else "lce_bwd_recompute"] == 1, schedule
    ref = linear_log_probs_reference(x, w, labels, b).log_probs
    want = torch.autograd.grad((ref * g).sum(), (x, w, b))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fn", ["log_probs", "log_probs-hint", "loss-none"])
def test_meta_tensors_trace_forward_and_backward(fn):
    """On meta tensors (shape-only tracing, memory estimators) the head runs forward and
    backward: the kept schedule, whose logits' rows are the batch's, is declined there, and an
    ``UpstreamHint`` learns nothing (there is nothing to read)."""
    x = torch.empty(48, 16, device="meta", requires_grad=True)
    w = torch.empty(97, 16, device="meta", requires_grad=True)
    labels = torch.zeros(48, dtype=torch.long, device="meta")
    if fn.startswith("log_probs"):
        hint = UpstreamHint() if fn.endswith("hint") else None
        out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy"),
                               upstream=hint).log_probs  # fmt: skip
    else:
        out = linear_cross_entropy(x, w, labels, reduction="none").loss
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    assert gx.shape == x.shape and gw.shape == w.shape and gx.is_meta


def test_log_probs_are_the_negated_per_token_loss_and_zero_where_ignored():
    x, w, b, labels = make_inputs(40, 16, 97, torch.float32)
    out = linear_log_probs(x, w, labels, b, shift=True)
    loss = linear_cross_entropy(x, w, labels, b, reduction="none", shift=True).loss
    torch.testing.assert_close(out.log_probs, -loss, rtol=0, atol=0)
    assert out.entropy is None and out.is_top1 is None
    shifted_ignored = torch.cat([labels[1:], labels.new_full((1,), -100)]) == -100
    assert (out.log_probs[shifted_ignored] == 0).all()


LOSS_CASES = {
    "mean-z-smoothing": dict(reduction="mean", z_loss_scale=1e-2, label_smoothing=0.1),
    "sequence-shift": dict(reduction="sequence", shift=True, z_loss_scale=1e-3),
    "sum-softcap": dict(reduction="sum", softcap=5.0, num_items_in_batch=None),
    "none-low-memory": dict(reduction="none", low_memory=True, z_loss_scale=1e-2),
}


@pytest.mark.parametrize("case", list(LOSS_CASES), ids=list(LOSS_CASES))
def test_loss_with_statistics_is_the_loss_and_statistics_of_the_same_logits(case):
    """``linear_cross_entropy_statistics``: the loss, z-loss and every gradient are
    ``linear_cross_entropy``'s exactly; the statistics are those of the log-probabilities'
    distribution against fp64 (0 where no target, detached), in one sweep."""
    kw = dict(LOSS_CASES[case])
    x, w, b, labels = make_inputs(53, 24, 301, torch.float32, shift=kw.get("shift", False))
    position_ids = torch.cat([torch.arange(20), torch.arange(33)]).to(DEVICE)
    if kw["reduction"] == "sequence":
        kw["position_ids"] = position_ids
    (loss, z), stats = linear_cross_entropy_statistics(
        x,
        w,
        labels,
        b,
        statistics=("entropy", "is_top1", "mean_logits", "predicted"),
        chunk_bytes=4096,
        **kw,
    )
    want = linear_cross_entropy(x, w, labels, b, chunk_bytes=4096, **kw)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=0)
    torch.testing.assert_close(z, want.z_loss, rtol=0, atol=0)
    g = torch.randn_like(loss)
    got_g = torch.autograd.grad((loss * g).sum(), (x, w, b))
    want_g = torch.autograd.grad((want.loss * g).sum(), (x, w, b))
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    targets = labels
    if kw.get("shift"):  # the next label of the same document (position 20 starts the second)
        targets = torch.cat([labels[1:], labels.new_full((1,), -100)])
        targets[19] = -100
    ref = linear_log_probs_reference(
        x, w, targets, b, dtype=torch.float64, softcap=kw.get("softcap")
    )
    assert set(stats) == {"entropy", "is_top1", "mean_logits", "predicted"}
    for name in ("entropy", "mean_logits"):
        assert stats[name].shape == labels.shape and not stats[name].requires_grad
        torch.testing.assert_close(stats[name].double(), getattr(ref, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(stats["is_top1"], ref.is_top1)
    assert stats["is_top1"].any()
    assert stats["predicted"].dtype == torch.int64
    assert torch.equal(stats["predicted"], ref.predicted)
    assert (stats["predicted"] == -1).any() and (stats["predicted"] >= 0).any()


def test_loss_with_statistics_rejects_unknown_names():
    x, w, _, labels = make_inputs(8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="unknown statistics"):
        linear_cross_entropy_statistics(x, w, labels, statistics=("log_probs",))


def test_is_top1_and_predicted_take_the_first_maximum_as_argmax_does():
    """Two vocabulary rows equal: their logits tie exactly. The earlier column is the argmax:
    the predicted token, and the top-1 only where it is the target."""
    x = torch.randn(6, 8, device=DEVICE)
    w = torch.randn(20, 8, device=DEVICE) * 0.1
    w[[5, 11]] = x.new_tensor([10.0] * 8)  # columns 5 and 11 tie at the maximum for x > 0
    x = x.abs()
    labels = torch.tensor([5, 11, 5, 11, 3, -100], device=DEVICE)
    out = linear_log_probs(x, w, labels, outputs=("is_top1", "predicted"))
    assert out.is_top1.tolist() == [True, False, True, False, False, False]
    assert out.predicted.tolist() == [5, 5, 5, 5, 5, -1]


def test_predicted_is_the_first_maximum_across_the_kernels_vocabulary_blocks():
    """The same tie with the tied columns in different blocks of the row kernel's sweep (4096
    columns a block): the earlier block's column stays the prediction."""
    x = torch.rand(4, 8, device=DEVICE) + 0.1
    w = torch.randn(5000, 8, device=DEVICE) * 0.1
    w[[7, 4500]] = x.new_tensor([10.0] * 8)
    labels = torch.tensor([7, 4500, 3, -100], device=DEVICE)
    out = linear_log_probs(x, w, labels, outputs=("is_top1", "predicted"))
    assert out.predicted.tolist() == [7, 7, 7, -1]
    assert out.is_top1.tolist() == [True, False, False, False]


def test_entropy_alone_takes_its_gradient_and_statistics_have_none():
    x, w, b, labels = make_inputs(30, 16, 64, torch.float32)
    out = linear_log_probs(x, w, labels, b, outputs=OUTPUTS)
    ref = linear_log_probs_reference(x, w, labels, b, dtype=torch.float64)
    got = torch.autograd.grad(out.entropy.sum(), (x, w, b))
    want = torch.autograd.grad(ref.entropy.sum(), (x, w, b))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1", "predicted"):
        assert not getattr(out, name).requires_grad, name


def test_no_grad_and_statistics_off_launch_no_backward(monkeypatch):
    """Under no_grad only the forward sweep runs; with no statistic asked, the kernel gets no
    statistics buffer (the constexpr branches are off)."""
    import importlib

    lce = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    seen = []
    fwd = lce.cross_entropy_fwd

    def spy(*args, **kwargs):
        seen.append(kwargs["stats"])
        return fwd(*args, **kwargs)

    monkeypatch.setattr(lce, "cross_entropy_fwd", spy)
    monkeypatch.setattr(lce, "cross_entropy_bwd", None)  # any call fails
    x, w, b, labels = make_inputs(30, 16, 64, torch.float32)
    with torch.no_grad():
        out = linear_log_probs(x, w, labels, b)
    assert seen and all(s == {} for s in seen)
    assert not out.log_probs.requires_grad


def test_traces_with_fullgraph_compile():
    x, w, b, labels = make_inputs(24, 16, 64, torch.float32)

    def step(x, w, b):
        out = linear_log_probs(x, w, labels, b, outputs=OUTPUTS, temperature=0.9, shift=True)
        return out.log_probs.sum() + 0.1 * out.entropy.sum(), out.is_top1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    (loss_c, top1_c), (loss_e, top1_e) = compiled(x, w, b), step(x, w, b)
    torch.testing.assert_close(loss_c, loss_e)
    assert torch.equal(top1_c, top1_e)
    for a, r in zip(torch.autograd.grad(loss_c, (x, w, b)), torch.autograd.grad(loss_e, (x, w, b))):
        torch.testing.assert_close(a, r)


def test_errors_are_clear():
    x, w, _, labels = make_inputs(8, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="unknown outputs"):
        linear_log_probs(x, w, labels, outputs=("logprobs",))
    with pytest.raises(ValueError, match="temperature"):
        linear_log_probs(x, w, labels, temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        linear_log_probs(x, w, labels, softcap=-1.0)


def test_uniform_upstream_hint_takes_three_products_and_stays_exact(monkeypatch):
    """A token mean (SFT): the first step learns that the upstream gradient is uniform, the next
    ones compute the gradients in the forward (no recomputation); a step whose upstream is not
    uniform (an RL advantage) recomputes. Every step's gradients equal the plain path's."""
    import importlib

    lce = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    recomputed = []
    bwd = lce.cross_entropy_bwd

    def spy(*args, **kwargs):
        recomputed.append(1)
        return bwd(*args, **kwargs)

    monkeypatch.setattr(lce, "cross_entropy_bwd", spy)
    x, w, b, labels = make_inputs(40, 16, 97, torch.float32)
    hint = UpstreamHint()
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(labels.shape, generator=gen).to(DEVICE)
    steps = [("mean", True), ("mean", False), ("mean", False), ("advantage", True),
             ("mean", True), ("mean", False)]  # fmt: skip
    for upstream, recomputes in steps:
        recomputed.clear()
        out = linear_log_probs(x, w, labels, b, outputs=OUTPUTS, upstream=hint, shift=True)
        plain = linear_log_probs(x, w, labels, b, outputs=OUTPUTS, shift=True)
        weights = -1.0 / 37 if upstream == "mean" else advantages
        got = torch.autograd.grad((out.log_probs * weights).sum(), (x, w, b))
        n_plain = len(recomputed)
        want = torch.autograd.grad((plain.log_probs * weights).sum(), (x, w, b))
        assert (n_plain > 0) == recomputes, (upstream, hint)
        assert len(recomputed) > n_plain  # the plain path always recomputes
        assert hint.uniform == (upstream == "mean")
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hint_guesses_a_token_mean_and_a_constant_divisor(dtype, monkeypatch):
    """The gradients made in the forward are for the hint's guess of the upstream gradient, so
    that the backward's scaling (a pass over the weight gradient) is a no-op on the device: a
    token mean over batches of different masks (TRL's SFT loss, ``sum / label_mask.sum()``) and a
    constant divisor are guessed exactly (the factor handed to the scaling is exactly 1); a
    changed divisor, or a batch without targets, is scaled. Every step's gradients equal the
    plain path's (to bf16's rounding in bf16, which has fp32's exponent range: guessed too)."""
    import importlib

    api = importlib.import_module("surgery.kernels.linear_cross_entropy.api")
    factors = []
    scale = api.scale_by_upstream_

    def spy(t, g):
        factors.append(float(g))
        return scale(t, g)

    monkeypatch.setattr(api, "scale_by_upstream_", spy)
    x, w, b, labels = make_inputs(40, 16, 97, dtype)
    gen = torch.Generator().manual_seed(3)
    hint = UpstreamHint()
    # (divisor of the summed loss: "mean" = the batch's tokens with a target; whether the
    # guess holds, None where nothing is scaled: the first step recomputes)
    steps = [("mean", None), ("mean", True), ("mean", True), (7.0, False), (7.0, True),
             ("mean", False), ("mean", True), ("none", False), ("mean", False),
             ("mean", True)]  # fmt: skip
    for divisor, guessed in steps:
        lab = labels.clone()
        lab[torch.rand(lab.shape, generator=gen).to(DEVICE) < 0.3] = -100  # a new mask each step
        if divisor == "none":
            lab[:] = -100
        out = linear_log_probs(x, w, lab, b, upstream=hint)
        plain = linear_log_probs(x, w, lab, b)
        d = divisor if isinstance(divisor, float) else (lab >= 0).sum().clamp(min=1)
        factors.clear()
        got = torch.autograd.grad(-out.log_probs.sum() / d, (x, w, b))
        want = torch.autograd.grad(-plain.log_probs.sum() / d, (x, w, b))
        if guessed is None:
            assert factors == []
        else:
            assert len(factors) == 3 and all((f == 1.0) == guessed for f in factors), (
                divisor,
                factors,
            )
        for a, r in zip(got, want):
            if dtype == torch.float32:
                torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)
            else:  # the two round different fp32 values to bf16 (the guess's is the scaled one)
                top = r.float().abs().max().item()
                torch.testing.assert_close(a.float(), r.float(), rtol=1e-2, atol=1e-2 * top)


@pytest.mark.parametrize(
    ("dtype", "first", "second"),
    [
        (torch.float32, 1e-39, 1.0),  # too small a guess: dividing by it would overflow
        (torch.float32, 4.0, 1.0),  # larger than 1: the forward's gradients would grow
        (torch.float16, 6e4, 1.0),  # fp16 with a loss scale: they would overflow
        (torch.float16, 2e4, 1e4),
        (torch.float16, 1e-4, 1e-4),  # fp16 token mean: they would round to zero
        # a guess taken (2**-63), then a gradient it cannot scale to: the factor overflows
        (torch.float32, 2.0**-63, 2.0**70),
    ],
)
def test_hint_takes_no_guess_that_could_overflow_or_vanish(dtype, first, second):
    """A guess is taken only between 2**-64 and 1 and for inputs with fp32's exponent range: after
    any other upstream gradient the next step's gradients are those of the unit guess (the plain
    path's, to the dtype's rounding), finite where the plain path's are."""
    x, w, _, labels = make_inputs(64, 16, 97, dtype, bias=False)
    hint = UpstreamHint()
    out = linear_log_probs(x, w, labels, upstream=hint)
    torch.autograd.grad(out.log_probs.sum() * first, (x, w))
    assert hint.uniform
    out = linear_log_probs(x, w, labels, upstream=hint)
    got = torch.autograd.grad(out.log_probs.sum() * second, (x, w))
    plain = linear_log_probs(x, w, labels)
    want = torch.autograd.grad(plain.log_probs.sum() * second, (x, w))
    for a, r in zip(got, want):
        assert torch.isfinite(r).all()
        scale = r.float().abs().max().item()
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-3, atol=2e-3 * scale)


def _trl_chunked_log_probs():
    """TRL's own fused head function (its CUDA path), the peer on the GPU."""
    chunked = pytest.importorskip("trl.kernels.chunked_logprob")
    return chunked.ChunkedLogProbFunction


BESIDE_TRL = {  # softcap, temperature, logit scale
    "plain": (None, 1.0, 1.0),
    "softcap": (30.0, 1.0, 1.0),
    "plain-hot": (None, 0.7, 1.0),  # GRPO's temperature
    "softcap-hot": (30.0, 0.7, 1.0),  # cap / T 42.9: the fused products' shifted reference
    "softcap-scaled": (20.0, 0.8, 1.3),
}


@pytest.mark.gpu
@pytest.mark.parametrize("low_memory", [False, True], ids=["kept", "recompute"])
@pytest.mark.parametrize("case", list(BESIDE_TRL), ids=list(BESIDE_TRL))
def test_gpu_bf16_against_fp32_beside_trl(case, low_memory, monkeypatch):
    """bf16 at a real vocabulary: every output and gradient within the error of TRL's own head
    (both against an fp32 reference on the full logits), for an RL-like upstream gradient on the
    log-probabilities and the entropy, with a softcap, a temperature and a logit scale; ours with
    the logits kept from the forward (cuBLAS's bf16 logits, as TRL's: under a hint that has seen
    the entropy trained, as a softcapped head would otherwise keep its fused product's Q and
    recompute for the entropy's gradient, ``test_kept_products``), or recomputed through the
    fused products (the recompute schedule's two)."""
    ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    calls = []
    for name in ("lse_products", "grad_products"):
        fn = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    softcap, temperature, scale = BESIDE_TRL[case]
    opts = dict(softcap=softcap, temperature=temperature, logit_scale=scale)
    trl_head = _trl_chunked_log_probs()
    n, d, v = 1024, 1024, 32000
    x, w, _, labels = make_inputs(n, d, v, torch.bfloat16, bias=False)
    outputs = ("log_probs", "entropy", "is_top1")
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = (torch.randn(n, generator=gen).cuda() for _ in range(2))

    def run(fn):  # fn returns (log_probs, entropy, is_top1)
        lp, ent, top1 = fn()
        got = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (x, w))
        return [t.detach().float() for t in (lp, ent, *got)], top1

    hint = UpstreamHint()
    hint.entropy_grad = True

    def ours_fn():
        out = linear_log_probs(x, w, labels, outputs=outputs, low_memory=low_memory,
                               upstream=hint, **opts)  # fmt: skip
        return out.log_probs, out.entropy, out.is_top1

    ours, top1 = run(ours_fn)
    assert set(calls) == ({"lse_products", "grad_products"} if low_memory else set()), calls
    valid = labels >= 0
    safe = labels.clamp(min=0)

    def trl_fn():
        lp, ent, _, _, top = trl_head.apply(x[valid], w, None, safe[valid], temperature, 32768,
                                            softcap, scale, outputs)  # fmt: skip
        full = [torch.zeros(n, device="cuda", dtype=t.dtype).masked_scatter(valid, t)
                for t in (lp, ent, top)]  # fmt: skip
        return full[0], full[1], full[2]

    theirs, trl_top1 = run(trl_fn)
    ref = linear_log_probs_reference(x, w, labels, **opts)
    ref_g = torch.autograd.grad((ref.log_probs * g_lp).sum() + (ref.entropy * g_ent).sum(), (x, w))
    want = [t.detach() for t in (ref.log_probs, ref.entropy, *ref_g)]
    for name, a, t, r in zip(("log_probs", "entropy", "dx", "dw"), ours, theirs, want):
        err, err_trl = (float((u - r.float()).norm() / r.float().norm()) for u in (a, t))
        assert err <= 1.25 * err_trl + 1e-6, f"{name}: {err:.3e} vs TRL's {err_trl:.3e}"
    agree = (top1 == ref.is_top1).float().mean().item()
    agree_trl = (trl_top1.bool() == ref.is_top1).float().mean().item()
    assert agree >= agree_trl - 1e-3, (agree, agree_trl)


OVERLAP_CASES = {  # linear_log_probs' options; bias: unfused (cuBLAS) with the bias gradient
    "plain": dict(),
    # the fused products' eager schedule: speculated only where the entropy is trained too (an
    # entropy bonus; 0 here), else a softcapped head keeps its product's Q (test_kept_products)
    "softcap": dict(softcap=30.0, entropy_trained=True),
    "skip_ignored-bias": dict(bias=True, skip_ignored=True),
    "chunks": dict(chunk_bytes=8 << 20),  # several chunks: one stream (each chunk's logits held)
    # the weight's memory freed after the forward and gathered again for the backward, as FSDP2's
    # reshard and ZeRO-3's release do whatever references are held
    "managed-weight": dict(managed=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(OVERLAP_CASES), ids=list(OVERLAP_CASES))
def test_gpu_hint_gradients_on_the_side_stream(case, monkeypatch):
    """Speculating (an ``UpstreamHint`` taught a uniform upstream gradient), the forward's
    gradient products run on a side stream, and the backward waits for them on the device after
    the hint's host read: over steps with a uniform upstream gradient, then one that is not (the
    speculated gradients dropped, recomputed), then uniform again (speculated again where the
    logits, not their unit gradient, were kept after the ragged step), every gradient is
    bit-equal to the same steps on one stream. The side stream is held back (a sleep before its
    work) and the memory freed by the forward is handed out and written between forward and
    backward, so that a read before the wait, or the side stream's tensors freed before it,
    would show; in
    ``managed-weight`` the weight's own memory is freed, written and gathered anew in between."""
    ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    kw = dict(OVERLAP_CASES[case])
    managed = kw.pop("managed", False)
    entropy = kw.pop("entropy_trained", False)
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    d = 512 if "chunk_bytes" in kw else 2048  # narrow rows: several chunks (the eager plan's rule)
    x, w, b, labels = make_inputs(4096, d, 64000, torch.bfloat16, bias=kw.pop("bias", False))
    inputs = [t for t in (x, w, b) if t is not None]
    gen = torch.Generator().manual_seed(2)
    n = (labels >= 0).sum()
    ragged = torch.randn(labels.shape, generator=gen).to(DEVICE)
    steps = [-1.0 / n, -1.0 / n, -1.0 / n, ragged, -1.0 / n, -1.0 / n]
    used, on_stream = [], ops._on_gradient_stream
    kept = w.detach().clone()

    @contextlib.contextmanager
    def late(stream, *tensors):
        used.append(stream is not None)
        with on_stream(stream, *tensors):
            if stream is not None:
                torch.cuda._sleep(20_000_000)  # some 10 ms of the side stream before its work
            yield

    def train():
        hint, out, sides = UpstreamHint(), [], []
        for g in steps:
            used.clear()
            res = linear_log_probs(x, w, labels, b, upstream=hint, outputs=outputs, **kw)
            loss = (res.log_probs * g).sum() + (res.entropy.sum() * 0 if entropy else 0)
            sides.append(any(used))
            if managed:  # storage freed whatever references hold it, then gathered again
                storage = w.untyped_storage()
                size = storage.nbytes()
                storage.resize_(0)
                freed = torch.full_like(kept, 3.0)  # the weight's memory handed out, written
                storage.resize_(size)
                w.data.copy_(kept)  # .data: autograd's saved w sees no in-place write
                del freed
            junk = [torch.full_like(t, 3.0) for t in (w, w, x)]  # freed memory handed out again
            out.append([t.clone() for t in torch.autograd.grad(loss, inputs)])
            del junk
        return out, sides

    monkeypatch.setattr(ops, "_on_gradient_stream", late)
    got, sides = train()
    # the first step and the one after the ragged step do not speculate; several chunks never
    # leave the current stream; a head that keeps the unit gradient (no bias, no entropy's
    # gradient) learns nothing more after the ragged step, and keeps it from then on
    unit = not (b is not None or entropy or "chunk_bytes" in kw)
    assert sides == ([False] * 6 if "chunk_bytes" in kw else
                     [False, True, True, True, False, not unit])  # fmt: skip
    monkeypatch.setattr(ops, "_on_gradient_stream", lambda stream, *t: on_stream(None))
    want, _ = train()
    for i, (a, r) in enumerate(zip(got, want)):
        assert all(torch.equal(u, v) for u, v in zip(a, r)), f"step {i}"


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graphs():
    """The default path (no ``upstream`` hint, no ``skip_ignored``) reads nothing on the host:
    it runs under CUDA's sync debug mode "error" and is captured and replayed in a CUDA graph."""
    x, w, _, labels = make_inputs(512, 256, 32000, torch.bfloat16, bias=False)

    def step(x, w):
        out = linear_log_probs(x, w, labels, outputs=OUTPUTS, temperature=0.9)
        loss = (out.log_probs * 0.5).sum() + out.entropy.sum()
        return (loss.detach(), *torch.autograd.grad(loss, (x, w)))

    assert_no_sync_and_graph_replay(step, x, w, step(x, w))


@pytest.mark.gpu
def test_gpu_hint_taught_on_one_device_serves_another():
    """A hint shared by calls on two devices (``nn.DataParallel``'s replicas share the model's TRL
    request): the guess learned on the GPU is taken to the next call's device."""
    hint = UpstreamHint()
    for device in ("cuda", "cpu", "cuda"):
        x, w, _, labels = make_inputs(32, 16, 97, torch.float32, bias=False)
        x, w = (t.detach().to(device).requires_grad_() for t in (x, w))
        labels = labels.to(device)
        out = linear_log_probs(x, w, labels, upstream=hint)
        got = torch.autograd.grad(out.log_probs.sum() / 7.0, (x, w))
        want = torch.autograd.grad(linear_log_probs(x, w, labels).log_probs.sum() / 7.0, (x, w))
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)
    assert hint.uniform and not hint.token_mean


def test_hint_unlearns_when_no_gradient_reaches_the_log_probabilities():
    """An entropy bonus alone reaching the head: nothing for gradients made in the forward to be
    scaled by, so the next forward makes none."""
    x, w, b, labels = make_inputs(20, 8, 40, torch.float32)
    hint = UpstreamHint()
    hint.uniform = True
    out = linear_log_probs(x, w, labels, b, outputs=("entropy",), upstream=hint)
    out.entropy.sum().backward()
    assert hint.uniform is False
