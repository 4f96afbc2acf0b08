"""Fused linear cross entropy and cross entropy against the fp32 reference: forward and every
gradient, for every option, on odd sizes; plus the semantics that other libraries get wrong."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surgery.kernels import (
    check_labels,
    cross_entropy,
    cross_entropy_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from surgery.kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from surgery.kernels.reduction import drop_crossing_targets
from tests.utils import (
    DEVICE,
    assert_close_budget,
    assert_no_sync_and_graph_replay,
    poison_,
    rel_err,
    tolerance,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(n, d, v, dtype, ignore_frac=0.3, bias=False, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(DEVICE, dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(DEVICE, dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    return x, w, b, labels.to(DEVICE)


def grads(out, inputs, g_loss, g_z=None):
    total = (out.loss * g_loss).sum()
    if g_z is not None:
        total = total + (out.z_loss * g_z).sum()
    return torch.autograd.grad(total, [t for t in inputs if t is not None])


def check_against_reference(x, w, b, labels, dtype, g_seed=1, **kw):
    """Kernel vs fp32 reference, within the dtype's error budget relative to eager PyTorch in
    ``dtype`` (logits computed in ``dtype``, loss in fp32 — what transformers does)."""
    out = linear_cross_entropy(x, w, labels, b, **kw)
    ref_kw = {k: v for k, v in kw.items() if k not in ("low_memory", "chunk_bytes", "skip_ignored")}
    ref = linear_cross_entropy_reference(x, w, labels, b, **ref_kw)
    eager_logits = x @ w.t() if b is None else torch.addmm(b, x, w.t())
    eager = cross_entropy_reference(eager_logits, labels, **ref_kw)
    gen = torch.Generator().manual_seed(g_seed)
    g_loss = torch.randn(ref.loss.shape, generator=gen).to(DEVICE)
    g_z = torch.randn(ref.loss.shape, generator=gen).to(DEVICE)
    inputs = (x, w, b)
    ref_g = grads(ref, inputs, g_loss, g_z)
    eager_g = grads(eager, inputs, g_loss, g_z)
    out_g = grads(out, inputs, g_loss, g_z)
    assert out.loss.dtype == torch.float32
    assert out.loss.shape == ref.loss.shape and out.z_loss.shape == ref.z_loss.shape
    assert_close_budget(out.loss, ref.loss, eager.loss, dtype, "loss")
    assert_close_budget(out.z_loss, ref.z_loss, eager.z_loss, dtype, "z_loss")
    for name, a, r, e in zip(("grad_hidden", "grad_weight", "grad_bias"), out_g, ref_g, eager_g):
        assert a.dtype == r.dtype
        assert_close_budget(a, r, e, dtype, name)


CASES = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "zloss": dict(z_loss_scale=1e-2),
    "none-zloss": dict(reduction="none", z_loss_scale=1e-2),
    "smoothing": dict(label_smoothing=0.1),
    "softcap": dict(softcap=2.0),
    "num_items": dict(num_items_in_batch=50),
    "shift": dict(shift=True),
    "everything": dict(z_loss_scale=1e-3, label_smoothing=0.05, softcap=3.0, shift=True),
    "low_memory": dict(low_memory=True, z_loss_scale=1e-3),
}


@pytest.fixture
def small_chunks(monkeypatch):
    """Shrink the chunk floors so that small inputs run the multi-chunk paths, and count the
    row-kernel launches to prove they did."""
    lce = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    for name in ("_ALIGN", "MIN_CHUNK_ROWS", "MIN_SLICE_COLS"):
        monkeypatch.setattr(lce, name, 8)
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = lce.cross_entropy_fwd, lce.cross_entropy_bwd

    def count(kind, fn):
        def wrapped(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(lce, "cross_entropy_fwd", count("fwd", fwd))
    monkeypatch.setattr(lce, "cross_entropy_bwd", count("bwd", bwd))
    return calls


@pytest.mark.parametrize("low_memory", [False, True], ids=["eager", "recompute"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_multi_chunk_schedules(small_chunks, low_memory, dtype):
    """Several token chunks (eager: fp32 weight-gradient accumulation across chunks) and several
    vocabulary slices (recompute) give the single-chunk answer."""
    # bf16: N x V must outweigh the fp32 accumulator (V x D x 4) for several chunks to be chosen.
    n, d, v = (37, 67, 1001) if dtype == "fp32" else (120, 4, 256)
    x, w, b, labels = make_inputs(n, d, v, DTYPES[dtype], bias=True)
    kw = dict(low_memory=low_memory, chunk_bytes=16 * v * 2, z_loss_scale=1e-3, softcap=5.0)
    check_against_reference(x, w, b, labels, DTYPES[dtype], **kw)
    assert small_chunks["fwd"] >= 3
    if low_memory:
        assert small_chunks["bwd"] >= 3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_recompute_in_row_blocks(small_chunks, monkeypatch, dtype):
    """The recompute schedule's fp32 hidden-gradient accumulator holds at most twice the logits'
    budget: rows in blocks, each recomputing its own vocabulary slices, the bias and weight
    gradients added to across them; the single-block answer, within the dtype's budget."""
    lce = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    calls, logits = [], lce._logits

    def counted(x, w, *args):
        calls.append((x.shape[0], w.shape[0]))
        return logits(x, w, *args)

    monkeypatch.setattr(lce, "_logits", counted)
    n, d, v = 90, 67, 1001
    x, w, b, labels = make_inputs(n, d, v, DTYPES[dtype], bias=True)  # a bias: unfused
    kw = dict(low_memory=True, z_loss_scale=1e-3, reduction="none")
    for budget, blocks in ((16 * v * 2, [90]), (d * 4 * 16, [32, 32, 26])):
        # (an accumulator of 2 budget / 4 d rows: 119, one block; 32: three)
        calls.clear()
        check_against_reference(x, w, b, labels, DTYPES[dtype], chunk_bytes=budget, **kw)
        backward = [rows for rows, cols in calls if cols < v]  # the forward's are whole rows
        slices = len(backward) // len(blocks)
        assert backward == [r for r in blocks for _ in range(slices)] and slices > 2


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_linear_cross_entropy_options(case, dtype):
    x, w, b, labels = make_inputs(37, 67, 1001, DTYPES[dtype], bias=case in ("mean", "none"))
    check_against_reference(x, w, b, labels, DTYPES[dtype], **CASES[case])


