"""The head's fused products (``linear_cross_entropy.products``): their outputs against fp64,
the head through them against the fp32 reference within bf16's budget (the eager schedule's
softcapped product, the recompute schedule's log-sum-exp and gradient products; every reduction
and option they take, several chunks and vocabulary slices, the logit regimes where their
exponentials are smallest), and the options they must leave to the unfused path."""

from __future__ import annotations

import importlib

import pytest
import torch

from surgery.kernels import linear_cross_entropy, linear_cross_entropy_statistics
from surgery.kernels.linear_cross_entropy.products import (
    applies,
    grad_products,
    lse_products,
    softcap_products,
    target_logits,
)
from surgery.kernels.log_probs import UpstreamHint, linear_log_probs
from surgery.kernels.reference import linear_log_probs_reference
from tests.kernels.test_linear_cross_entropy import (
    _chunked_fp32_reference,
    check_against_reference,
    make_inputs,
)
from tests.kernels.test_log_probs import eager_reference as eager_log_probs_reference
from tests.kernels.test_log_probs import weighted_grads
from tests.utils import DEVICE, assert_close_budget, assert_no_sync_and_graph_replay

OPS = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
PRODUCTS = importlib.import_module("surgery.kernels.linear_cross_entropy.products")


def _count_calls(monkeypatch, name: str, size) -> list[int]:
    """``ops``' calls of the product ``name``, each recorded as ``size(x, w)``."""
    calls, fn = [], getattr(PRODUCTS, name)

    def counted(x, w, *args):
        calls.append(size(x, w))
        return fn(x, w, *args)

    monkeypatch.setattr(OPS, name, counted)
    return calls


@pytest.fixture
def fused_chunks(monkeypatch):
    """The chunks ``lce_fwd`` ran through the fused product (their row counts)."""
    return _count_calls(monkeypatch, "softcap_products", lambda x, w: x.shape[0])


def _regime(x, w, regime: str, cap: float):
    """Inputs whose capped logits sit where the fused product's numbers are smallest: "flat"
    puts every logit near -cap (exp(x - r) ~ exp(-cap - r), r = products.cap_reference),
    "saturated" puts them far out on tanh's tails (1 - t^2 ~ 0)."""
    with torch.no_grad():
        if regime == "flat":  # a shared direction along which every weight row points away
            x[:, 0] = 4 * cap
            w[:, 0] = -1.0
        elif regime == "saturated":
            x.mul_(30 * cap / x.float().norm(dim=1, keepdim=True).to(x.dtype))
    return x, w


# Vocabulary sizes against the 256-column tiles of two 128-column pieces: a multiple of neither
# (1003), a last tile whose second piece lies wholly past V (300: 44 columns in it; 384: exactly
# one full piece), a multiple of 256 (1024).
VOCABS = [1003, 300, 384, 1024]


@pytest.mark.parametrize("v", VOCABS)
def test_products_against_fp64(v):
    """Q, S and the target's capped logit and 1 - t^2 are the module docstring's, computed in
    fp64 from the same bf16 inputs: Q within bf16's rounding, the rest within fp32's."""
    cap = 7.0
    x, w, _, labels = make_inputs(150, 72, v, torch.bfloat16, ignore_frac=0.2)
    x, w = x.detach(), w.detach()
    labels[3] = v  # outside [0, V): no target
    targets = torch.where(labels == -100, -1, labels)
    q, s, x_y, d_y, _ = softcap_products(x, w, targets, cap)
    z = x.double() @ w.double().t()
    t = torch.tanh(z / cap)
    e = torch.exp(cap * t - cap)
    torch.testing.assert_close(q.double(), e * (1 - t * t), rtol=2**-8, atol=0)
    torch.testing.assert_close(s.double(), e.sum(1), rtol=1e-5, atol=0)
    valid = (targets >= 0) & (targets < v)
    rows = valid.nonzero().flatten()
    t_y = t[rows, targets[rows]]
    torch.testing.assert_close(x_y[rows].double(), cap * t_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_y[rows].double(), 1 - t_y * t_y, rtol=1e-4, atol=1e-6)
    assert (x_y[~valid] == 0).all() and (d_y[~valid] == 0).all()


CASES = {
    "mean": dict(softcap=30.0),
    "sum-odd-vocab": dict(softcap=5.0, reduction="sum"),
    "zloss": dict(softcap=10.0, z_loss_scale=1e-3),
    # the largest z-loss it takes at this cap (2 s (log V + cap) = 0.36): a_i + 2 s lse_i b_i
    # moves every gradient row by a quarter
    "strong-zloss": dict(softcap=2.0, z_loss_scale=0.02),
    "num_items-shift": dict(softcap=30.0, num_items_in_batch=77, shift=True),
    "sequence": dict(softcap=30.0, reduction="sequence"),
    "skip_ignored": dict(softcap=30.0, skip_ignored=True, z_loss_scale=1e-4),
    "chunks": dict(softcap=20.0, chunk_bytes=16 * 1024, z_loss_scale=1e-4),
    # the reference of the sums: the cap itself up to 40, past it 80 - cap (products.cap_reference)
    "cap-at-the-turn": dict(softcap=40.0),
    "shifted-reference": dict(softcap=50.0),
    "largest-cap": dict(softcap=60.0),
    "tail-piece-empty": dict(softcap=30.0, z_loss_scale=1e-4),
    "tail-piece-full": dict(softcap=5.0),
}


