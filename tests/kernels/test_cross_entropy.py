"""What the two loss entry points share: which tokens carry a target (``ignore_index``, any int,
inside the vocabulary too) and the final-logit softcap's accuracy.

Both entry points (``cross_entropy`` over logits, ``linear_cross_entropy``) run on both paths: the
Triton kernels (through the interpreter on CPU) and the chunked PyTorch fallback (CPU tensors
without ``TRITON_INTERPRET``). Every result is compared with a reference written here in fp64 from
``F.cross_entropy``, independent of kernels/reduction.py and kernels/reference.py.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from surgery.kernels import check_labels, cross_entropy, linear_cross_entropy
from surgery.kernels.cross_entropy import cross_entropy_fwd
from tests.utils import DEVICE, assert_close_budget, rel_err, tolerance

V = 37  # odd, and small enough that labels hit every class, ignore_index's included
B, T = 3, 9  # (B, T) labels: each row is one sequence for reduction="sequence"
REDUCTIONS = ["mean", "sum", "none", "sequence"]
# The modules, not the functions of the same name that surgery.kernels exports.
ce_mod = importlib.import_module("surgery.kernels.cross_entropy.launch")
lce_mod = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")

IGNORE_INDICES = {
    "ii0": 0,
    "ii2": 2,
    f"iiV-1={V - 1}": V - 1,
    f"iiV={V}": V,
    "ii-1": -1,
    "ii-100": -100,
    "ii-7": -7,
}


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """The device the inputs live on: the Triton kernels' (DEVICE), or CPU with the interpreter
    off, where the PyTorch fallback runs; there the kernels are removed to prove it."""
    if request.param == "triton":
        return DEVICE
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(ce_mod, "cross_entropy_fwd_kernel", None)
    monkeypatch.setattr(ce_mod, "cross_entropy_bwd_kernel", None)
    monkeypatch.setattr(lce_mod, "scale_by_upstream_kernel", None)
    return torch.device("cpu")


def make_labels(ignore_index: int, device, seed: int = 0) -> torch.Tensor:
    """(B, T) labels in [0, V) with every third token of a row and the whole last row (a
    sequence without targets) set to ``ignore_index``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, 1::3] = ignore_index
    labels[-1] = ignore_index
    return labels.to(device)


def run_loss(fn: str, logits32: torch.Tensor, labels: torch.Tensor, **kw):
    """``fn``'s loss of fp32 inputs whose logits are ``logits32`` (N, V), and the inputs that
    require grad: the logits (``cross_entropy``), or hidden states equal to them and an identity
    weight (``linear_cross_entropy``: products by 0 and 1 are exact), so that the gradient of the
    first input is the logits' gradient on both."""
    z = logits32.detach().clone().requires_grad_()
    if fn == "logits":
        return cross_entropy(z, labels, **kw), (z,)
    w = torch.eye(logits32.shape[1], device=z.device, requires_grad=True)
    return linear_cross_entropy(z, w, labels, **kw), (z, w)


def input_grads(logits_grad: torch.Tensor, logits: torch.Tensor, fn: str) -> list[torch.Tensor]:
    """Gradients of ``run_loss``'s inputs given the logits' gradient: for ``"linear"`` the weight's
    is logits_grad.T @ hidden (the hidden states being the logits)."""
    if fn == "logits":
        return [logits_grad]
    return [logits_grad, logits_grad.t() @ logits]