@pytest.mark.parametrize("shape", [(2, 19), (3, 8)], ids=["B2-T19", "B3-T8"])
@pytest.mark.parametrize("reduction", ["mean", "sequence", "none"])
def test_batched_input_shapes(shape, reduction):
    B, T = shape
    x, w, _, labels = make_inputs(B * T, 33, 517, torch.float32)
    x3 = x.detach().view(B, T, 33).requires_grad_()
    check_against_reference(x3, w, None, labels.view(B, T), torch.float32, reduction=reduction)


def test_fp16_inputs():
    x, w, _, labels = make_inputs(29, 40, 300, torch.float16)
    check_against_reference(x, w, None, labels, torch.float16, z_loss_scale=1e-3)


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_fp16_with_a_loss_scale_keeps_small_gradients(softcap):
    """fp16 training multiplies the loss by a loss scale (GradScaler's 65536) so that the small
    logit gradients of a token mean (about p / tokens) stay above fp16's least numbers. Every
    weight row's gradient then has the digits PyTorch's unfused fp16 head gives it, none lost to
    a gradient made at scale 1 in the forward: against fp64 on the same fp16 operands."""
    n, d, v, scale = 256, 32, 1024, 65536.0
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=g).half()
    w = torch.randn(v, d, generator=g).half()
    labels = torch.randint(0, v, (n,), generator=g)

    def weight_grad(loss_of, dtype):
        xx, ww = (t.to(DEVICE, dtype, copy=True).requires_grad_() for t in (x, w))
        (loss_of(xx, ww) * scale).backward()
        return ww.grad.double().cpu()

    def unfused(xx, ww):
        logits = xx @ ww.T
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return torch.nn.functional.cross_entropy(logits.float(), labels.to(DEVICE))

    def fused(xx, ww):
        return linear_cross_entropy(xx, ww, labels.to(DEVICE), softcap=softcap).loss

    want = weight_grad(unfused, torch.float64)
    row_errors = {
        name: ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
        for name, got in (("pytorch", weight_grad(unfused, torch.float16)),
                          ("surgery", weight_grad(fused, torch.float16)))
    }  # fmt: skip
    assert row_errors["surgery"] <= 2 * row_errors["pytorch"], row_errors