@pytest.mark.parametrize("regime", ["typical", "flat", "saturated"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_head_matches_reference(case, regime, fused_chunks, monkeypatch):
    """A bf16 softcapped head runs through the fused product (every chunk of it) and gives the
    loss, the z-loss and both gradients of the fp32 reference within bf16's budget, for random
    upstream gradients on every token."""
    kw = dict(CASES[case])
    v = {"sum-odd-vocab": 1003, "tail-piece-empty": 300, "tail-piece-full": 384}.get(case, 1000)
    d = 32 if "chunk_bytes" in kw else 64  # narrow rows: several chunks beat one
    x, w, _, labels = make_inputs(203, d, v, torch.bfloat16, ignore_frac=0.3, seed=len(case))
    x, w = _regime(x, w, regime, kw["softcap"])
    if kw.get("reduction") == "sequence":
        kw["position_ids"] = torch.arange(203, device=DEVICE) % 50
    if "chunk_bytes" in kw:
        for name in ("_ALIGN", "MIN_CHUNK_ROWS"):
            monkeypatch.setattr(OPS, name, 8)
    check_against_reference(x, w, None, labels, torch.bfloat16, **kw)
    assert fused_chunks, "the fused product did not run"
    if "chunk_bytes" in kw:
        assert len(fused_chunks) > 2
    elif kw.get("skip_ignored"):  # the rows with a target only
        assert fused_chunks == [int((labels != -100).sum())]


NOT_FUSED = {
    "fp32": (torch.float32, dict(softcap=30.0)),
    "fp16": (torch.float16, dict(softcap=30.0)),
    "bias": (torch.bfloat16, dict(softcap=30.0, bias=True)),
    "no-softcap": (torch.bfloat16, dict()),
    "cap-beyond-60": (torch.bfloat16, dict(softcap=70.0)),
    "label-smoothing": (torch.bfloat16, dict(softcap=30.0, label_smoothing=0.1)),
    "large-zloss": (torch.bfloat16, dict(softcap=30.0, z_loss_scale=0.05)),
}


def test_switched_off_by_the_environment(fused_chunks, monkeypatch):
    """With ``SURGERY_FUSED_PRODUCTS=0`` (the module's ``ENABLED``) a head the products would
    take runs unfused, and is right."""
    monkeypatch.setattr(PRODUCTS, "ENABLED", False)
    x, w, _, labels = make_inputs(97, 32, 300, torch.bfloat16)
    check_against_reference(x, w, None, labels, torch.bfloat16, softcap=30.0)
    assert not fused_chunks


@pytest.mark.parametrize("case", list(NOT_FUSED), ids=list(NOT_FUSED))
def test_unfused_where_it_does_not_apply(case, fused_chunks):
    """The options the fused product cannot take leave it out (and stay right)."""
    dtype, kw = NOT_FUSED[case]
    kw = dict(kw)
    x, w, b, labels = make_inputs(97, 32, 300, dtype, bias=kw.pop("bias", False))
    check_against_reference(x, w, b, labels, dtype, **kw)
    assert not fused_chunks


def test_offset_views_are_copied_not_left_unfused(fused_chunks):
    """Rows TMA cannot take as they lie (views starting off 16 bytes, a weight of padded rows)
    still take the fused product, through a copy: the choice depends on dtype, shape and device
    only, the same for a forward and the backward recomputing from its saved tensors. Rows of a
    size that is no multiple of 16 bytes are left unfused."""
    args = (None, 30.0, 0.0, 0.0, 1.0, 1.0, True)
    wide = torch.randn(97, 72, device=DEVICE, dtype=torch.bfloat16)
    padded = torch.randn(300, 80, device=DEVICE, dtype=torch.bfloat16) / 8
    x, w = wide[:, 1:65], padded[:, :64]  # rows start 2 bytes off; rows 160 bytes apart
    assert applies(x, w, *args)
    assert not applies(wide[:, :60], w[:, :60], *args)
    labels = torch.randint(0, 300, (97,), device=DEVICE)
    check_against_reference(x.requires_grad_(), w.requires_grad_(), None, labels,
                            torch.bfloat16, softcap=30.0)  # fmt: skip
    assert fused_chunks == [97]


@pytest.fixture
def recompute_calls(monkeypatch):
    """The rows of each ``lse_products`` call and the columns of each ``grad_products`` call."""
    return {
        "lse": _count_calls(monkeypatch, "lse_products", lambda x, w: x.shape[0]),
        "grad": _count_calls(monkeypatch, "grad_products", lambda x, w: w.shape[0]),
    }


@pytest.mark.parametrize("v", VOCABS)
def test_lse_and_grad_products_against_fp64(v):
    """``lse_products`` (with and without a softcap, no logits stored) and ``grad_products`` of a
    vocabulary slice (its columns offset) against fp64 from the same bf16 inputs."""
    x, w, _, labels = make_inputs(140, 64, v, torch.bfloat16, ignore_frac=0.2)
    x, w = x.detach(), w.detach()
    targets = torch.where(labels == -100, -1, labels)
    gen = torch.Generator().manual_seed(5)
    big_a = torch.rand(140, generator=gen).to(DEVICE)
    small_a = torch.rand(140, generator=gen).to(DEVICE)
    cols = torch.arange(v, device=DEVICE)
    for cap in (0.0, 20.0):
        z = x.double() @ w.double().t()
        t = torch.tanh(z / cap) if cap else None
        xs = cap * t if cap else z
        lse = torch.logsumexp(xs, 1)
        torch.testing.assert_close(lse_products(x, w, cap)[0].double(), lse, rtol=1e-6, atol=1e-5)
        start, stop = 128, v - 40  # a slice: its own column numbers, the targets the whole's
        g = big_a.double()[:, None] * torch.exp(xs - lse[:, None])
        g = g - small_a.double()[:, None] * (cols[None, :] == targets[:, None])
        if cap:
            g = g * (1 - t * t)
        got = grad_products(x, w[start:stop], targets, lse.float(), big_a, small_a, cap, start)
        torch.testing.assert_close(got.double(), g[:, start:stop], rtol=2**-8, atol=1e-6)


RECOMPUTE = {
    "low_memory": dict(low_memory=True),
    "low_memory-softcap-zloss": dict(low_memory=True, softcap=30.0, z_loss_scale=1e-3),
    # reduction "none" recomputes under low_memory (by default its logits are kept, unfused)
    "none": dict(reduction="none", low_memory=True),
    "none-softcap": dict(reduction="none", low_memory=True, softcap=5.0, z_loss_scale=1e-2),
    "slices": dict(low_memory=True, chunk_bytes=4096),
    "skip_ignored": dict(low_memory=True, skip_ignored=True, softcap=10.0),
    "sequence": dict(reduction="sequence", low_memory=True),
}


@pytest.mark.parametrize("regime", ["typical", "saturated"])
@pytest.mark.parametrize("case", list(RECOMPUTE), ids=list(RECOMPUTE))
def test_recompute_schedule_through_the_products(case, regime, recompute_calls, monkeypatch):
    """The recompute schedule of a bf16 head (``low_memory``, reduction "none") takes the log-sum-
    exp and gradient products, over several vocabulary slices where asked, and gives the loss, the
    z-loss and both gradients of the fp32 reference within bf16's budget for random upstream
    gradients on every token (the z-loss's own too)."""
    kw = dict(RECOMPUTE[case])
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, ignore_frac=0.3, seed=7)
    x, w = _regime(x, w, regime, kw.get("softcap") or 4.0)
    if kw.get("reduction") == "sequence":
        kw["position_ids"] = torch.arange(181, device=DEVICE) % 40
    if "chunk_bytes" in kw:
        monkeypatch.setattr(OPS, "MIN_SLICE_COLS", 64)
    check_against_reference(x, w, None, labels, torch.bfloat16, **kw)
    assert recompute_calls["lse"] and recompute_calls["grad"]
    if "chunk_bytes" in kw:
        assert len(recompute_calls["grad"]) > 2 and sum(recompute_calls["grad"]) % 1003 == 0


@pytest.mark.parametrize("v", [900, 300])
@pytest.mark.parametrize("cap", [15.0, 0.0])
def test_forward_without_gradients_stores_no_logits(v, cap, recompute_calls, monkeypatch):
    """Under no_grad a bf16 head computes its loss through ``lse_products`` alone: the chunk
    budget bounds its statistics (two words per row and 128 columns), not logits it never makes:
    one call where the logits of every row would not fit, several where the statistics would
    not either; the loss is fp32's."""
    x, w, _, labels = make_inputs(150, 32, v, torch.bfloat16)
    monkeypatch.setattr(OPS, "MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(OPS, "_ALIGN", 8)
    want = linear_cross_entropy(x.float(), w.float(), labels, softcap=cap or None).loss.detach()
    with torch.no_grad():
        for budget, one_call in ((150 * v * 2 // 2, True), (1024, False)):
            recompute_calls["lse"].clear()
            got = linear_cross_entropy(x, w, labels, softcap=cap or None, chunk_bytes=budget)
            torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-5)
            calls = recompute_calls["lse"]
            assert sum(calls) == 150 and (calls == [150]) == one_call, calls
    assert not recompute_calls["grad"]


# --- statistics (entropy, log sum p^2, mean logit, the first maximum) and the entropy's gradient

ALL_STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "predicted")
EVERY_STATISTIC = sum(1 << i for i in range(len(ALL_STATISTICS)))


def _fp64_statistics(xs: torch.Tensor) -> dict:
    """The statistics of rows of fp64 logits ``xs`` as ``STATISTICS`` defines them."""
    log_p = torch.log_softmax(xs, 1)
    return {
        "entropy": -(log_p.exp() * log_p).sum(1),
        "log_sum_sq_probs": torch.logsumexp(2.0 * log_p, 1),
        "mean_logits": xs.mean(1),
    }


def _assert_first_maximum(predicted, xs: torch.Tensor, tol: float, clear_rows: bool = True):
    """``predicted`` is each row's argmax of the fp64 logits ``xs``, except on rows whose two
    largest logits lie within ``tol`` (where fp32 products may order them either way): there a
    column within ``tol`` of the maximum. ``clear_rows``: most rows are clear (saturated logits,
    tied at the cap in fp32, are not)."""
    top2 = xs.topk(2, 1).values
    clear = top2[:, 0] - top2[:, 1] > tol
    assert not clear_rows or clear.float().mean() > 0.5  # the check has rows to bite on
    assert torch.equal(predicted[clear].cpu(), xs.argmax(1)[clear].cpu())
    chosen = xs.gather(1, predicted[:, None].clamp(0, xs.shape[1] - 1))[:, 0]
    assert (chosen >= top2[:, 0] - tol).all()


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("cap", [0.0, 20.0], ids=["plain", "softcap"])
def test_piece_statistics_against_fp64(cap, v):
    """The statistics ``lse_products`` (and, capped, ``softcap_products``) gather per piece and
    combine per row, against fp64 from the same bf16 inputs: the entropy, log sum p^2 and the
    mean logit within fp32's rounding, the first maximum's column exactly where no two logits
    come within it; the log-sum-exp and Q the same as without statistics, each statistic the
    same asked for alone or with others."""
    x, w, _, labels = make_inputs(140, 64, v, torch.bfloat16, ignore_frac=0.2, seed=3)
    x, w = x.detach(), w.detach()
    targets = torch.where(labels == -100, -1, labels)
    z = x.double() @ w.double().t()
    xs = cap * torch.tanh(z / cap) if cap else z
    want = _fp64_statistics(xs)
    plain = lse_products(x, w, cap)
    lse, got = lse_products(x, w, cap, EVERY_STATISTIC)
    runs = [got]
    assert torch.equal(lse, plain[0]) and plain[1] == {}
    if cap:
        q0, s0, *_ = softcap_products(x, w, targets, cap)
        q, s, _, _, values = softcap_products(x, w, targets, cap, EVERY_STATISTIC)
        assert torch.equal(q, q0) and torch.equal(s, s0)
        runs.append(values)
    for subset in (("entropy", "is_top1"), ("log_sum_sq_probs", "mean_logits"), ("mean_logits",)):
        bits = sum(1 << ALL_STATISTICS.index(name) for name in subset)
        some = lse_products(x, w, cap, bits)[1]
        assert all(torch.equal(t, got[k]) for k, t in some.items()), subset  # planes by rank
    for got in runs:
        assert set(got) == {"entropy", "log_sum_sq_probs", "mean_logits", "predicted"}
        for name, ref in want.items():
            torch.testing.assert_close(got[name].double(), ref, rtol=1e-5, atol=2e-5, msg=name)
        assert got["predicted"].dtype == torch.int64
        _assert_first_maximum(got["predicted"], xs, 1e-4)


@pytest.mark.parametrize("cap", [0.0, 20.0], ids=["plain", "softcap"])
def test_first_maximum_breaks_ties_to_the_left_across_pieces(cap):
    """Logits tied exactly (weight rows repeated): ``predicted`` is the first of them, as argmax
    takes it, whether the copies share a piece (600, 601), lie in two pieces of a tile (130 and
    200) or in two tiles (5 and 900); the first copy in a later piece than the row's other large
    logits."""
    x, w, _, _ = make_inputs(64, 64, 1003, torch.bfloat16)
    x, w = x.detach().clone(), w.detach().clone()
    copies = {0: [130, 200, 600, 601], 1: [5, 900]}
    for half, cols in copies.items():
        w[cols] = w[cols[0]].clone()
        rows = slice(32 * half, 32 * half + 32)
        x[rows] += (8.0 * w[cols[0]] / w[cols[0]].float().norm()).to(x.dtype)
    z = x.float() @ w.float().t()
    assert (z[:32, 130] == z[:32, 600]).all() and (z[:32, 130] > z[:32, :130].amax(1)).all()
    stats = 1 << ALL_STATISTICS.index("predicted")
    predicted = lse_products(x, w, cap, stats)[1]["predicted"]
    assert (predicted[:32] == 130).all() and (predicted[32:] == 5).all(), predicted
    if cap:
        targets = torch.zeros(64, dtype=torch.long, device=DEVICE)
        assert torch.equal(softcap_products(x, w, targets, cap, stats)[4]["predicted"], predicted)


def test_first_maximum_tells_adjacent_fp32_logits_apart():
    """Without a softcap, two pieces' maxima one fp32 step apart (columns 5 and 200, their logits
    sums of bf16 products that fp32 holds exactly): ``predicted`` is the larger's column, as
    argmax takes it (the pieces' maxima are the logits' own, not rounded through log2 units)."""
    a = torch.tensor(3.0) + 34 * 2.0**-22  # x log2(e) ln(2) rounds a and b to one number
    b = torch.nextafter(a, torch.tensor(9.0))

    def parts(v):  # v as three bf16 numbers whose fp32 sum is v
        out = []
        for _ in range(3):
            out.append(v.bfloat16().float())
            v = v - out[-1]
        assert v == 0
        return torch.stack(out)

    x = torch.zeros(32, 64)
    x[:, :3] = 1.0
    w = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)) * 1e-3
    w[[5, 200]] = 0.0
    w[5, :3], w[200, :3] = parts(a), parts(b)
    x, w = x.to(DEVICE, torch.bfloat16), w.to(DEVICE, torch.bfloat16)
    assert ((x.float() @ w.float().t()).argmax(1) == 200).all()
    stats = 1 << ALL_STATISTICS.index("predicted")
    assert (lse_products(x, w, 0.0, stats)[1]["predicted"] == 200).all()


