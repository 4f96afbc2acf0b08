"""The kept schedule through the fused products: a softcapped bf16 head keeps its product's Q
(``softcap_products``) from the forward for a backward that learns the upstream gradient only
then (``ops.keeps_q``): three products and no pass over the logits, for any upstream gradient
on the log-probabilities, with no speculation or host read under an ``UpstreamHint``. Against
fp64 within bf16's budget, in the logit regimes where Q's numbers are smallest, and where it must
step aside (an entropy's gradient, a z-loss, a second backward, several chunks), right there
too."""

from __future__ import annotations

import importlib

import pytest
import torch

from surgery.kernels.log_probs import UpstreamHint, linear_log_probs
from surgery.kernels.reference import linear_log_probs_reference
from tests.kernels import test_fused_products as fused_tests
from tests.kernels.test_fused_products import ALL_STATISTICS, _regime
from tests.kernels.test_linear_cross_entropy import check_against_reference, make_inputs
from tests.kernels.test_log_probs import _trl_chunked_log_probs, eager_reference
from tests.utils import DEVICE, assert_close_budget

OPS = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
TERMS = importlib.import_module("surgery.kernels.linear_cross_entropy.terms")
fused_chunks = fused_tests.fused_chunks  # fixtures: the eager products' chunks, the recompute's
recompute_calls = fused_tests.recompute_calls


@pytest.fixture
def q_backwards(monkeypatch):
    """The rows of each backward that took a kept Q (``ops._kept_q_backward``)."""
    calls, fn = [], OPS._kept_q_backward

    def counted(x, *args):
        calls.append(x.shape[0])
        return fn(x, *args)

    monkeypatch.setattr(OPS, "_kept_q_backward", counted)
    return calls


def _assert_against_fp64(out, got, x, w, labels, g_lp, opts, names=("log_probs", "entropy")):
    """``out``'s fields ``names`` and the gradients ``got`` of sum(g_lp log_probs) within bf16's
    budget of fp64's (the budget: the error of the logits rounded to bf16, as eager PyTorch
    makes them)."""
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, **opts)
    base = eager_reference(x, w, None, labels, **opts)
    for name in names:
        assert_close_budget(getattr(out, name).double(), getattr(ref, name),
                            getattr(base, name).double(), torch.bfloat16, name)  # fmt: skip
    ref_g = torch.autograd.grad((ref.log_probs * g_lp.double()).sum(), (x, w))
    base_g = torch.autograd.grad((base.log_probs * g_lp).sum(), (x, w))
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, ref_g, base_g, strict=True):
        assert_close_budget(a.double(), r, e.double(), torch.bfloat16, name)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scale"])
def test_scaled_rows_against_fp32(gather, out_dtype):
    """``terms.scaled_rows``: diag(s) a (+ diag(t) b[idx]) in fp32, rounded once to nearest
    (even): exactly PyTorch's fp32 sum rounded, on the interpreter; within one bf16 step on a GPU
    (where a fused multiply-add rounds once less, so a sum by a midpoint may round the other
    way). Rows wider than a block and not a multiple of it, strided rows and row scales, a source
    row used twice."""
    gen = torch.Generator().manual_seed(15)
    a = torch.randn(37, 2600, generator=gen).to(DEVICE)[:, :2500]  # rows 2600 apart
    b = torch.randn(50, 2600, generator=gen).to(DEVICE, torch.bfloat16)[:, :2500]
    s, t = (torch.randn(74, generator=gen).to(DEVICE)[::2] for _ in range(2))  # stride 2
    idx = torch.randint(0, 50, (37,), generator=gen).to(DEVICE)
    idx[1] = idx[0]
    out = torch.empty(37, 2500, dtype=out_dtype, device=DEVICE)
    args = (t, b, idx) if gather else ()
    TERMS.scaled_rows(a, s, out, *args)
    want = a * s[:, None] + (t[:, None] * b[idx].float() if gather else 0)
    exact = not out.is_cuda
    torch.testing.assert_close(out, want.to(out_dtype), rtol=0 if exact else 2**-7,
                               atol=0 if exact else 1e-6)  # fmt: skip


