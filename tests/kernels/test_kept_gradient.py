"""The kept schedule's unit gradient: a head the fused products do not take (no softcap, fp32, a
cap past their bound) keeps, in place of its logits, their gradient for a coefficient of 1 on
every row with a target, written by the forward's row sweep (``ops.lce_fwd``); the backward
scales its rows by the upstream coefficients inside its two products. Against fp64 within the
dtype's budget for any upstream gradient per token, with no pass over the logits in the
backward, no host read under an ``UpstreamHint`` that has seen a non-uniform one, and where it
must step aside (a bias, a z-loss, an entropy's gradient) the kept logits as before."""

from __future__ import annotations

import importlib

import pytest
import torch

from surgery.kernels import UpstreamHint, linear_cross_entropy, linear_log_probs
from surgery.kernels.reference import (
    cross_entropy_reference,
    linear_cross_entropy_reference,
    linear_log_probs_reference,
)
from tests.kernels.test_log_probs import eager_reference, make_inputs
from tests.utils import DEVICE, assert_close_budget, assert_no_sync_and_graph_replay

OPS = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
API = importlib.import_module("surgery.kernels.linear_cross_entropy.api")


@pytest.fixture
def backward(monkeypatch):
    """What each backward took: ``kept`` the kind of each kept backward ("unit" or "Q" by its
    terms, "logits" for a sweep over logits, the recompute's too), ``recompute`` the recompute
    schedule's calls, ``learn`` the hint's host reads, ``fused_lse`` what each recompute was told
    of the forward's lse."""
    seen = {"kept": [], "recompute": 0, "learn": 0, "fused_lse": []}
    q_backward, sweep = OPS._kept_q_backward, OPS._gradient_in_place

    def kept_q(x, w, targets, lse, coef, q, q_rows, *args):
        seen["kept"].append("unit" if q_rows.shape[0] == 1 else "Q")
        return q_backward(x, w, targets, lse, coef, q, q_rows, *args)

    def in_place(*args, **kwargs):
        seen["kept"].append("logits")
        return sweep(*args, **kwargs)

    def counted(name, fn):
        def run(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(OPS, "_kept_q_backward", kept_q)
    monkeypatch.setattr(OPS, "_gradient_in_place", in_place)
    recompute = counted("recompute", API.lce_bwd_recompute)

    def recompute_seen(*args, **kwargs):
        seen["fused_lse"].append(kwargs.get("fused_lse"))
        return recompute(*args, **kwargs)

    monkeypatch.setattr(API, "lce_bwd_recompute", recompute_seen)
    monkeypatch.setattr(UpstreamHint, "learn", counted("learn", UpstreamHint.learn))
    return seen


def _upstream(labels, seed):
    return torch.randn(labels.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# linear_log_probs' options; softcap: in fp32 (bf16 would take the fused products' Q)
LOG_PROBS = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "scale-softcap": dict(logit_scale=-1.3, softcap=5.0),
    "skip_ignored": dict(skip_ignored=True, temperature=1.2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(LOG_PROBS), ids=list(LOG_PROBS))
def test_unit_gradient_against_fp64(case, dtype, backward):
    """A random upstream gradient per token on the log-probabilities (an RL objective) under a
    hint, the statistics TRL asks for beside them: the forward keeps the unit gradient, the
    backward makes both gradients from it by row scales (no pass over the logits, no
    recompute); every output and gradient within the dtype's budget of fp64's."""
    kw = LOG_PROBS[case]
    if dtype == torch.bfloat16 and "softcap" in kw:
        pytest.skip("a softcapped bf16 head keeps the fused products' Q (test_kept_products)")
    ref_kw = {k: v for k, v in kw.items() if k != "skip_ignored"}
    x, w, _, labels = make_inputs(53, 24, 301, dtype, seed=3, bias=False)
    hint = UpstreamHint()  # as an RL loop's after its first step: the entropy is not trained
    hint.uniform = False
    out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy", "is_top1"),
                           upstream=hint, **kw)  # fmt: skip
    g_lp = _upstream(labels, 4)
    got = torch.autograd.grad((out.log_probs * g_lp).sum(), (x, w))
    assert backward["kept"] == ["unit"] and not backward["recompute"] and not backward["learn"]
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, **ref_kw)
    eager = eager_reference(x, w, None, labels, **ref_kw)
    for name in ("log_probs", "entropy"):
        assert_close_budget(getattr(out, name).double(), getattr(ref, name),
                            getattr(eager, name).double(), dtype, name)  # fmt: skip
    assert torch.equal(out.is_top1, eager.is_top1)
    want = torch.autograd.grad((ref.log_probs * g_lp.double()).sum(), (x, w))
    base = torch.autograd.grad((eager.log_probs * g_lp).sum(), (x, w))
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, want, base, strict=True):
        assert a.dtype == dtype
        assert_close_budget(a.double(), r, e.double(), dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_token_loss_with_label_smoothing(dtype, backward):
    """``linear_cross_entropy(reduction="none")`` with label smoothing (linear in the row's
    coefficient: inside the unit gradient) and a gradient on the z-loss output too (0 without a
    z-loss): the unit gradient serves, within the dtype's budget of fp32's."""
    x, w, _, labels = make_inputs(53, 24, 301, dtype, seed=5, bias=False)
    kw = dict(reduction="none", label_smoothing=0.1)
    out = linear_cross_entropy(x, w, labels, **kw)
    ref = linear_cross_entropy_reference(x, w, labels, **kw)
    eager = cross_entropy_reference(x @ w.t(), labels, **kw)
    g, g_z = _upstream(labels, 6), _upstream(labels, 7)
    got, want, base = (
        torch.autograd.grad((r.loss * g).sum() + (r.z_loss * g_z).sum(), (x, w))
        for r in (out, ref, eager)
    )  # fmt: skip
    assert backward["kept"] == ["unit"] and not backward["recompute"]
    assert_close_budget(out.loss, ref.loss, eager.loss, dtype, "loss")
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, want, base, strict=True):
        assert_close_budget(a, r, e, dtype, name)