@pytest.fixture
def grad_entropy_calls(monkeypatch):
    """Whether each ``grad_products`` call carried the entropy's gradient."""
    calls, fn = [], PRODUCTS.grad_products

    def counted(*args):
        calls.append(len(args) > 8 and args[8] is not None)
        return fn(*args)

    monkeypatch.setattr(OPS, "grad_products", counted)
    return calls


STATISTICS_CASES = {
    # (softcap, low_memory, gradients): the schedule and epilogue that run
    "softcap-eager": (30.0, False, True),  # softcap_products with its statistics
    "softcap-recompute": (30.0, True, True),  # lse_products, then grad_products
    "plain-recompute": (0.0, True, True),
    "softcap-no-grad": (30.0, False, False),  # lse_products alone
    "plain-no-grad": (0.0, False, False),
}


@pytest.mark.parametrize("layout", ["whole", "chunks-skip_ignored"])
@pytest.mark.parametrize("regime", ["typical", "saturated"])
@pytest.mark.parametrize("case", list(STATISTICS_CASES), ids=list(STATISTICS_CASES))
def test_statistics_through_the_fused_products(case, regime, layout, fused_chunks,
                                               recompute_calls, grad_entropy_calls,
                                               monkeypatch):  # fmt: skip
    """A bf16 head asked for every statistic takes the fused products (they no longer leave
    statistics to the unfused path): the statistics within fp32's rounding of fp64 (0, False, -1
    on rows without a target), the loss and every gradient exactly those of the same head asked
    for none; in one token chunk, and in several of the rows with a target only
    (``skip_ignored``)."""
    cap, low_memory, gradients = STATISTICS_CASES[case]
    # several chunks: more rows, narrower (the eager plan takes one chunk unless several would
    # hold less than half of it, its fp32 weight-gradient accumulator counted)
    n, d = (181, 64) if layout == "whole" else (401, 32)
    x, w, _, labels = make_inputs(n, d, 1003, torch.bfloat16, ignore_frac=0.3, seed=11)
    x, w = _regime(x, w, regime, cap or 4.0)
    if not gradients:
        x, w = x.detach(), w.detach()
    kw = dict(softcap=cap or None, low_memory=low_memory, z_loss_scale=1e-4)
    if layout != "whole":
        for name in ("_ALIGN", "MIN_CHUNK_ROWS"):
            monkeypatch.setattr(OPS, name, 8)
        kw.update(chunk_bytes=16 * 1024, skip_ignored=True)
    (loss, z), stats = linear_cross_entropy_statistics(x, w, labels, statistics=ALL_STATISTICS,
                                                       **kw)  # fmt: skip
    eager = bool(cap and gradients and not low_memory)
    calls = fused_chunks if eager else recompute_calls["lse"]
    assert not (recompute_calls["lse"] if eager else fused_chunks)
    if layout == "whole":
        assert calls == [n]
    else:  # several chunks of the rows with a target
        assert len(calls) > 1 and sum(calls) == int((labels != -100).sum()), calls
    plain = linear_cross_entropy(x, w, labels, **kw)
    assert torch.equal(loss, plain.loss) and torch.equal(z, plain.z_loss)
    if gradients:
        got = torch.autograd.grad(loss + z, (x, w))
        want = torch.autograd.grad(plain.loss + plain.z_loss, (x, w))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    z64 = x.double() @ w.double().t()
    xs = cap * torch.tanh(z64 / cap) if cap else z64
    valid = labels != -100
    for name, ref in _fp64_statistics(xs).items():
        assert stats[name].dtype == torch.float32 and (stats[name][~valid] == 0).all()
        torch.testing.assert_close(stats[name][valid].double(), ref[valid], rtol=1e-5, atol=2e-5,
                                   msg=name)  # fmt: skip
    predicted = stats["predicted"]
    assert (predicted[~valid] == -1).all() and not stats["is_top1"][~valid].any()
    _assert_first_maximum(predicted[valid], xs[valid], 1e-4, regime == "typical")
    assert torch.equal(stats["is_top1"], valid & (predicted == labels))
    # is_top1 asked for without predicted, half the targets the top-1 (random labels hit none)
    hits = torch.where(valid & (torch.arange(n, device=DEVICE) % 2 == 0), predicted, labels)
    _, alone = linear_cross_entropy_statistics(x, w, hits, statistics=("entropy", "is_top1"),
                                               **kw)  # fmt: skip
    assert torch.equal(alone["is_top1"], valid & (predicted == hits)) and alone["is_top1"].any()
    assert torch.equal(alone["entropy"], stats["entropy"])