def test_long_ignored_runs_and_per_token_upstream():
    # The first 90% of the tokens are ignored; "none" with an arbitrary upstream gradient must
    # give exactly zero gradient through ignored tokens and the right one elsewhere.
    x, w, _, labels = make_inputs(60, 32, 257, torch.float32, ignore_frac=0.0)
    labels[:54] = -100
    check_against_reference(x, w, None, labels, torch.float32, reduction="none")
    out = linear_cross_entropy(x, w, labels, reduction="none")
    assert torch.all(out.loss[:54] == 0)
    g = torch.zeros(60, device=DEVICE)
    g[:54] = 1e6  # huge upstream on ignored tokens only
    gx, gw = torch.autograd.grad((out.loss * g).sum(), (x, w))
    assert torch.all(gx == 0) and torch.all(gw == 0)


SKIP_CASES = {
    "mean": dict(),
    "sequence-zloss": dict(reduction="sequence", z_loss_scale=1e-2),
    "none-zloss": dict(reduction="none", z_loss_scale=1e-2),
    "everything": dict(z_loss_scale=1e-3, label_smoothing=0.05, softcap=3.0, shift=True),
    "low_memory": dict(low_memory=True, z_loss_scale=1e-3),
    "num_items": dict(reduction="sum", num_items_in_batch=50),
}


@pytest.fixture
def product_rows(monkeypatch):
    """The row counts of the logits products of every call (forward and backward)."""
    lce = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    rows, logits = [], lce._logits

    def counted(x, w, bias):
        rows.append(x.shape[0])
        return logits(x, w, bias)

    monkeypatch.setattr(lce, "_logits", counted)
    return rows


@pytest.mark.parametrize("case", list(SKIP_CASES), ids=list(SKIP_CASES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_skip_ignored_is_exact_and_computes_only_the_targets(case, dtype, product_rows):
    """``skip_ignored``: the loss, the z-loss and every gradient (any upstream gradient, also on
    the ignored tokens of reduction "none") are those without it, to the last bits a shorter
    product may round differently; the logits products run over the tokens with a target only."""
    kw = SKIP_CASES[case]
    x, w, b, labels = make_inputs(61, 40, 517, DTYPES[dtype], ignore_frac=0.5, bias=True)
    labels[10:30] = -100  # a long masked run too
    if kw.get("reduction") == "sequence":
        kw = {**kw, "position_ids": torch.arange(61, device=DEVICE) % 20}
    want = linear_cross_entropy(x, w, labels, b, **kw)
    gen = torch.Generator().manual_seed(3)
    g_loss = torch.randn(want.loss.shape, generator=gen).to(DEVICE)
    g_z = torch.randn(want.loss.shape, generator=gen).to(DEVICE)
    want_g = grads(want, (x, w, b), g_loss, g_z)
    product_rows.clear()
    got = linear_cross_entropy(x, w, labels, b, skip_ignored=True, **kw)
    got_g = grads(got, (x, w, b), g_loss, g_z)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "fp32" else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(got.loss, want.loss, **tol)
    torch.testing.assert_close(got.z_loss, want.z_loss, **tol)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a.float(), e.float(), **tol)
    targets = labels[1:] if kw.get("shift") else labels
    with_target = int((targets != -100).sum())
    assert product_rows and set(product_rows) == {with_target}


@pytest.mark.parametrize("low_memory", [False, True], ids=["eager", "recompute"])
def test_skip_ignored_with_no_target_at_all(low_memory):
    """Every token ignored: no product runs, loss and gradients are 0."""
    x, w, b, labels = make_inputs(16, 24, 100, torch.float32, bias=True)
    labels[:] = -100
    out = linear_cross_entropy(
        x, w, labels, b, z_loss_scale=1e-2, low_memory=low_memory, skip_ignored=True
    )
    gs = torch.autograd.grad(out.loss, (x, w, b))
    assert out.loss == 0 and out.z_loss == 0
    for g in gs:
        assert torch.all(g == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "sequence", "none"])