def reference64(logits, labels, ignore_index, reduction, label_smoothing=0.0, z_loss_scale=0.0,
                softcap=None, shift=False):  # fmt: skip
    """Independent fp64 reference: ``F.cross_entropy(ignore_index=...)`` per token; "sequence" as
    the mean, over the rows of (B, T) labels that have a target, of each row's token mean."""
    x = logits.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    lab = labels.view(-1, labels.shape[-1]) if labels.dim() == 2 else labels.view(1, -1)
    if shift:  # next-token targets within each row; the last token of a row has none
        lab = torch.cat([lab[:, 1:], torch.full_like(lab[:, :1], ignore_index)], dim=1)
    flat = lab.reshape(-1)
    x = x.view(flat.numel(), -1)
    per_token = F.cross_entropy(
        x, flat, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = flat != ignore_index
    per_token = per_token + torch.where(valid, z_loss_scale * torch.logsumexp(x, -1) ** 2, 0.0)
    if reduction == "none":
        return per_token.view(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / valid.sum()
    rows = [
        per_token.view(lab.shape)[r].sum() / valid.view(lab.shape)[r].sum()
        for r in range(lab.shape[0])
        if valid.view(lab.shape)[r].any()
    ]
    return torch.stack(rows).mean()


def upstream(ref: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ref.shape, generator=g, dtype=torch.float64)


def check_loss_and_grad(fn, logits32, labels, ignore_index, reduction, **kw):
    """Loss and input gradients against the fp64 reference, within fp32's budget (eager: the
    same reference in fp32). Returns the loss and the logits' gradient."""
    out, inputs = run_loss(
        fn, logits32, labels, ignore_index=ignore_index, reduction=reduction, **kw
    )
    x64 = logits32.detach().double().requires_grad_()
    ref = reference64(x64, labels, ignore_index, reduction, **kw)
    x32 = logits32.detach().float().requires_grad_()
    eager = reference64(x32, labels, ignore_index, reduction, **kw).float()
    g = upstream(ref)
    got = torch.autograd.grad((out.loss * g.to(out.loss.device, torch.float32)).sum(), inputs)
    (gref,) = torch.autograd.grad((ref * g.to(ref.device)).sum(), x64)
    (geager,) = torch.autograd.grad((eager * g.to(eager.device, torch.float32)).sum(), x32)
    assert out.loss.shape == ref.shape
    assert_close_budget(out.loss, ref, eager, torch.float32, "loss")
    wants = zip(input_grads(gref, x64.detach(), fn), input_grads(geager, x32.detach(), fn))
    for name, a, (r, e) in zip(("grad_logits", "grad_weight"), got, wants):
        assert_close_budget(a, r, e, torch.float32, name)
    return out, got[0]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", list(IGNORE_INDICES.values()), ids=list(IGNORE_INDICES))
@pytest.mark.parametrize("fn", ["logits", "linear"])
def test_ignore_index_any_int(path, fn, ignore_index, reduction):
    """Any int is an ignore_index, as in F.cross_entropy: inside [0, V) (tokens labelled with that
    class are not trained), at its edges and negative."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B * T, V, generator=g).to(path)
    labels = make_labels(ignore_index, path)
    out, grad = check_loss_and_grad(fn, logits, labels, ignore_index, reduction)
    ignored = (labels == ignore_index).view(-1)
    assert torch.all(grad[ignored] == 0)
    if reduction == "none":
        assert torch.all(out.loss.view(-1)[ignored] == 0)
        assert torch.all(out.loss.view(-1)[~ignored] > 0)


@pytest.mark.parametrize("reduction", ["mean", "none", "sequence"])
@pytest.mark.parametrize("ignore_index", [0, 2, V - 1, -100], ids=["ii0", "ii2", "iiV-1", "ii-100"])
@pytest.mark.parametrize("fn", ["logits", "linear"])
def test_ignore_index_with_shift_smoothing_and_z_loss(path, fn, ignore_index, reduction):
    """Next-token targets (the label of the next token, ignore_index included, and none for the
    last token of a row), label smoothing and the z-loss all skip the ignored tokens."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B * T, V, generator=g).to(path)
    labels = make_labels(ignore_index, path, seed=4)
    kw = dict(shift=True, label_smoothing=0.1, z_loss_scale=1e-2)
    _, grad = check_loss_and_grad(fn, logits, labels, ignore_index, reduction, **kw)
    next_ignored = torch.cat(
        [labels[:, 1:] == ignore_index, torch.ones_like(labels[:, :1], dtype=torch.bool)], 1
    )
    assert torch.all(grad[next_ignored.view(-1)] == 0)


@pytest.mark.parametrize(
    "dtype",
    [torch.uint8, torch.int8, torch.int16, torch.int32],
    ids=["uint8", "int8", "int16", "int32"],
)
@pytest.mark.parametrize("fn", ["logits", "linear"])
def test_narrow_label_dtypes(path, fn, dtype):
    """Integer labels of any width train like int64 ones, next-token targets and an ignore_index
    inside the vocabulary included (the row ends are filled with ignore_index)."""
    logits = torch.randn(B * T, V, generator=torch.Generator().manual_seed(8)).to(path)
    labels = make_labels(2, path, seed=9)
    kw = dict(ignore_index=2, reduction="none", shift=True)
    want, _ = run_loss(fn, logits, labels, **kw)
    got, _ = run_loss(fn, logits, labels.to(dtype), **kw)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize(
    "ignore_index,bad",
    [(2, V), (2, -100), (-1, -100), (V, -1), (-100, V + 3)],
    ids=["ii2-label=V", "ii2-label=-100", "ii-1-label=-100", "iiV-label=-1", "ii-100-label=V+3"],
)
@pytest.mark.parametrize("fn", ["logits", "linear"])
def test_labels_outside_vocab_still_raise(path, fn, ignore_index, bad):
    """A label outside [0, V) that is not ignore_index is an error, whatever ignore_index is."""
    logits = torch.randn(B * T, V).to(path)
    labels = make_labels(ignore_index, path)
    labels[0, 1] = bad
    with pytest.raises(ValueError, match="outside"):
        run_loss(fn, logits, labels, ignore_index=ignore_index)
        check_labels()  # on a GPU the report is lazy: no host sync in the hot path


# --------------------------------------------------------------------------------------------
# Final-logit softcap: cap * tanh(z / cap) as accurate as torch.tanh for every |z|.

SOFTCAPS = {"cap30": 30.0, "cap5": 5.0}
STRICT = tolerance(torch.float32)["strict_rtol"]


def spread_logits(shape, cap: float, seed: int) -> torch.Tensor:
    """fp32 logits with magnitudes log-uniform from 1e-3 to 20 * cap and random signs: capped,
    they run from far below the cap (where tanh(u) ~ u) to saturation at +-cap."""
    g = torch.Generator().manual_seed(seed)
    log_mag = torch.empty(shape).uniform_(math.log(1e-3), math.log(20 * cap), generator=g)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return sign * log_mag.exp()


@pytest.mark.parametrize("cap", list(SOFTCAPS.values()), ids=list(SOFTCAPS))
def test_softcap_is_tanh_to_fp32_rounding(path, cap):
    """The capped logits themselves, elementwise: the logsumexp of a one-column row is that
    column's capped logit, so the row kernel returns cap * tanh(z / cap) as it computes it."""
    z = torch.cat([spread_logits((509,), cap, seed=5), torch.tensor([0.0, 1e-30, -1e-30])])
    targets = torch.zeros(z.numel(), dtype=torch.long, device=path)
    lse, _, _ = cross_entropy_fwd(z[:, None].to(path), targets, softcap=cap)
    want = cap * torch.tanh(z.double() / cap)
    torch.testing.assert_close(lse.cpu().double(), want, rtol=STRICT, atol=0)


def test_softcap_takes_the_tanh_instruction_for_bf16_on_a_gpu_only(monkeypatch):
    """The kernels' SOFTCAP: the GPU's tanh instruction (2) only for bf16 logits on CUDA outside
    the interpreter and unless SURGERY_HARDWARE_TANH=0; the exact tanh (1) for fp32 and fp16
    logits (fp16's rounding, 2^-11, is no coarser than the instruction's error) and on CPU."""
    from types import SimpleNamespace

    launch = importlib.import_module("surgery.kernels.cross_entropy.launch")

    def mode(dtype, cuda=True):
        return launch.softcap_mode(30.0, SimpleNamespace(is_cuda=cuda, dtype=dtype))

    monkeypatch.setattr(launch, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(launch, "HARDWARE_TANH", True)
    assert launch.softcap_mode(0.0, SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)) == 0
    assert [mode(torch.bfloat16), mode(torch.float16), mode(torch.float32)] == [2, 1, 1]
    assert mode(torch.bfloat16, cuda=False) == 1
    monkeypatch.setattr(launch, "HARDWARE_TANH", False)
    assert mode(torch.bfloat16) == 1
    monkeypatch.setattr(launch, "HARDWARE_TANH", True)
    monkeypatch.setattr(launch, "interpreter_enabled", lambda: True)
    assert mode(torch.bfloat16) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["logits", "linear"])
def test_gpu_bf16_softcap_by_the_tanh_instruction_within_budget(fn, monkeypatch):
    """bf16 logits with Gemma 2's softcap (30) on the GPU: the loss and its gradients through the
    tanh instruction within bf16's budget of eager PyTorch (Gemma 2's softcap in bf16, then the
    loss in fp32) against fp64; and the instruction really ran (its results are not the exact
    tanh's, which ``SURGERY_HARDWARE_TANH=0`` keeps)."""
    launch = importlib.import_module("surgery.kernels.cross_entropy.launch")
    n, v, cap = 64, 4099, 30.0
    z = spread_logits((n, v), cap, seed=8).cuda().to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(9)).cuda()
    x64 = z.double().requires_grad_()
    ref = reference64(x64, labels, -100, "mean", softcap=cap)
    (gref,) = torch.autograd.grad(ref, x64)
    zb = z.detach().clone().requires_grad_()
    eager = F.cross_entropy((cap * torch.tanh(zb / cap)).float(), labels)
    (geager,) = torch.autograd.grad(eager, zb)

    def run():
        x = z.detach().clone().requires_grad_()
        if fn == "logits":
            loss = cross_entropy(x, labels, softcap=cap).loss
        else:
            w = torch.eye(v, device="cuda", dtype=torch.bfloat16)
            loss = linear_cross_entropy(x, w, labels, softcap=cap).loss
        return loss, torch.autograd.grad(loss, x)[0]

    loss, grad = run()
    assert_close_budget(loss, ref, eager, torch.bfloat16, what="loss")
    assert_close_budget(grad, gref, geager, torch.bfloat16, what="grad")
    monkeypatch.setattr(launch, "HARDWARE_TANH", False)
    _, exact_grad = run()
    assert not torch.equal(grad, exact_grad), "the tanh instruction did not run"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("cap", list(SOFTCAPS.values()), ids=list(SOFTCAPS))