def test_grad_products_entropy_term_against_fp64():
    """``grad_products``' entropy term, -e p (x - lse + h), against fp64 (with a softcap)."""
    cap, v = 20.0, 1003
    x, w, _, labels = make_inputs(140, 64, v, torch.bfloat16, ignore_frac=0.2, seed=9)
    x, w = x.detach(), w.detach()
    targets = torch.where(labels == -100, -1, labels)
    gen = torch.Generator().manual_seed(6)
    big_a, small_a, e = (torch.rand(140, generator=gen).to(DEVICE) for _ in range(3))
    z = x.double() @ w.double().t()
    t = torch.tanh(z / cap)
    xs = cap * t
    lse = torch.logsumexp(xs, 1)
    p = torch.exp(xs - lse[:, None])
    h = -(p * (xs - lse[:, None])).sum(1)
    cols = torch.arange(v, device=DEVICE)
    g = big_a.double()[:, None] * p - small_a.double()[:, None] * (cols == targets[:, None])
    g = (g - e.double()[:, None] * p * (xs - lse[:, None] + h[:, None])) * (1 - t * t)
    got = grad_products(x, w, targets, lse.float(), big_a, small_a, cap, 0, h.float(), e)
    torch.testing.assert_close(got.double(), g, rtol=2**-8, atol=1e-6)