@pytest.mark.parametrize("fn", ["linear", "logits"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction, fn):
    x, w, _, labels = make_inputs(16, 24, 100, torch.float32)
    labels[:] = -100
    kw = dict(reduction=reduction, z_loss_scale=1e-2)
    if reduction == "sequence":
        kw["position_ids"] = torch.arange(16, device=DEVICE) % 8
    if fn == "linear":
        out = linear_cross_entropy(x, w, labels, **kw)
        gs = torch.autograd.grad(out.loss.sum(), (x, w))
    else:
        logits = (x @ w.t()).detach().requires_grad_()
        out = cross_entropy(logits, labels, **kw)
        gs = torch.autograd.grad(out.loss.sum(), (logits,))
    assert torch.all(out.loss == 0) and torch.all(out.z_loss == 0)
    for g in gs:
        assert torch.isfinite(g).all() and torch.all(g == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [False, True])
def test_rows_without_tokens(reduction, shift):
    """(B, 0, D) hidden states (rows of no token): the loss of no token, zero gradients."""
    x = torch.randn(2, 0, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(100, 24, device=DEVICE, requires_grad=True)
    labels = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    out = linear_cross_entropy(x, w, labels, reduction=reduction, shift=shift)
    assert out.loss.shape == ((2, 0) if reduction == "none" else ())
    assert torch.all(out.loss == 0)
    gx, gw = torch.autograd.grad(out.loss.sum(), (x, w))
    assert gx.shape == x.shape and torch.all(gw == 0)


def test_flat_labels_of_several_rows_are_refused_under_shift():
    """(B, T, ...) inputs with flat (B * T,) labels: shifted, a row's last token would learn the
    next row's first label. Refused (the labels must be (B, T)); unshifted, or of one row, fine."""
    x = torch.randn(2, 5, 24, device=DEVICE)
    w = torch.randn(50, 24, device=DEVICE)
    labels = torch.randint(0, 50, (2, 5), device=DEVICE)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        linear_cross_entropy(x, w, labels.reshape(-1), shift=True)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        cross_entropy(x @ w.T, labels.reshape(-1), shift=True)
    want = linear_cross_entropy(x, w, labels, shift=False).loss
    torch.testing.assert_close(linear_cross_entropy(x, w, labels.reshape(-1)).loss, want)
    one = linear_cross_entropy(x[:1], w, labels[:1].reshape(-1), shift=True).loss
    torch.testing.assert_close(one, linear_cross_entropy(x[:1], w, labels[:1], shift=True).loss)


def _pack(seqs_hidden, seqs_labels):
    x = torch.cat(seqs_hidden)
    labels = torch.cat(seqs_labels)
    pos = torch.cat([torch.arange(len(s)) for s in seqs_labels]).to(DEVICE)
    cu = torch.tensor([0] + [len(s) for s in seqs_labels], device=DEVICE).cumsum(0)
    return x, labels, pos, cu


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seqlens"])
@pytest.mark.parametrize("shift", [False, True], ids=["noshift", "shift"])
def test_sequence_reduction_packed_equals_unpacked(boundaries, shift):
    """A packed row with reduction="sequence" trains exactly like the same sequences unpacked
    (each its own row, per-sequence mean, then the mean over sequences)."""
    lengths = [5, 17, 9]
    d, v = 24, 211
    base = torch.Generator().manual_seed(3)
    w = (torch.randn(v, d, generator=base) / d**0.5).to(DEVICE).requires_grad_()
    hs = [torch.randn(n, d, generator=base).to(DEVICE) for n in lengths]
    ls = [torch.randint(0, v, (n,), generator=base).to(DEVICE) for n in lengths]
    ls[1][3:9] = -100  # a masked prompt turn in the middle: not a boundary
    x_packed, labels_packed, pos, cu = _pack(hs, ls)
    x_packed.requires_grad_()
    kw = {"position_ids": pos} if boundaries == "position_ids" else {"cu_seqlens": cu}
    packed = linear_cross_entropy(
        x_packed, w, labels_packed, reduction="sequence", shift=shift, **kw
    )
    gx, gw = torch.autograd.grad(packed.loss, (x_packed, w))

    per_seq = [linear_cross_entropy(h, w, lab, shift=shift).loss for h, lab in zip(hs, ls)]
    unpacked = torch.stack(per_seq).mean()
    ugw = torch.autograd.grad(unpacked, w, retain_graph=True)[0]
    assert rel_err(packed.loss, unpacked) < 1e-6
    assert rel_err(gw, ugw) < 1e-5
    # Per-sequence hidden gradients of the unpacked run, concatenated, equal the packed ones.
    hs_req = [h.clone().requires_grad_() for h in hs]
    loss_u = torch.stack(
        [linear_cross_entropy(h, w, lab, shift=shift).loss for h, lab in zip(hs_req, ls)]
    ).mean()
    ugx = torch.cat(torch.autograd.grad(loss_u, hs_req))
    assert rel_err(gx, ugx) < 1e-5
    # And the token mean is NOT the same thing on unequal lengths: the reduction matters.
    token_mean = linear_cross_entropy(x_packed, w, labels_packed, shift=shift, **kw).loss
    assert rel_err(token_mean, unpacked) > 1e-3


def test_shift_never_crosses_packed_boundary():
    x, w, _, labels = make_inputs(12, 16, 50, torch.float32, ignore_frac=0.0)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1], device=DEVICE)
    out = linear_cross_entropy(x, w, labels, reduction="none", shift=True, position_ids=pos)
    # The last token of each sequence (and of the row) has no next-token target.
    assert torch.all(out.loss[[3, 9, 11]] == 0)
    assert torch.all(out.loss[[0, 1, 2, 4, 8, 10]] > 0)