@pytest.mark.parametrize("fn", ["logits", "linear"])
def test_softcap_loss_and_grads_fp32(path, fn, cap, reduction):
    """Loss (per token for "none") and gradients against fp64 to ``strict_rtol``, on logits that
    span the whole range of the tanh; "mean" and "none" take the eager and recompute schedules of
    linear_cross_entropy."""
    n, v = 24, 257
    logits = spread_logits((n, v), cap, seed=6).to(path)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(7)).to(path)
    out, inputs = run_loss(fn, logits, labels, reduction=reduction, softcap=cap)
    x64 = logits.double().requires_grad_()
    ref = reference64(x64, labels, -100, reduction, softcap=cap)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=STRICT, atol=0)
    g = upstream(ref)
    got = torch.autograd.grad((out.loss * g.to(out.loss.device, torch.float32)).sum(), inputs)
    (gref,) = torch.autograd.grad((ref * g.to(ref.device)).sum(), x64)
    for name, a, r in zip(("grad_logits", "grad_weight"), got, input_grads(gref, x64.detach(), fn)):
        assert rel_err(a, r) <= STRICT, f"{name}: rel err {rel_err(a, r):.2e}"


STATISTIC_NAMES = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "predicted")


def statistics_reference(logits: torch.Tensor, labels: torch.Tensor, softcap):
    """The statistics in fp64 of the softmax of the (softcapped) logits; a token without a
    target gets 0 (False, -1 for the prediction)."""
    x = logits.double()
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    log_p = torch.log_softmax(x, -1)
    valid = (labels >= 0) & (labels < x.shape[-1])
    first = x.argmax(-1)
    values = {
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, -1),
        "mean_logits": x.mean(-1),
        "is_top1": first == labels,
        "predicted": first,
    }
    fill = {"is_top1": False, "predicted": -1}
    return {k: torch.where(valid, v, fill.get(k, 0.0)) for k, v in values.items()}