def test_rows_without_a_target_take_no_part_whatever_their_upstream(backward):
    """A row without a target has a unit gradient of 0; its coefficient (here inf or NaN, as a
    masked advantage may be) scales nothing: the gradients are those of the upstream with those
    rows' entries 0."""
    x, w, _, labels = make_inputs(40, 16, 97, torch.float32, seed=8, bias=False)
    ignored = labels == -100
    g = _upstream(labels, 9)
    g_bad = g.masked_fill(ignored, float("inf"))
    g_bad[ignored.nonzero()[0]] = float("nan")
    out = linear_log_probs(x, w, labels)
    got = torch.autograd.grad((out.log_probs * g_bad).sum(), (x, w))
    assert backward["kept"] == ["unit"]
    ref = linear_log_probs_reference(x, w, labels)
    want = torch.autograd.grad((ref.log_probs * g.masked_fill(ignored, 0.0)).sum(), (x, w))
    for a, r in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


# what keeps the logits instead: a bias, a z-loss (its coefficient is its own), an entropy output
# without a hint (its gradient has no room in the unit gradient), fp16 (X's rows scaled by a loss
# scaler's upstream gradient overflow its range where the weight gradient does not)
LOGITS_CASES = {
    "bias": (dict(bias=True), dict()),
    "zloss": (dict(bias=False), dict(z_loss_scale=1e-2)),
    "entropy": (dict(bias=False), dict(outputs=("log_probs", "entropy"))),
    "fp16": (dict(bias=False, dtype=torch.float16), dict()),
}


@pytest.mark.parametrize("case", list(LOGITS_CASES), ids=list(LOGITS_CASES))
def test_what_keeps_the_logits_instead(case, backward):
    """Where the unit gradient cannot serve every gradient the backward may be asked for, the
    logits are kept (their backward sweeps them), and the gradients, an entropy's among them,
    are the reference's."""
    make_kw, kw = dict(LOGITS_CASES[case][0]), LOGITS_CASES[case][1]
    dtype = make_kw.pop("dtype", torch.float32)
    x, w, b, labels = make_inputs(40, 16, 97, dtype, seed=10, **make_kw)
    inputs = tuple(t for t in (x, w, b) if t is not None)
    g, g_e = _upstream(labels, 11), _upstream(labels, 12)
    if case == "zloss":
        out = linear_cross_entropy(x, w, labels, reduction="none", **kw)
        ref = linear_cross_entropy_reference(x, w, labels, reduction="none", **kw)
        got, want = (torch.autograd.grad((r.loss * g).sum() + (r.z_loss * g_e).sum(), inputs)
                     for r in (out, ref))  # fmt: skip
    else:
        out = linear_log_probs(x, w, labels, b, **kw)
        ref = linear_log_probs_reference(x, w, labels, b)
        pick = "entropy" in kw.get("outputs", ())
        got, want = (torch.autograd.grad((r.log_probs * g).sum() + (
            (r.entropy * g_e).sum() if pick else 0), inputs) for r in (out, ref))  # fmt: skip
    assert backward["kept"] == ["logits"] and not backward["recompute"]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), r.float(), **tol)