# linear_log_probs' options: Gemma 2's head; at GRPO's temperature 0.7 (cap / T 42.9: the sums'
# shifted reference, products.cap_reference); a logit scale turning the logits' order over; the
# rows without a target left out of the products
KEPT = {
    "gemma": dict(softcap=30.0),
    "hot": dict(softcap=30.0, temperature=0.7),
    "scaled": dict(softcap=20.0, logit_scale=-1.3, temperature=0.8),
    "skip_ignored": dict(softcap=30.0, skip_ignored=True),
}


@pytest.mark.parametrize("regime", ["typical", "flat", "saturated"])
@pytest.mark.parametrize("case", list(KEPT), ids=list(KEPT))
def test_kept_q_against_fp64(case, regime, fused_chunks, recompute_calls, q_backwards):
    """A random upstream gradient per token on the log-probabilities (an RL objective): the
    forward keeps Q, the backward makes both gradients from it (no recompute), every output and
    gradient within bf16's budget of fp64's."""
    kw = dict(KEPT[case])
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, ignore_frac=0.3, seed=5)
    x, w = _regime(x, w, regime, kw["softcap"] / kw.get("logit_scale", 1.0))
    g_lp = torch.randn(labels.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    # a hint, as TRL's integration passes one: it has not seen the entropy trained
    out = linear_log_probs(x, w, labels, outputs=("log_probs", *ALL_STATISTICS),
                           upstream=UpstreamHint(), **kw)  # fmt: skip
    got = torch.autograd.grad((out.log_probs * g_lp).sum(), (x, w))
    rows = int((labels != -100).sum()) if kw.pop("skip_ignored", False) else 181
    assert fused_chunks == [rows] and q_backwards == [rows]
    assert not recompute_calls["lse"] and not recompute_calls["grad"]
    _assert_against_fp64(out, got, x, w, labels, g_lp, kw)


def test_entropy_gradient_recomputes_and_the_hint_keeps_logits_next(
    fused_chunks, recompute_calls, q_backwards
):
    """A gradient through the entropy (an entropy bonus) has no room in Q: the first call's
    backward recomputes through the fused products; the hint records it, and the next call keeps
    the logits instead (the unfused kept schedule). Both right."""
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, seed=7)
    gen = torch.Generator().manual_seed(8)
    g_lp, g_ent = (torch.randn(labels.shape, generator=gen).to(DEVICE) for _ in range(2))
    opts = dict(softcap=30.0, temperature=0.7)
    hint = UpstreamHint()
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, **opts)
    base = eager_reference(x, w, None, labels, **opts)
    total = (ref.log_probs * g_lp.double()).sum() + (ref.entropy * g_ent.double()).sum()
    ref_g = torch.autograd.grad(total, (x, w))
    base_g = torch.autograd.grad((base.log_probs * g_lp).sum() + (base.entropy * g_ent).sum(),
                                 (x, w))  # fmt: skip
    for step in range(2):
        out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy"), upstream=hint,
                               **opts)  # fmt: skip
        got = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                                  (x, w))  # fmt: skip
        if step == 0:
            assert fused_chunks == [181] and recompute_calls["grad"] and hint.entropy_grad
            recomputed = len(recompute_calls["grad"])
        for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, ref_g, base_g):
            assert_close_budget(a.double(), r, e.double(), torch.bfloat16, f"{name}-{step}")
    assert fused_chunks == [181] and len(recompute_calls["grad"]) == recomputed
    assert not q_backwards