# --- a logit scale and a temperature: x = (cap / T) tanh(s z / cap), or s z / T

# (softcap, logit scale, temperature): without a softcap; the scaled cap within MAX_SOFTCAP (the
# sums by the cap; past 40 by the shifted reference: GRPO's Gemma 2 head at temperature 0.7) and
# past it (by the pieces' maxima); negative scales (the logits' order turned over)
TRANSFORMS = {
    "plain-hot": (0.0, 1.0, 0.7),
    "plain-negative-scale": (0.0, -0.5, 1.25),
    "softcap-by-cap": (20.0, 1.3, 0.8),
    "softcap-negative-scale": (20.0, -1.3, 0.8),
    "softcap-shifted-reference": (30.0, 1.0, 0.7),
    "softcap-by-maxima": (30.0, 1.0, 0.45),
    "cap-70-by-maxima": (70.0, 1.0, 1.0),
}
# Every logit near -cap / T ("flat": there the sums by the cap would leave fp32's normal numbers
# past MAX_SOFTCAP, and the shifted reference's are smallest) or on tanh's tails ("saturated");
# without a softcap, typical logits only.
REGIMES = ("typical", "flat", "saturated")
SCALED_CASES = [(case, regime) for case, (cap, *_) in TRANSFORMS.items()
                for regime in (REGIMES if cap else REGIMES[:1])]  # fmt: skip