@pytest.mark.parametrize("needs", ["hidden", "weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_gradient_and_a_second_backward(needs, dtype, backward):
    """A frozen head (the hidden states' gradient alone) or frozen hidden states (the weight's
    alone) take the unit gradient too; a second backward through the same graph finds it spent
    and recomputes, told the lse is the unfused logits'. Both within the dtype's budget of
    fp64's."""
    x, w, _, labels = make_inputs(53, 24, 301, dtype, seed=18, bias=False)
    leaf = x if needs == "hidden" else w
    (w if needs == "hidden" else x).requires_grad_(False)
    hint = UpstreamHint()
    hint.uniform = False
    out = linear_log_probs(x, w, labels, upstream=hint, temperature=0.8)
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, temperature=0.8)
    eager = eager_reference(x, w, None, labels, temperature=0.8)
    for step in range(2):
        g = _upstream(labels, 30 + step)
        (got,) = torch.autograd.grad((out.log_probs * g).sum(), leaf, retain_graph=True)
        (want,) = torch.autograd.grad((ref.log_probs * g.double()).sum(), leaf, retain_graph=True)
        (base,) = torch.autograd.grad((eager.log_probs * g).sum(), leaf, retain_graph=True)
        assert_close_budget(got.double(), want, base.double(), dtype, f"{needs} {step}")
    assert backward["kept"][:1] == ["unit"] and backward["fused_lse"] == [False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_entropy_gradient_the_hint_did_not_foresee_recomputes(dtype, backward):
    """An entropy bonus reaching a call whose hint had not seen one: the unit gradient has no
    room for it, the backward recomputes, told that the forward's log-sum-exp is the unfused
    logits' (the fused products would recompute other logits than those it came from), and the
    hint records it; the gradients are within the dtype's budget of fp64's."""
    x, w, _, labels = make_inputs(53, 24, 301, dtype, seed=15, bias=False)
    hint = UpstreamHint()
    hint.uniform = False
    out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy"), upstream=hint)
    g, g_e = _upstream(labels, 16), _upstream(labels, 17)
    got = torch.autograd.grad((out.log_probs * g).sum() + (out.entropy * g_e).sum(), (x, w))
    assert backward["recompute"] == 1 and backward["fused_lse"] == [False] and hint.entropy_grad
    assert "unit" not in backward["kept"]  # (the recompute's unfused sweeps are "logits")
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64)
    eager = eager_reference(x, w, None, labels)
    want, base = (torch.autograd.grad((r.log_probs * u(g)).sum() + (r.entropy * u(g_e)).sum(),
                                      (x, w))
                  for r, u in ((ref, torch.Tensor.double), (eager, lambda t: t)))  # fmt: skip
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, want, base, strict=True):
        assert_close_budget(a.double(), r, e.double(), dtype, name)


def test_hint_learns_once_then_reads_nothing_in_an_rl_loop(backward):
    """Under an ``UpstreamHint`` (TRL's integration passes one): the first backward learns that
    the upstream gradient is not uniform (one host read); every later step keeps the unit
    gradient and reads nothing, and each step's gradients are the plain path's. A token mean
    (SFT) still learns that it is uniform and speculates from the second step, as before."""
    x, w, _, labels = make_inputs(40, 16, 97, torch.float32, seed=13, bias=False)
    hint = UpstreamHint()
    for step in range(4):
        g = _upstream(labels, 20 + step)
        out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy"), upstream=hint)
        got = torch.autograd.grad((out.log_probs * g).sum(), (x, w))
        ref = linear_log_probs_reference(x, w, labels)
        want = torch.autograd.grad((ref.log_probs * g).sum(), (x, w))
        for a, r in zip(got, want, strict=True):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    assert backward["kept"] == ["unit"] * 4 and backward["learn"] == 1
    assert hint.uniform is False and not backward["recompute"]
    sft, backward["kept"] = UpstreamHint(), []
    for _ in range(3):
        out = linear_log_probs(x, w, labels, upstream=sft)
        torch.autograd.grad(out.log_probs.sum() / -37.0, (x, w))
    assert backward["kept"] == ["unit"] and sft.uniform  # then speculated: nothing kept


@pytest.mark.gpu
def test_gpu_unit_gradient_reads_nothing_and_replays_in_a_cuda_graph(backward):
    """An RL step under a hint that has seen a non-uniform upstream gradient, bf16 at a real
    vocabulary's width: no host read (CUDA's sync debug mode "error") and captured in a CUDA
    graph whose replay gives the eager step's results."""
    x, w, _, labels = make_inputs(512, 256, 32000, torch.bfloat16, bias=False)
    hint = UpstreamHint()
    hint.uniform = False
    g = _upstream(labels, 14)

    def step(x, w):
        out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy", "is_top1"),
                               temperature=0.9, upstream=hint)  # fmt: skip
        loss = (out.log_probs * g).sum()
        return (loss.detach(), *torch.autograd.grad(loss, (x, w)))

    assert_no_sync_and_graph_replay(step, x, w, step(x, w))
    assert set(backward["kept"]) == {"unit"} and not backward["learn"]