def test_pre_shifted_targets_drop_the_packed_boundaries():
    """``drop_crossing_targets``: next-token targets given as they are (transformers'
    ``shift_labels``) lose those crossing into the next sequence of the row, by position_ids or
    cu_seqlens, (N,) or (B, T); a row's last target is kept (the next shard's first token under
    context parallelism) and the caller's tensor is not written. The loss of the targets so kept
    is the loss's own shift, token by token."""
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2], device=DEVICE)
    labels = torch.arange(10, 18, device=DEVICE)
    shifted = torch.cat([labels[1:], labels.new_tensor([-100])])
    want = shifted.clone()
    want[[2, 4]] = -100
    assert torch.equal(drop_crossing_targets(shifted, -100, pos, None), want)
    cu = torch.tensor([0, 3, 5, 8], device=DEVICE)
    assert torch.equal(drop_crossing_targets(shifted, -100, None, cu), want)
    assert shifted[2] == 13 and drop_crossing_targets(shifted, -100, None, None) is shifted
    rows = torch.arange(20, 28, device=DEVICE).view(2, 4)
    rows_pos = torch.tensor([[0, 1, 0, 1], [5, 6, 7, 0]], device=DEVICE)
    want_rows = rows.clone()
    want_rows[0, 1] = want_rows[1, 2] = -100
    assert torch.equal(drop_crossing_targets(rows, -100, rows_pos, None), want_rows)
    x, w, _, _ = make_inputs(8, 16, 50, torch.float32, ignore_frac=0.0)
    by_shift = linear_cross_entropy(x, w, labels, reduction="none", shift=True, position_ids=pos)
    given = linear_cross_entropy(x, w, want, reduction="none", position_ids=pos)
    torch.testing.assert_close(given.loss, by_shift.loss, rtol=0, atol=0)


def test_multi_turn_masking_is_not_a_boundary():
    """reduction="sequence" on one dialogue with several masked prompt turns = plain token mean."""
    x, w, _, labels = make_inputs(30, 16, 64, torch.float32, ignore_frac=0.0)
    labels[0:5] = -100
    labels[12:18] = -100
    labels[25:27] = -100
    labels2 = labels.view(1, 30)
    seq = linear_cross_entropy(x.view(1, 30, 16), w, labels2, reduction="sequence").loss
    mean = linear_cross_entropy(x, w, labels).loss
    assert rel_err(seq, mean) < 1e-6