def _scaled_fp64(x, w, cap: float, scale: float, temperature: float):
    """(xs, dx/dz) in fp64: the logits the loss sees and their derivative in the product z."""
    z = x.double() @ w.double().t() * scale
    if not cap:
        return z / temperature, torch.full_like(z, scale / temperature)
    t = torch.tanh(z / cap)
    return cap * t / temperature, (1 - t * t) * scale / temperature


@pytest.mark.parametrize(
    ("case", "regime"), SCALED_CASES, ids=[f"{c}-{r}" for c, r in SCALED_CASES]
)
def test_scaled_logits_products_against_fp64(case, regime):
    """``lse_products`` (with every statistic), ``target_logits`` and ``grad_products`` (entropy
    term included) of logits under a logit scale and a temperature, against fp64."""
    cap, scale, temperature = TRANSFORMS[case]
    transform = (scale, 1.0 / temperature)
    v = 1003
    x, w, _, labels = make_inputs(140, 64, v, torch.bfloat16, ignore_frac=0.2, seed=12)
    x, w = _regime(x.detach(), w.detach(), regime, cap / scale if cap else 0.0)
    targets = torch.where(labels == -100, -1, labels)
    xs, slope = _scaled_fp64(x, w, cap, scale, temperature)
    lse = torch.logsumexp(xs, 1)
    got_lse, stats = lse_products(x, w, cap, EVERY_STATISTIC, transform)
    torch.testing.assert_close(got_lse.double(), lse, rtol=1e-6, atol=1e-5)
    for name, ref in _fp64_statistics(xs).items():
        torch.testing.assert_close(stats[name].double(), ref, rtol=1e-5, atol=2e-5, msg=name)
    _assert_first_maximum(stats["predicted"], xs, 1e-4, regime == "typical")
    valid = targets >= 0
    x_y, _ = target_logits(x, w, targets, cap, transform)
    want_y = xs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    torch.testing.assert_close(x_y[valid].double(), want_y[valid], rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(8)
    big_a, small_a, e = (torch.rand(140, generator=gen).to(DEVICE) for _ in range(3))
    p = torch.exp(xs - lse[:, None])
    h = -(p * (xs - lse[:, None])).sum(1)
    cols = torch.arange(v, device=DEVICE)
    g = big_a.double()[:, None] * p - small_a.double()[:, None] * (cols == targets[:, None])
    g = (g - e.double()[:, None] * p * (xs - lse[:, None] + h[:, None])) * slope
    start = 128  # a slice: its own column numbers, the targets the whole's
    got = grad_products(x, w[start:], targets, lse.float(), big_a, small_a, cap, start,
                        h.float(), e, transform)  # fmt: skip
    # within bf16's rounding; on a GPU (exp2 and tanh instructions, fused multiply-adds) an entry
    # by a rounding midpoint may land one step away
    rtol = 2**-7 if x.is_cuda else 2**-8
    torch.testing.assert_close(got.double(), g[:, start:], rtol=rtol, atol=1e-6)


# (softcap, logit scale, temperature, eager): the recompute schedule (an RL objective: GRPO's pass
# at its temperature, under low_memory: by default its logits are kept, unfused, where one chunk
# holds them), and the eager schedule under an UpstreamHint (a scaled cap within MAX_SOFTCAP: the
# log-probabilities' gradients from ``softcap_products``, the entropy's recomputed)
SCALED_HEADS = {
    "plain": (0.0, 1.0, 1.0, False),
    "softcap": (30.0, 1.0, 1.0, False),
    "softcap-eager": (30.0, 1.0, 1.0, True),
    "plain-hot": (0.0, 1.0, 0.7, False),
    "softcap-by-cap": (20.0, 1.3, 0.8, False),
    "softcap-negative-scale": (20.0, -1.3, 0.8, False),
    "softcap-shifted-reference": (30.0, 1.0, 0.7, False),
    "softcap-by-maxima": (30.0, 1.0, 0.45, False),
    "softcap-eager-scaled": (20.0, 1.3, 0.8, True),
    "softcap-eager-hot": (30.0, 1.0, 0.7, True),
}


@pytest.mark.parametrize("case", list(SCALED_HEADS), ids=list(SCALED_HEADS))
def test_scaled_head_through_the_products(case, recompute_calls, fused_chunks,
                                          grad_entropy_calls):  # fmt: skip
    """``linear_log_probs``, with or without a temperature and a logit scale, takes the fused
    products, the entropy's gradient (an RL entropy bonus) in ``grad_products``' epilogue: every
    output within bf16's budget of fp64's (the first maximum: fp64's argmax), and the gradients
    of random upstream gradients on the log-probabilities and the entropy, as ``test_log_probs``
    measures the unfused path."""
    cap, scale, temperature, eager = SCALED_HEADS[case]
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, ignore_frac=0.3, seed=3)
    gen = torch.Generator().manual_seed(4)
    g_lp, g_ent = (torch.randn(labels.shape, generator=gen).to(DEVICE) for _ in range(2))
    opts = dict(softcap=cap or None, logit_scale=scale, temperature=temperature)
    kw = dict(outputs=("log_probs", *ALL_STATISTICS), chunk_bytes=1 << 20, **opts)
    kw["low_memory"] = not eager
    if eager:
        g_lp = torch.full_like(g_lp, -0.25)  # uniform: the hint's next forward is eager
        kw["upstream"] = hint = UpstreamHint()
        weighted_grads(linear_log_probs(x, w, labels, **kw), (x, w), g_lp, g_ent * 0)
        # the first call keeps Q (ops.keeps_q), then recomputes for the entropy's gradient (0
        # here), which the hint records: the next call speculates
        assert hint.uniform and hint.entropy_grad and fused_chunks == [181]
        fused_chunks.clear()
    out = linear_log_probs(x, w, labels, **kw)
    got = weighted_grads(out, (x, w), g_lp, g_ent)
    assert bool(fused_chunks) == eager and (eager or recompute_calls["lse"])
    assert grad_entropy_calls and grad_entropy_calls[-1]
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, **opts)
    base = eager_log_probs_reference(x, w, None, labels, **opts)
    for name in ("log_probs", *ALL_STATISTICS[:3]):
        assert_close_budget(getattr(out, name).double(), getattr(ref, name),
                            getattr(base, name).double(), torch.bfloat16, name)  # fmt: skip
    valid = labels != -100
    xs, _ = _scaled_fp64(x, w, cap, scale, temperature)
    _assert_first_maximum(out.predicted[valid], xs[valid], 1e-4)
    assert torch.equal(out.is_top1, valid & (out.predicted == labels))
    ref_g = weighted_grads(ref, (x, w), g_lp.double(), g_ent.double())
    base_g = weighted_grads(base, (x, w), g_lp, g_ent)
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, ref_g, base_g):
        assert_close_budget(a.double(), r, e.double(), torch.bfloat16, name)