@pytest.mark.parametrize("entropy", [False, True], ids=["log_probs", "entropy"])
def test_without_a_hint_the_entropy_keeps_the_logits(entropy, fused_chunks, q_backwards):
    """Without a hint to say whether the entropy is trained, a call that returns it keeps the
    logits (they serve its gradient too), one that does not keeps Q. Right either way, for an
    upstream gradient on the entropy as well where it is returned."""
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, seed=16)
    gen = torch.Generator().manual_seed(17)
    g_lp, g_ent = (torch.randn(labels.shape, generator=gen).to(DEVICE) for _ in range(2))
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    out = linear_log_probs(x, w, labels, outputs=outputs, softcap=30.0)
    total = (out.log_probs * g_lp).sum() + ((out.entropy * g_ent).sum() if entropy else 0)
    got = torch.autograd.grad(total, (x, w))
    assert fused_chunks == ([] if entropy else [181]) and q_backwards == fused_chunks
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, softcap=30.0)
    base = eager_reference(x, w, None, labels, softcap=30.0)
    extra = (lambda o, g: (o.entropy * g).sum()) if entropy else (lambda o, g: 0)
    ref_g = torch.autograd.grad((ref.log_probs * g_lp.double()).sum()
                                + extra(ref, g_ent.double()), (x, w))  # fmt: skip
    base_g = torch.autograd.grad((base.log_probs * g_lp).sum() + extra(base, g_ent), (x, w))
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, ref_g, base_g, strict=True):
        assert_close_budget(a.double(), r, e.double(), torch.bfloat16, name)


def test_held_slot_speculates(fused_chunks, recompute_calls, q_backwards):
    """Two forwards before their backwards (a pipeline's schedule) under one hint: the first
    keeps Q, the second finds the device's slot held; once the hint has learned the uniform
    upstream gradient it speculates (the eager products), rather than recomputing every step."""
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, seed=18)
    hint = UpstreamHint()
    g = -1.0 / int((labels != -100).sum())
    for step in range(3):
        outs = [linear_log_probs(x, w, labels, softcap=30.0, upstream=hint) for _ in range(2)]
        for out in outs:
            got = torch.autograd.grad((out.log_probs * g).sum(), (x, w))
            g_lp = torch.full(labels.shape, g, device=DEVICE)
            _assert_against_fp64(out, got, x, w, labels, g_lp, dict(softcap=30.0),
                                 names=("log_probs",))  # fmt: skip
        if step == 0:  # the second call recomputed, and taught the hint
            recomputed = len(recompute_calls["grad"])
            assert recomputed and hint.uniform
    assert q_backwards == [181] * 3 and len(recompute_calls["grad"]) == recomputed
    assert fused_chunks == [181] * 5  # Q; then Q and the speculated eager products, twice


def test_uniform_upstream_keeps_q_without_speculating(fused_chunks, q_backwards, monkeypatch):
    """SFT's token mean under an ``UpstreamHint`` (TRL's SFT): every step keeps Q and makes the
    gradients in its backward, with no guess, no side stream and no host read (the hint's
    ``learn`` never runs); right every step."""
    learned = []
    monkeypatch.setattr(UpstreamHint, "learn", lambda self, *a: learned.append(a))
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, seed=9)
    hint = UpstreamHint()
    g_lp = torch.full(labels.shape, -1.0 / int((labels != -100).sum()), device=DEVICE)
    for _ in range(3):
        out = linear_log_probs(x, w, labels, outputs=("log_probs", "entropy", "is_top1"),
                               softcap=30.0, upstream=hint)  # fmt: skip
        got = torch.autograd.grad((out.log_probs * g_lp).sum(), (x, w))
        _assert_against_fp64(out, got, x, w, labels, g_lp, dict(softcap=30.0))
    assert fused_chunks == [181] * 3 and q_backwards == [181] * 3 and not learned
    assert hint.uniform is None and not hint.entropy_grad