def test_z_loss_is_trained_and_returned():
    x, w, _, labels = make_inputs(20, 16, 64, torch.float32)
    plain = linear_cross_entropy(x, w, labels)
    withz = linear_cross_entropy(x, w, labels, z_loss_scale=1e-1)
    assert withz.z_loss > 0 and plain.z_loss == 0
    torch.testing.assert_close(withz.loss, plain.loss + withz.z_loss)
    g_plain = torch.autograd.grad(plain.loss, w)[0]
    g_z = torch.autograd.grad(withz.loss, w)[0]
    assert rel_err(g_z, g_plain) > 1e-3  # the z-loss term is part of what is trained


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["none-zloss", "everything", "sum"])
def test_cross_entropy_over_logits(case, dtype):
    dt = DTYPES[dtype]
    x, w, _, labels = make_inputs(37, 67, 1001, torch.float32)
    logits32 = (x @ w.t()).detach()
    logits = logits32.to(dt).requires_grad_()
    kw = CASES[case]
    out = cross_entropy(logits, labels, **kw)
    ref = cross_entropy_reference(logits.detach().float().requires_grad_(), labels, **kw)
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(ref.loss.shape, generator=gen).to(DEVICE)
    (ga,) = torch.autograd.grad((out.loss * g).sum(), logits)
    lr = logits.detach().float().requires_grad_()
    ref = cross_entropy_reference(lr, labels, **kw)
    (gr,) = torch.autograd.grad((ref.loss * g).sum(), lr)
    assert ga.dtype == dt  # bf16 logits get a bf16 gradient: no fp32 copy
    assert rel_err(out.loss, ref.loss) <= tolerance(dt)["floor"]
    assert rel_err(ga, gr) <= (1e-5 if dt == torch.float32 else 8e-3)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_cross_entropy_inplace_backward_only_when_asked(inplace):
    x, w, _, labels = make_inputs(20, 16, 64, torch.float32)
    leaf = (x @ w.t()).detach().requires_grad_()
    logits = leaf * 1.0  # a non-leaf the caller can still see
    before = logits.detach().clone()
    out = cross_entropy(logits, labels, inplace_backward=inplace)
    out.loss.backward()
    lr = before.clone().requires_grad_()
    cross_entropy_reference(lr, labels).loss.backward()
    assert rel_err(leaf.grad, lr.grad) < 1e-6
    if inplace:
        assert not torch.equal(logits.detach(), before)  # the caller asked for it
    else:
        assert torch.equal(logits.detach(), before)  # never overwritten otherwise


def test_no_grad_computes_only_the_loss():
    x, w, _, labels = make_inputs(20, 16, 64, torch.float32)
    with torch.no_grad():
        out = linear_cross_entropy(x, w, labels, z_loss_scale=1e-2)
    assert out.loss.grad_fn is None
    ref = linear_cross_entropy_reference(x.detach(), w.detach(), labels, z_loss_scale=1e-2)
    assert rel_err(out.loss, ref.loss) < 1e-6


@pytest.mark.parametrize("cols", [(0, 100), (37, 64), (0, 1001)], ids=["c0-100", "c37-64", "full"])
def test_row_kernels_write_every_element(cols):
    """Poisoned outputs: the launchers write every element they own, nothing else."""
    c0, nc = cols
    x, w, _, labels = make_inputs(11, 16, 1001, torch.float32, ignore_frac=0.3)
    logits = (x @ w.t()).detach()
    targets = torch.where(labels >= 0, labels, -1)
    ones = torch.ones(11, device=DEVICE)
    grad = poison_(torch.empty_like(logits))
    lse, ce, _ = cross_entropy_fwd(logits, targets, coef_ce=ones, coef_z=ones, grad_out=grad)
    assert torch.isfinite(grad).all() and torch.isfinite(lse).all() and torch.isfinite(ce).all()
    part = poison_(torch.empty(11, nc, device=DEVICE))
    cross_entropy_bwd(logits[:, c0 : c0 + nc], targets, lse, ones, ones, part, col_offset=c0,
                      vocab_size=1001)  # fmt: skip
    torch.testing.assert_close(part, grad[:, c0 : c0 + nc])