def test_eager_schedule_leaves_a_scaled_cap_past_the_bound(fused_chunks, recompute_calls):
    """The eager schedule's Q needs its sums' least term a normal number (``cap_reference``): a
    cap of 30 at temperature 0.45 (66.7 scaled) runs its eager gradients unfused (and right; the
    first call, no hint yet, keeps its logits), its recompute schedule the products by the
    pieces' maxima (as ``options_apply`` says here; run in
    ``test_scaled_head_through_the_products``); a scaled cap of exactly 60 takes the eager
    products."""
    args = (None, 30.0, 0.0, 0.0, 1.0, 1.0 / 0.45)
    assert not PRODUCTS.options_apply(1003, *args, True)
    assert PRODUCTS.options_apply(1003, *args, False)
    assert PRODUCTS.options_apply(1003, None, 60.0, 0.0, 0.0, 1.0, 1.0, True)
    assert not PRODUCTS.options_apply(1003, None, 60.0, 0.0, 0.0, 1.0, 1.0 / 0.999, True)
    assert PRODUCTS.cap_reference(30.0) == 30.0 and PRODUCTS.cap_reference(50.0) == 30.0
    x, w, _, labels = make_inputs(97, 32, 300, torch.bfloat16)
    opts = dict(softcap=30.0, temperature=0.45)
    kw = dict(outputs=("log_probs",), upstream=UpstreamHint(), **opts)
    for _ in range(2):  # the second forward is eager (a uniform upstream gradient)
        out = linear_log_probs(x, w, labels, **kw)
        got = torch.autograd.grad(out.log_probs.sum(), (x, w))
    assert not fused_chunks and not recompute_calls["lse"]
    ref = linear_log_probs_reference(x, w, labels, dtype=torch.float64, **opts)
    base = eager_log_probs_reference(x, w, None, labels, **opts)
    assert_close_budget(out.log_probs.double(), ref.log_probs, base.log_probs.double(),
                        torch.bfloat16, "log_probs")  # fmt: skip
    ref_g = torch.autograd.grad(ref.log_probs.sum(), (x, w))
    base_g = torch.autograd.grad(base.log_probs.sum(), (x, w))
    for name, a, r, e in zip(("grad_hidden", "grad_weight"), got, ref_g, base_g):
        assert_close_budget(a.double(), r, e.double(), torch.bfloat16, name)