@pytest.mark.parametrize("reduction", ["mean", "none", "sequence-shift"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_statistics_over_logits_are_those_of_the_softmax_the_loss_sees(path, softcap, reduction):
    """``cross_entropy_statistics``: every statistic against fp64 (ties taken as argmax takes
    them: the first maximum), and the loss, z-loss and gradient exactly ``cross_entropy``'s;
    with ``shift`` a token's statistics are those of its own logits against the next label."""
    from surgery.kernels import cross_entropy_statistics

    shift = reduction.endswith("-shift")
    labels = make_labels(-100, path)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(path)
    top = logits.argmax(-1)
    labels[:, int(shift) :: 3] = top[:, ::3][:, : len(range(int(shift), T, 3))]  # some top-1s
    logits[0, 0, [4, 9]] = logits[0, 0].max() + 1.0  # a tie at the top: column 4 is the argmax
    labels[0, int(shift)] = 9
    reduction = reduction.removesuffix("-shift")
    kw = dict(reduction=reduction, softcap=softcap, z_loss_scale=1e-3, label_smoothing=0.1,
              shift=shift)  # fmt: skip
    z1 = logits.clone().requires_grad_()
    (loss, z_loss), stats = cross_entropy_statistics(z1, labels, statistics=STATISTIC_NAMES, **kw)
    z2 = logits.clone().requires_grad_()
    want = cross_entropy(z2, labels, **kw)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=0)
    torch.testing.assert_close(z_loss, want.z_loss, rtol=0, atol=0)
    upstream = torch.rand_like(loss) + 0.5
    (g1,) = torch.autograd.grad((loss * upstream).sum(), z1)
    (g2,) = torch.autograd.grad((want.loss * upstream).sum(), z2)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    targets = labels
    if shift:  # the next label of the same row; none for a row's last token
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    ref = statistics_reference(logits, targets, softcap)
    assert set(stats) == set(STATISTIC_NAMES)
    for name in ("entropy", "log_sum_sq_probs", "mean_logits"):
        assert stats[name].shape == labels.shape and stats[name].dtype == torch.float32
        assert not stats[name].requires_grad
        torch.testing.assert_close(stats[name].double(), ref[name], rtol=1e-5, atol=1e-5)
    assert stats["is_top1"].dtype == torch.bool and torch.equal(stats["is_top1"], ref["is_top1"])
    assert stats["is_top1"].any() and not stats["is_top1"][0, 0]  # the later of the tied columns
    assert stats["predicted"].dtype == torch.int64
    assert torch.equal(stats["predicted"], ref["predicted"]) and stats["predicted"][0, 0] == 4


def test_statistics_over_logits_asked_for_alone():
    """Only the statistics asked for come back; an unknown name is refused."""
    from surgery.kernels import cross_entropy_statistics

    logits = torch.randn(5, V, device=DEVICE)
    labels = torch.randint(0, V, (5,), device=DEVICE)
    _, stats = cross_entropy_statistics(logits, labels, statistics=("predicted",))
    assert list(stats) == ["predicted"]
    assert torch.equal(stats["predicted"], logits.argmax(-1))
    with pytest.raises(ValueError, match="unknown statistics"):
        cross_entropy_statistics(logits, labels, statistics=("log_probs",))


def test_is_top1_is_argmax_whatever_block_holds_the_target_or_its_ties():
    """The kernel sweeps a row in blocks of its BLOCK_V columns: the target alone, or tied at the
    maximum with a column in an earlier block, in its own block before or after it, at a block's
    first and last column. ``is_top1`` and ``predicted`` are argmax's (the first maximum)."""
    from surgery.kernels import cross_entropy_statistics
    from surgery.kernels.cross_entropy.kernel import FWD_BLOCK_V as BLOCK

    v = 2 * BLOCK + 808  # three blocks, the last partial
    cases = [  # (target, columns at the maximum)
        (BLOCK + 904, [100, BLOCK + 904]),  # tie in an earlier block
        (BLOCK + 904, [BLOCK + 404, BLOCK + 904]),  # tie earlier in the target's block
        (BLOCK + 904, [BLOCK + 904, 2 * BLOCK + 700]),  # tie in a later block
        (BLOCK + 904, [BLOCK + 904]),  # the target alone
        (100, [BLOCK + 1904]),  # the maximum in a later block
        (BLOCK - 1, [0, BLOCK - 1]),  # the target a block's last column
        (BLOCK, [BLOCK - 1, BLOCK]),  # the target a block's first column
        (BLOCK, [BLOCK, v - 1]),  # and the row's last column tied after it
        (-100, [7]),  # no target
    ]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(cases), v, generator=g)
    labels = torch.tensor([t for t, _ in cases])
    for row, (_, tops) in enumerate(cases):
        logits[row, tops] = 10.0
    logits, labels = logits.to(DEVICE), labels.to(DEVICE)
    _, stats = cross_entropy_statistics(logits, labels, statistics=("is_top1", "predicted"))
    first = logits.argmax(-1)
    valid = labels >= 0
    assert stats["is_top1"].tolist() == (valid & (first == labels)).tolist()
    assert stats["is_top1"].tolist() == [False, False, True, True, False, False, False, True, False]
    assert stats["predicted"].tolist() == torch.where(valid, first, -1).tolist()


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_minus_infinity_logits_are_masked_columns(path, softcap):
    """Logits of -inf (a vocabulary masked by the caller) are columns of probability 0, as
    ``F.cross_entropy`` takes them (under a softcap, logits of -cap): the loss, z-loss, gradient
    and statistics finite and those of the columns left, whether the kernel's first block is
    masked whole (its running maximum starts at -inf), columns are masked within blocks and the
    last, partial block, or every column but the target's (a loss and an entropy of 0)."""
    from surgery.kernels import cross_entropy_statistics
    from surgery.kernels.cross_entropy.kernel import FWD_BLOCK_V as BLOCK

    v = 2 * BLOCK + 808
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, v, generator=g) * 2
    logits[0, : BLOCK + 17] = float("-inf")  # the first block whole, and into the second
    logits[1, 3::5] = float("-inf")  # within every block, the partial last one too
    logits[2] = float("-inf")
    logits[2, 2 * BLOCK + 5] = 1.5  # the target the only column left
    logits[3, :BLOCK] = float("-inf")
    labels = torch.tensor([BLOCK + 20, 4, 2 * BLOCK + 5, 2 * BLOCK + 1, -100])
    logits, labels = logits.to(path), labels.to(path)
    z = logits.clone().requires_grad_()
    (loss, z_loss), stats = cross_entropy_statistics(
        z, labels, statistics=("entropy", "log_sum_sq_probs", "is_top1", "predicted"),
        reduction="none", softcap=softcap, z_loss_scale=1e-3,
    )  # fmt: skip
    x64 = logits.detach().double().requires_grad_()
    want = reference64(x64, labels, -100, "none", z_loss_scale=1e-3, softcap=softcap)
    up = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    (grad,) = torch.autograd.grad((loss * up.to(path, torch.float32)).sum(), z)  # z-loss in it
    (grad64,) = torch.autograd.grad((want * up.to(path)).sum(), x64)
    assert torch.isfinite(loss).all() and torch.isfinite(z_loss).all()
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-5, atol=1e-6)
    x = logits.double() if softcap is None else softcap * torch.tanh(logits.double() / softcap)
    p = torch.softmax(x, -1)
    entropy = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)
    valid = labels >= 0
    torch.testing.assert_close(stats["entropy"].double(), torch.where(valid, entropy, 0.0),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    sum_sq = torch.where(valid, (p * p).sum(-1).log(), 0.0)
    torch.testing.assert_close(stats["log_sum_sq_probs"].double(), sum_sq, rtol=1e-5, atol=1e-5)
    assert stats["is_top1"].tolist() == (valid & (x.argmax(-1) == labels)).tolist()
    if softcap is None:  # under a softcap, -inf is the cap's floor, not a masked column
        assert stats["is_top1"][2] and stats["entropy"][2].abs() < 1e-6
        assert (loss[2] - z_loss[2]).abs() < 1e-6


@pytest.mark.parametrize("inv_temperature", [1.0, 1.0 / 0.7], ids=["T1", "T0.7"])
def test_a_confident_rows_loss_keeps_its_digits(path, inv_temperature):
    """Rows whose target leads the others by 10 to 25 (losses from ~1e-4 down to ~1e-15) at
    logits near 30 and near 100: each loss within 3e-7 of fp64's and never negative, as from the
    target's own exponent taken as a difference first (log s - (x_t - m)); lse - x_t, lse
    rounded at the logits' size first, is off by up to ~4e-6, and an exponent x k - m k whose
    reference m k is rounded there (one fused multiply-add) by as much, either sign. A target
    behind by as much (a loss near 15) as close relatively."""
    g = torch.Generator().manual_seed(8)
    offsets = torch.tensor([30.0, 30.0, 30.0, 100.0, 100.0, 100.0, 30.0])[:, None]
    logits = offsets + 3.0 * torch.randn(7, V, generator=g)
    labels = torch.tensor([3, 8, 20, 36, 0, 11, 5])
    rows = torch.arange(7)
    lead = torch.tensor([10.0, 15.0, 25.0, 10.0, 15.0, 25.0, -15.0]) / inv_temperature
    logits[rows, labels] = logits.amax(-1) + lead
    _, ce, _ = ce_mod.cross_entropy_fwd(logits.to(path), labels.to(path),
                                        inv_temperature=inv_temperature)  # fmt: skip
    ce = ce.double().cpu()
    x = logits.double() * inv_temperature
    want = -torch.log_softmax(x, -1).gather(1, labels[:, None])[:, 0]
    assert (want[:6] < 1e-3).all() and want[6] > 10  # six confident rows, one far off
    assert (ce >= 0).all(), ce
    torch.testing.assert_close(ce[:6], want[:6], rtol=0, atol=3e-7)
    torch.testing.assert_close(ce[6], want[6], rtol=1e-6, atol=0)


def test_minus_infinity_logits_with_label_smoothing_give_an_infinite_loss(path):
    """Label smoothing spreads a share of the target over every column, a masked one's log-prob
    -inf among them: the loss is +inf as ``F.cross_entropy``'s (not nan), the target masked too."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, V, generator=g)
    logits[:2, 3] = float("-inf")
    labels = torch.tensor([3, 5, 7])  # the target masked, a masked column elsewhere, none
    out = cross_entropy(logits.to(path), labels.to(path), label_smoothing=0.1, reduction="none")
    want = reference64(logits, labels, -100, "none", label_smoothing=0.1)
    assert want[:2].isposinf().all() and torch.isfinite(want[2])
    torch.testing.assert_close(out.loss.double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_entropy_gradient_is_zero_at_minus_infinity_logits(path):
    """The backward with the entropy's gradient (``coef_entropy``) over logits with columns of
    -inf: 0 there and, on the other columns, the gradient of the vocabulary without them (fp64
    autograd of lse, ce and the entropy), not nan from +inf times a probability of 0."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, V, generator=g) * 2
    masked = torch.zeros(V, dtype=torch.bool)
    masked[::3] = True
    logits[:, masked] = float("-inf")
    labels = torch.tensor([1, 2, 4, -1])
    coef_ce, coef_z, coef_ent = (torch.rand(4, generator=g) + 0.5 for _ in range(3))
    kept = logits[:, ~masked].double().requires_grad_()
    target = torch.tensor([(~masked)[:t].sum().item() if t >= 0 else -1 for t in labels])
    lse = torch.logsumexp(kept, -1)
    log_p = kept - lse[:, None]
    entropy = -(log_p.exp() * log_p).sum(-1)
    valid = target >= 0
    ce = torch.where(valid, -log_p.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    total = (coef_ce * ce + coef_z * torch.where(valid, 1e-3 * lse**2, 0.0)).sum()
    total = total + (torch.where(valid, coef_ent, 0.0) * entropy).sum()
    (want_kept,) = torch.autograd.grad(total, kept)
    want = torch.zeros(4, V, dtype=torch.float64)
    want[:, ~masked] = want_kept
    on = lambda t: t.to(path)
    grad = torch.empty(4, V, device=path)
    ce_mod.cross_entropy_bwd(on(logits), on(labels), on(lse.detach().float()), on(coef_ce),
                             on(coef_z), grad, z_loss_scale=1e-3,
                             entropy=on(entropy.detach().float()),
                             coef_entropy=on(coef_ent))  # fmt: skip
    assert torch.isfinite(grad).all() and (grad[:, masked] == 0).all()
    torch.testing.assert_close(grad.double().cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
def test_bf16_gradients_are_their_fp32_values_rounded_to_nearest(softcap):
    """The logits' gradient stored in bf16, by the forward's second sweep and by the backward
    kernel, is the fp32 gradient the same call stores into an fp32 buffer, rounded once to
    nearest even, as a GPU rounds it, the interpreter too (it truncates a bare conversion)."""
    g = torch.Generator().manual_seed(7)
    logits = (4.0 * torch.randn(6, 300, generator=g)).to(DEVICE, torch.bfloat16)
    targets = torch.randint(0, 300, (6,), generator=g).to(DEVICE)
    coef = torch.full((6,), 0.37, device=DEVICE)
    grads = {}
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(logits.shape, dtype=dtype, device=DEVICE)
        lse, _, _ = ce_mod.cross_entropy_fwd(logits, targets, softcap=softcap, coef_ce=coef,
                                             coef_z=coef, grad_out=out)  # fmt: skip
        back = torch.empty(logits.shape, dtype=dtype, device=DEVICE)
        ce_mod.cross_entropy_bwd(logits, targets, lse, coef, coef, back, softcap=softcap)
        grads[dtype] = out, back
    for got, want in zip(grads[torch.bfloat16], grads[torch.float32], strict=True):
        assert torch.equal(got, want.bfloat16())


def test_statistics_over_logits_trace_with_fullgraph_compile():
    """The op with its statistics is opaque to dynamo: the loss, the statistics and the gradient
    trace in one graph and equal eager's."""
    from surgery.kernels import cross_entropy_statistics

    logits = torch.randn(B, T, V, device=DEVICE, requires_grad=True)
    labels = make_labels(-100, DEVICE)

    def step(z, labels):
        (loss, z_loss), stats = cross_entropy_statistics(
            z, labels, statistics=STATISTIC_NAMES, reduction="sequence", shift=True,
            z_loss_scale=1e-3, softcap=5.0,
        )  # fmt: skip
        return loss, z_loss, *(stats[name] for name in STATISTIC_NAMES)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = compiled(logits, labels), step(logits, labels)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (g_got,) = torch.autograd.grad(got[0], logits)
    (g_want,) = torch.autograd.grad(want[0], logits)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)