def test_errors_are_clear():
    x, w, _, labels = make_inputs(8, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="last dimension"):
        linear_cross_entropy(x[:, :15], w, labels)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(x, w, labels[:7])
    with pytest.raises(TypeError, match="same dtype"):
        linear_cross_entropy(x, w.to(torch.float64), labels)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(x, w, labels.float())
    with pytest.raises(ValueError, match="unknown reduction"):
        linear_cross_entropy(x, w, labels, reduction="avg")
    with pytest.raises(ValueError, match="needs sequence boundaries"):
        linear_cross_entropy(x, w, labels, reduction="sequence")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        linear_cross_entropy(
            x, w, labels, reduction="sequence", position_ids=torch.arange(8), num_items_in_batch=3
        )
    with pytest.raises(ValueError, match="position_ids"):
        linear_cross_entropy(x, w, labels, reduction="sequence", position_ids=torch.arange(7))
    bad = labels.clone()
    bad[2] = 32
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(x, w, bad)
        check_labels()  # on a GPU the report is lazy: no host sync in the hot path
    bad[2] = -5
    with pytest.raises(ValueError, match="outside"):
        cross_entropy(x @ w.t(), bad)
        check_labels()
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(x, w, labels, softcap=0.0)


def test_meta_tensors_leave_no_label_flag_behind():
    """A call on meta tensors (shape tracing) has no labels to check: it leaves no flag for
    ``check_labels()`` to read (reading one raised "Tensor.item() cannot be called on meta
    tensors" in whatever test next called it, in the worker that had traced: a fresh clone's CI
    failed by the order xdist gave the tests)."""
    x = torch.randn(8, 4, device="meta", requires_grad=True)
    w = torch.randn(16, 4, device="meta", requires_grad=True)
    labels = torch.randint(0, 16, (8,)).to("meta")
    linear_cross_entropy(x, w, labels).loss.backward()
    cross_entropy(x @ w.t(), labels)
    check_labels()


def test_traces_with_fullgraph_compile():
    """The ops are opaque to dynamo: the whole loss, forward and backward, traces in one graph."""
    x, w, _, labels = make_inputs(24, 16, 64, torch.float32)
    pos = torch.arange(24, device=DEVICE) % 12

    def step(x, w, labels, pos):
        out = linear_cross_entropy(
            x, w, labels, reduction="sequence", position_ids=pos, z_loss_scale=1e-3
        )
        return out.loss, out.z_loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss_c, z_c = compiled(x, w, labels, pos)
    gc = torch.autograd.grad(loss_c, (x, w))
    loss_e, z_e = step(x, w, labels, pos)
    ge = torch.autograd.grad(loss_e, (x, w))
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(z_c, z_e)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 48),
    v=st.integers(2, 300),
    reduction=st.sampled_from(["mean", "sum", "none", "sequence"]),
    z=st.sampled_from([0.0, 1e-2]),
    eps=st.sampled_from([0.0, 0.2]),
    cap=st.sampled_from([None, 1.5]),
    shift=st.booleans(),
    ignore=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(n, d, v, reduction, z, eps, cap, shift, ignore, seed):
    x, w, _, labels = make_inputs(n, d, v, torch.float32, ignore_frac=ignore, seed=seed)
    g = torch.Generator().manual_seed(seed)
    pos = (torch.arange(n) - torch.randint(0, n, (1,), generator=g)).clamp_min(0).to(DEVICE)
    kw = dict(reduction=reduction, z_loss_scale=z, label_smoothing=eps, softcap=cap, shift=shift)
    if reduction == "sequence":
        kw["position_ids"] = pos
    check_against_reference(x, w, None, labels, torch.float32, **kw)


# --------------------------------------------------------------------------------------------
# GPU: real vocabulary sizes, bf16, compile / CUDA graphs / no host sync.