@pytest.mark.parametrize("scale", [1.3, -1.3])
def test_eager_products_with_a_transform_and_zloss(scale, fused_chunks):
    """The eager schedule's op (``lce_fwd`` with the rows' weights) through ``softcap_products``
    under a logit scale, a temperature and a z-loss (its bound taken at cap / T): the losses and
    the gradients of sum(weights (ce + z)) against fp64 autograd, and every statistic."""
    cap, inv_t, z_scale = 20.0, 1.25, 1e-3
    x, w, _, labels = make_inputs(181, 64, 1003, torch.bfloat16, ignore_frac=0.3, seed=3)
    x, w = x.detach(), w.detach()
    targets = torch.where(labels == -100, -1, labels)
    coef = torch.rand(181, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    outs = OPS.lce_fwd(x, w, None, targets, coef, cap, 0.0, z_scale, 1 << 30, True, True, False,
                       False, scale, inv_t, EVERY_STATISTIC)  # fmt: skip
    (ce, zl, _, dx, dw), stats = outs[:5], outs[9:]  # after them: the kept logits' three
    assert fused_chunks == [181]
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    xs = cap * torch.tanh(xd @ wd.t() * scale / cap) * inv_t
    lse = torch.logsumexp(xs, 1)
    valid = targets >= 0
    ce_ref = torch.where(valid, lse - xs.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    zl_ref = torch.where(valid, z_scale * lse * lse, 0.0)
    gx, gw = torch.autograd.grad((coef.double() * (ce_ref + zl_ref)).sum(), (xd, wd))
    torch.testing.assert_close(ce.double(), ce_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(zl.double(), zl_ref.detach(), rtol=1e-5, atol=1e-7)
    for got, want in ((dx, gx), (dw, gw)):  # bf16's rounding of the gradients
        assert (got.double() - want).norm() <= 4e-3 * want.norm()
    values = dict(zip(ALL_STATISTICS, stats, strict=True))
    for name, ref in _fp64_statistics(xs.detach()).items():
        torch.testing.assert_close(values[name][valid].double(), ref[valid], rtol=1e-5,
                                   atol=2e-5, msg=name)  # fmt: skip
    _assert_first_maximum(values["predicted"][valid], xs.detach()[valid], 1e-4)


@pytest.mark.gpu
def test_gpu_gemma2_head_fused_within_budget(fused_chunks):
    """The Gemma 2 head at real size (V 256000, cap 30) runs fused on the H200 and lands within
    bf16's budget of the fp32 reference."""
    x, w, _, labels = make_inputs(2048, 2304, 256000, torch.bfloat16, ignore_frac=0.1)
    ref_loss, ref_gx, ref_gw = _chunked_fp32_reference(x, w, labels, 30.0)
    out = linear_cross_entropy(x, w, labels, softcap=30.0)
    gx, gw = torch.autograd.grad(out.loss, (x, w))
    assert fused_chunks == [2048]
    lf = 30.0 * torch.tanh((x @ w.t()).float() / 30.0)
    eager = torch.nn.functional.cross_entropy(lf, labels)
    egx, egw = torch.autograd.grad(eager, (x, w))
    del lf
    assert_close_budget(out.loss, ref_loss, eager, torch.bfloat16, "loss")
    assert_close_budget(gx, ref_gx, egx, torch.bfloat16, "grad_hidden")
    assert_close_budget(gw, ref_gw, egw, torch.bfloat16, "grad_weight")


@pytest.mark.gpu
def test_gpu_fused_head_no_sync_and_cuda_graphs(fused_chunks):
    """The fused head reads nothing on the host and replays in a CUDA graph."""
    x, w, _, labels = make_inputs(1024, 256, 32000, torch.bfloat16)

    def step(x, w):
        loss = linear_cross_entropy(x, w, labels, softcap=30.0, z_loss_scale=1e-4).loss
        gx, gw = torch.autograd.grad(loss, (x, w))
        return loss.detach(), gx, gw

    eager = step(x, w)
    assert fused_chunks
    assert_no_sync_and_graph_replay(step, x, w, eager)