def test_second_backward_recomputes(fused_chunks, recompute_calls, q_backwards):
    """``retain_graph``: the first backward spends the kept Q, the second recomputes through the
    fused products; both right, and equal to each other within the products' rounding."""
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, seed=10)
    g_lp = torch.randn(labels.shape, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    out = linear_log_probs(x, w, labels, softcap=30.0, temperature=0.7)
    loss = (out.log_probs * g_lp).sum()
    first = torch.autograd.grad(loss, (x, w), retain_graph=True)
    assert q_backwards == [181] and not recompute_calls["grad"]
    second = torch.autograd.grad(loss, (x, w))
    assert q_backwards == [181] and recompute_calls["grad"]
    for got in (first, second):
        _assert_against_fp64(out, got, x, w, labels, g_lp, dict(softcap=30.0, temperature=0.7),
                             names=("log_probs",))  # fmt: skip
    for a, b in zip(first, second, strict=True):
        assert (a.double() - b.double()).norm() <= 2**-7 * b.double().norm()


@pytest.mark.parametrize("z_loss_scale", [0.0, 1e-3], ids=["q", "zloss-logits"])
def test_per_token_loss_keeps_q_without_a_zloss(z_loss_scale, fused_chunks, q_backwards):
    """``linear_cross_entropy(reduction="none")`` on a softcapped head keeps Q; with a z-loss
    (two coefficients per row, ``terms.target_terms`` takes one) it keeps the logits. Both right for
    random upstream gradients on the loss and the z-loss."""
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, seed=12)
    check_against_reference(x, w, None, labels, torch.bfloat16, softcap=30.0, reduction="none",
                            z_loss_scale=z_loss_scale)  # fmt: skip
    kept_q = z_loss_scale == 0.0
    assert fused_chunks == ([181] if kept_q else []) and q_backwards == fused_chunks


def test_several_chunks_recompute(fused_chunks, recompute_calls, q_backwards, monkeypatch):
    """Where the eager plan takes several chunks nothing is kept: the recompute schedule's fused
    products, right."""
    for name in ("_ALIGN", "MIN_CHUNK_ROWS", "MIN_SLICE_COLS"):
        monkeypatch.setattr(OPS, name, 8)
    x, w, _, labels = make_inputs(181, 16, 1003, torch.bfloat16, seed=13)  # narrow rows
    g_lp = torch.randn(labels.shape, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    out = linear_log_probs(x, w, labels, softcap=30.0, chunk_bytes=16 * 1024)
    got = torch.autograd.grad((out.log_probs * g_lp).sum(), (x, w))
    assert not fused_chunks and not q_backwards
    assert recompute_calls["lse"] and recompute_calls["grad"]
    _assert_against_fp64(out, got, x, w, labels, g_lp, dict(softcap=30.0), names=("log_probs",))


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["sft", "grpo"])
def test_gpu_gemma2_kept_q_beside_trl(temperature, q_backwards):
    """Gemma 2's head at real size (V 256000, cap 30), a random upstream gradient per token on
    the log-probabilities: the kept Q's outputs and gradients as close to fp32's as TRL's own
    head's."""
    trl_head = _trl_chunked_log_probs()
    n = 2048
    x, w, _, labels = make_inputs(n, 2304, 256000, torch.bfloat16)
    g_lp = torch.randn(n, generator=torch.Generator().manual_seed(1)).cuda()
    out = linear_log_probs(x, w, labels, softcap=30.0, temperature=temperature)
    ours = [out.log_probs, *torch.autograd.grad((out.log_probs * g_lp).sum(), (x, w))]
    assert q_backwards == [n]
    valid = labels >= 0
    lp, *_ = trl_head.apply(x[valid], w, None, labels[valid], temperature, 32768, 30.0, 1.0,
                            ("log_probs",))  # fmt: skip
    lp = torch.zeros(n, device="cuda", dtype=lp.dtype).masked_scatter(valid, lp)
    theirs = [lp, *torch.autograd.grad((lp * g_lp).sum(), (x, w))]
    ref = linear_log_probs_reference(x, w, labels, softcap=30.0, temperature=temperature)
    want = [ref.log_probs, *torch.autograd.grad((ref.log_probs * g_lp).sum(), (x, w))]
    for name, a, t, r in zip(("log_probs", "dx", "dw"), ours, theirs, want, strict=True):
        r = r.detach().float()
        err, err_trl = (float((u.detach().float() - r).norm() / r.norm()) for u in (a, t))
        assert err <= 1.25 * err_trl + 1e-6, f"{name}: {err:.3e} vs TRL's {err_trl:.3e}"