def _chunked_fp32_reference(x, w, labels, softcap=None):
    """fp32 reference of a token-mean loss and both gradients at real sizes, in chunks."""
    n = x.shape[0]
    xf, wf = x.detach().float(), w.detach().float()
    valid = labels != -100
    cnt = valid.sum().clamp_min(1)
    loss = torch.zeros((), device=x.device)
    gx = torch.zeros_like(xf)
    gw = torch.zeros_like(wf)
    for n0 in range(0, n, 1024):
        sl = slice(n0, n0 + 1024)
        z = xf[sl] @ wf.t()
        lz = z.clone().requires_grad_()
        lc = softcap * torch.tanh(lz / softcap) if softcap else lz
        part = torch.nn.functional.cross_entropy(lc, labels[sl], reduction="sum") / cnt
        (gz,) = torch.autograd.grad(part, lz)
        loss += part.detach()
        gx[sl] = gz @ wf
        gw += gz.t() @ xf[sl]
    return loss, gx, gw


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,d,v,cap",
    [(4096, 4096, 128256, None), (2048, 2304, 256000, 30.0), (16384, 3584, 152064, None)],
    ids=["llama3-N4096-V128256", "gemma2-N2048-V256000-softcap", "qwen2.5-N16384-V152064"],
)
@pytest.mark.parametrize("low_memory", [False, True], ids=["default", "low_memory"])
def test_gpu_real_vocab_bf16(n, d, v, cap, low_memory):
    """Real heads in bf16 against the fp32 reference, within the budget of eager bf16 (Qwen 2.5's
    under ``low_memory``: the recompute schedule's rows in two blocks)."""
    x, w, _, labels = make_inputs(n, d, v, torch.bfloat16, ignore_frac=0.1, scale=1.0)
    ref_loss, ref_gx, ref_gw = _chunked_fp32_reference(x, w, labels, cap)
    out = linear_cross_entropy(x, w, labels, softcap=cap, low_memory=low_memory)
    gx, gw = torch.autograd.grad(out.loss, (x, w))
    # eager bf16, as transformers computes it: bf16 logits, fp32 loss
    logits = x @ w.t()
    lf = logits.float()
    if cap:
        lf = cap * torch.tanh(lf / cap)
    eager = torch.nn.functional.cross_entropy(lf, labels)
    egx, egw = torch.autograd.grad(eager, (x, w))
    del logits, lf
    assert_close_budget(out.loss, ref_loss, eager, torch.bfloat16, "loss")
    assert_close_budget(gx, ref_gx, egx, torch.bfloat16, "grad_hidden")
    assert_close_budget(gw, ref_gw, egw, torch.bfloat16, "grad_weight")


@pytest.mark.gpu
def test_gpu_bf16_logits_not_copied_to_fp32():
    n, v = 4096, 128256
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = cross_entropy(logits, labels)
    out.loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # The gradient (one bf16 logits-sized buffer) is all; an fp32 copy would add 2x that.
    assert extra < 1.2 * logits.numel() * 2, extra


@pytest.mark.gpu
def test_gpu_compile_fullgraph_cuda_graphs_and_no_sync():
    x, w, _, labels = make_inputs(1024, 256, 32000, torch.bfloat16)
    pos = torch.arange(1024, device="cuda") % 300

    def loss_fn(x, w):
        out = linear_cross_entropy(x, w, labels, reduction="sequence", position_ids=pos)
        return out.loss

    def step(fn, x, w):
        loss = fn(x, w)
        gx, gw = torch.autograd.grad(loss, (x, w))
        return loss.detach(), gx, gw

    eager = step(loss_fn, x, w)
    compiled = torch.compile(loss_fn, fullgraph=True)  # forward and its backward graph
    got = step(compiled, x, w)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
    # No host synchronisation anywhere in a training step; CUDA graph capture and replay of it.
    assert_no_sync_and_graph_replay(lambda x, w: step(loss_fn, x, w), x, w, eager)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_scale_by_upstream_in_place_and_out_of_place(kernel, scale, monkeypatch):
    """The backward's scale of the stored gradients: in place eagerly (``scale_by_upstream_``),
    into a new tensor under torch.compile (the ``surgery::scaled_by_upstream`` op), with the Triton
    kernel and without it; the product of the fp32 scale, rounded once to nearest (the
    interpreter too), and the op never writes its input."""
    lce_mod = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    if not kernel:
        monkeypatch.setattr(lce_mod, "scale_by_upstream_kernel", None)
    g = torch.Generator().manual_seed(0)
    t = torch.randn(37, 19, generator=g).to(DEVICE, torch.bfloat16)
    up = torch.tensor(scale, device=DEVICE)
    want = (t.float() * scale).to(torch.bfloat16)

    def check(got):
        assert torch.equal(got, want)

    before = t.clone()
    out = torch.ops.surgery.scaled_by_upstream(t, up)
    assert torch.equal(t, before) and out.data_ptr() != t.data_ptr()
    check(out)
    same = lce_mod.scale_by_upstream_(t, up)
    assert same is t
    check(t)
