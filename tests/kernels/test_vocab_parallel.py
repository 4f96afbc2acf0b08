"""The vocabulary-parallel fused head on CPU ranks (gloo, 2 and 4 processes, Triton through the
interpreter): loss, z-loss and every gradient equal the unsharded head's (``linear_cross_entropy``
on the whole weight, and the fp32 PyTorch reference), for every reduction and option, odd
vocabulary sizes that do not divide evenly, a rank holding no row, a DTensor head and sequence-
parallel hidden states; in the schedule each rank took (its slice's logits kept from the forward,
or recomputed in the backward)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pytest
import torch

from surgery.kernels import (
    linear_cross_entropy,
    linear_cross_entropy_reference,
    linear_log_probs,
    linear_log_probs_reference,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_log_probs,
)
from surgery.kernels.linear_cross_entropy import LOW_MEMORY_CHUNK_BYTES
from tests.utils import gloo_rank, run_ranks

B, T, D = 2, 8, 16


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int = 37
    # Rows per rank (rank order); None: DTensor's Shard(0) split of the whole head.
    split: tuple[int, ...] | None = None
    options: dict = field(default_factory=dict)
    bias: bool = False
    sequence_parallel: bool = False
    dtensor: bool = False
    # The ranks pass the layout (vocab_start, vocab_size) instead of having it found.
    explicit_layout: bool = False
    # The per-token outputs (linear_log_probs) instead of the loss.
    log_probs: bool = False
    # bf16 hidden states and head: the fused products on each rank's slice (products.py)
    bf16: bool = False
    # Rows 0 and V - 1 (the first and last ranks') the same but for one bf16 step of one weight,
    # the row every token points along: their logits tie in bf16, not in fp32 (row V - 1 larger)
    near_tie: bool = False


def _log_probs_reference(hidden, weight, labels, bias=None, outputs=("log_probs",), **kw):
    """The fp32 reference's fields that ``outputs`` asks for (it computes them all)."""
    every = linear_log_probs_reference(hidden, weight, labels, bias, **kw)
    return every._replace(
        **{k: None for k in every._fields if k not in outputs and k != "log_probs"}
    )


# The one-GPU kernel, the fp32 reference and the vocabulary-parallel head, of each kind.
HEADS = {
    False: (linear_cross_entropy, linear_cross_entropy_reference,
            vocab_parallel_linear_cross_entropy),
    True: (linear_log_probs, _log_probs_reference, vocab_parallel_linear_log_probs),
}  # fmt: skip
EVERY_OUTPUT = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "predicted")


def _cases(world: int) -> list[Case]:
    seq = dict(reduction="sequence", position_ids=True)
    base = [
        Case("mean"),
        Case("sum-bias", options=dict(reduction="sum"), bias=True),
        Case("none-upstream", options=dict(reduction="none")),
        Case("sequence-packed", options=seq),
        Case(
            "z-loss-smoothing-softcap",
            options=dict(z_loss_scale=1e-2, label_smoothing=0.1, softcap=3.0),
        ),
        Case("shift-items-ignore", options=dict(shift=True, num_items_in_batch=11, ignore_index=5)),
        Case(
            "none-z-smoothing",
            options=dict(reduction="none", z_loss_scale=1e-3, label_smoothing=0.2),
        ),
        Case("explicit-layout", explicit_layout=True, options=dict(label_smoothing=0.05)),
        Case("dtensor-head", dtensor=True, bias=True, options=dict(z_loss_scale=1e-2)),
        Case("sequence-parallel", sequence_parallel=True, options=dict(seq, shift=True)),
        Case("sequence-parallel-none", sequence_parallel=True, options=dict(reduction="none")),
    ]
    # A rank with no row: more ranks than the head's last rows need.
    every = ("log_probs", *EVERY_OUTPUT)
    base += [
        Case("log-probs", log_probs=True),
        Case("log-probs-every-output", log_probs=True, bias=True,
             options=dict(outputs=every, temperature=0.7, shift=True)),
        Case("log-probs-scaled-capped", log_probs=True, sequence_parallel=True,
             options=dict(outputs=every, logit_scale=1.3, softcap=2.0)),
        Case("log-probs-dtensor", log_probs=True, dtensor=True,
             options=dict(outputs=("log_probs", "entropy", "is_top1"))),
    ]  # fmt: skip
    uneven = (0, 3) + (1,) * (world - 2)
    base.append(Case("rank-without-rows", vocab=sum(uneven), split=uneven,
                     options=dict(label_smoothing=0.1, z_loss_scale=1e-2)))  # fmt: skip
    base.append(Case("log-probs-rank-without-rows", vocab=sum(uneven), split=uneven,
                     log_probs=True, options=dict(outputs=every)))  # fmt: skip
    return base


def _inputs(case: Case):
    g = torch.Generator().manual_seed(len(case.name))
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(case.vocab, D, generator=g) / D**0.5
    bias = torch.randn(case.vocab, generator=g) if case.bias else None
    if case.near_tie:
        weight[-1] = weight[0] = weight[0].bfloat16().float()
        weight[-1, 0] = torch.nextafter(weight[0, 0].bfloat16(), torch.tensor(9.0).bfloat16())
        hidden += 12.0 * weight[0] / weight[0].norm()
        hidden[..., 0] = hidden[..., 0].abs() + 1.0  # the step raises row V - 1's logit
    labels = torch.randint(0, case.vocab, (B, T), generator=g)
    # Half the targets the largest logit (as the loss sees it: a negative logit scale turns the
    # order over), so that is_top1 is seen both ways.
    logits = hidden @ weight.T + (0 if bias is None else bias)
    argmax = (logits * case.options.get("logit_scale", 1.0)).argmax(-1)
    labels[:, ::2] = argmax[:, ::2]
    labels[0, 2] = labels[1, 5] = case.options.get("ignore_index", -100)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    upstream = torch.randn(B, T, generator=g)
    if case.bf16:
        hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    return hidden, weight, bias, labels, positions, upstream


def _kwargs(case: Case, positions):
    kw = dict(case.options)
    if kw.pop("position_ids", False):
        kw["position_ids"] = positions
    return kw


def _outputs(out, case: Case) -> dict:
    """Every output of a call, by name (booleans as numbers)."""
    if case.log_probs:
        return {k: v.detach().float() for k, v in out._asdict().items() if v is not None}
    return {"loss": out.loss.detach(), "z": out.z_loss.detach()}


def _backward(out, case: Case, upstream):
    """A different upstream gradient on every token and on each differentiable output."""
    if case.log_probs:
        total = (out.log_probs * upstream).sum()
        if out.entropy is not None:
            total = total + (out.entropy * upstream.flip(0)).sum()
    elif case.options.get("reduction") == "none":
        total = (out.loss * upstream).sum() + (out.z_loss * upstream.flip(0)).sum()
    else:
        total = out.loss + 0.5 * out.z_loss
    total.backward()


def _split(case: Case, world: int) -> list[int]:
    if case.split is not None:
        return list(case.split)
    chunk = -(-case.vocab // world)  # as DTensor's Shard(0) chunks rows
    return [max(0, min(chunk, case.vocab - r * chunk)) for r in range(world)]


def _run_case(case: Case, rank: int, world: int, mesh, kept_bf16: bool = False,
              sharded_kw: dict | None = None) -> dict:  # fmt: skip
    """The errors of this rank's sharded head against the unsharded kernel (and of the kernel
    against the fp32 reference). ``kept_bf16``: the kernel keeps its bf16 cuBLAS logits, whose
    first maximum at ``near_tie`` is the bf16 one (checked against ``argmax`` of them), not the
    fp32 reference's. ``sharded_kw``: more arguments of the sharded head."""
    hidden, weight, bias, labels, positions, upstream = _inputs(case)
    kw = _kwargs(case, positions)
    # The unsharded head: surgery's kernel and the fp32 PyTorch reference.
    kernel, reference, sharded = HEADS[case.log_probs]
    refs = {}
    for name, fn in (("kernel", kernel), ("reference", reference)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        b = None if bias is None else bias.clone().requires_grad_()
        out = fn(h, w, labels, b, **kw)
        _backward(out, case, upstream)
        refs[name] = dict(out=_outputs(out, case), dh=h.grad, dw=w.grad,
                          db=None if b is None else b.grad)  # fmt: skip
    sizes = _split(case, world)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    if case.dtensor:
        from torch.distributed.tensor import Shard, distribute_tensor

        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        b = None if bias is None else distribute_tensor(bias.clone(), mesh, [Shard(0)])
        b = None if b is None else b.requires_grad_()
    else:
        w = weight[rows].clone().requires_grad_()
        b = None if bias is None else bias[rows].clone().requires_grad_()
    h_full = hidden.clone()
    if case.sequence_parallel:
        part = T // world
        cols = slice(rank * part, (rank + 1) * part)
        h = h_full[:, cols].clone().requires_grad_()
        mine_labels = labels[:, cols]
        if "position_ids" in kw:
            kw["position_ids"] = positions[:, cols]
    else:
        h, mine_labels = h_full.requires_grad_(), labels
    layout = dict(vocab_start=start, vocab_size=case.vocab) if case.explicit_layout else {}
    out = sharded(h, w, mine_labels, b, sequence_parallel=case.sequence_parallel, **layout, **kw,
                  **(sharded_kw or {}))  # fmt: skip
    _backward(out, case, upstream)
    want = refs["kernel"]
    dh_want = want["dh"][:, cols] if case.sequence_parallel else want["dh"]
    dw = w.grad.to_local() if case.dtensor else w.grad
    db = None if b is None else (b.grad.to_local() if case.dtensor else b.grad)
    got = _outputs(out, case)
    assert set(got) == set(want["out"]), (sorted(got), sorted(want["out"]))
    errors = {k: (got[k] - want["out"][k]).abs().max().item() for k in got}
    both = [(refs["kernel"][k], refs["reference"][k]) for k in ("dh", "dw")]
    first_max = ("is_top1", "predicted") if case.near_tie and kept_bf16 else ()
    both += [(refs["kernel"]["out"][k], refs["reference"]["out"][k]) for k in want["out"]
             if k not in first_max]  # fmt: skip
    if first_max:
        bf16_first = torch.where(labels >= 0, (hidden @ weight.T).argmax(-1), -1)
        errors["predicted_vs_bf16_argmax"] = float(
            not torch.equal(want["out"]["predicted"].long(), bf16_first)
        )
    errors.update(
        hidden_grad=(h.grad - dh_want).abs().max().item(),
        weight_grad=(dw - want["dw"][rows]).abs().max().item() if dw.numel() else 0.0,
        kernel_vs_reference=max((a - r).abs().max().item() for a, r in both),
        scale=max(want["dh"].abs().max().item(), want["dw"].abs().max().item()),
    )
    if case.log_probs and "is_top1" in got:
        # Both ways: some targets are the first maximum, some are not.
        errors["is_top1_seen_both_ways"] = float(
            not 0 < got["is_top1"].sum() < got["is_top1"].numel()
        )
    if db is not None:
        errors["bias_grad"] = (db - want["db"][rows]).abs().max().item() if db.numel() else 0.0
    return errors


BACKWARDS = ("lce_bwd_kept", "lce_bwd_recompute")


def _count_backwards(chunks: list | None = None) -> list:
    """The vocabulary-parallel head's backward ops, counted (in this rank's process): the names
    of those called, in order; ``chunks``: the slice budget each recompute was given."""
    module = importlib.import_module("surgery.kernels.vocab_parallel")
    calls = []
    for name in BACKWARDS:
        fn = getattr(module, name)

        def counted(*a, _fn=fn, _name=name):
            calls.append(_name)
            if chunks is not None and _name == "lce_bwd_recompute":
                chunks.append(a[10])  # chunk_bytes
            return _fn(*a)

        setattr(module, name, counted)
    return calls


def _holds_rows(case: Case, rank: int, world: int) -> bool:
    return _split(case, world)[rank] > 0


def _worker(rank: int, port: int, out: str, args: list) -> None:
    world, schedule, *cases = args
    sharded_kw = dict(low_memory=True) if schedule == "recompute" else {}

    def compute():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        chunks = []
        calls = _count_backwards(chunks)
        results = {}
        for case in cases:
            calls.clear()
            chunks.clear()
            results[case.name] = _run_case(case, rank, world, mesh, sharded_kw=sharded_kw)
            results[case.name]["backward"] = list(calls)
            results[case.name]["chunk_bytes"] = list(chunks)
        return results

    gloo_rank(rank, port, world, out, compute)


@pytest.mark.parametrize("schedule", ["kept", "recompute"])
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_head_equals_the_unsharded_head(world, schedule, tmp_path):
    """fp32: every rank's loss, z-loss, hidden gradient and its rows' weight and bias gradients
    equal the unsharded kernel's to fp32's summation-order noise (the kernel itself is checked
    against the fp32 PyTorch reference in the same run). ``kept``: each rank holding rows kept
    its slice's logits for the backward (three products; one holding none has nothing to keep);
    ``recompute`` (``low_memory=True``): every rank recomputed them."""
    cases = _cases(world)
    per_rank = run_ranks(_worker, world, tmp_path, [world, schedule, *cases])
    assert len(per_rank) == world
    failed = []
    by_name = {c.name: c for c in cases}
    for rank, results in enumerate(per_rank):
        assert set(results) == set(by_name)
        for name, errors in results.items():
            backward = errors.pop("backward")
            keeps = schedule == "kept" and _holds_rows(by_name[name], rank, world)
            want = BACKWARDS[0] if keeps else BACKWARDS[1]
            chunks = errors.pop("chunk_bytes")
            if schedule == "recompute" and chunks != [LOW_MEMORY_CHUNK_BYTES]:
                failed.append(f"rank {rank} {name}: low_memory recomputed in slices of {chunks}")
            if backward != [want]:
                failed.append(f"rank {rank} {name}: backward {backward}, not [{want}]")
            scale = max(errors.pop("scale"), 1.0)
            for key, err in errors.items():
                if not err <= 2e-5 * scale:
                    failed.append(f"rank {rank} {name} {key}: {err:.2e}")
    assert not failed, "\n".join(failed)


def test_vocab_parallel_head_refuses_a_layout_that_does_not_fit(tmp_path):
    """A start past the head's end is refused before any launch, on every rank."""
    per_rank = run_ranks(_refusing_worker, 2, tmp_path, [2])
    assert all("do not fit a head of 8 rows" in message for message in per_rank)


def _refusing_worker(rank: int, port: int, out: str, cases: list) -> None:
    def compute():
        try:
            vocab_parallel_linear_cross_entropy(
                torch.randn(4, 8), torch.randn(4, 8), torch.zeros(4, dtype=torch.long),
                vocab_start=6, vocab_size=8,
            )  # fmt: skip
        except ValueError as err:
            return str(err)
        return "no error"

    gloo_rank(rank, port, 2, out, compute)


def test_without_a_process_group_it_says_so():
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialised"):
        vocab_parallel_linear_cross_entropy(
            torch.randn(4, 8), torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
        )


BF16_CASES = [
    Case("bf16-mean", bf16=True),
    Case("bf16-none-upstream", bf16=True, options=dict(reduction="none", z_loss_scale=1e-2)),
    Case("bf16-softcap-z", bf16=True, options=dict(softcap=3.0, z_loss_scale=1e-3)),
    Case("bf16-explicit-layout", bf16=True, explicit_layout=True, options=dict(softcap=20.0)),
    Case("bf16-sequence-parallel", bf16=True, sequence_parallel=True,
         options=dict(reduction="none")),
    # the first maximum found across ranks as the fused products find it (fp32 logits)
    Case("bf16-near-tie-top1", bf16=True, log_probs=True, near_tie=True, vocab=301,
         options=dict(outputs=("log_probs", "is_top1", "predicted"))),
    # a temperature and a logit scale in each slice's products and its maximum's logit (a
    # negative scale: the ranks' maxima compare as the loss sees the logits, not as z does);
    # cap / T = 42.9: the log-sum-exp by the pieces' maxima
    Case("bf16-negative-scale-hot", bf16=True, log_probs=True, vocab=301,
         options=dict(outputs=("log_probs", *EVERY_OUTPUT), logit_scale=-1.0, temperature=0.7)),
    Case("bf16-softcap-hot", bf16=True, log_probs=True, vocab=301,
         options=dict(outputs=("log_probs", *EVERY_OUTPUT), softcap=30.0, temperature=0.7)),
    # label smoothing: no fused products (their gradient has no smoothing term), in the forward
    # either, whose log-sum-exp the backward's recomputed logits must share
    Case("bf16-smoothing", bf16=True, vocab=301, options=dict(label_smoothing=0.1)),
]  # fmt: skip


def _bf16_worker(rank: int, port: int, out: str, args: list) -> None:
    world, schedule, *cases = args

    def compute():
        from torch.distributed.device_mesh import init_device_mesh

        ops = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
        if schedule == "recompute":  # no call keeps its logits: the unsharded kernel's neither
            ops._reserve_kept = lambda device: None
        calls = []
        for name in ("lse_products", "grad_products", "softcap_products"):
            fn = getattr(ops, name)
            setattr(ops, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
        backward = _count_backwards()
        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for case in cases:
            calls.clear()
            backward.clear()
            results[case.name] = _run_case(case, rank, world, mesh, schedule == "kept")
            results[case.name]["fused"] = sorted(set(calls))
            results[case.name]["backward"] = list(backward)
        return results

    gloo_rank(rank, port, world, out, compute)


@pytest.mark.parametrize("schedule", ["kept", "recompute"])
def test_vocab_parallel_bf16_beside_the_unsharded_head(schedule, tmp_path):
    """bf16 on 2 ranks, in either schedule, the unsharded bf16 kernel in the same one: each rank's
    loss, z-loss and gradients equal the unsharded kernel's within bf16's rounding of the
    gradients (2^-8 of their largest, here 1e-2 of it: the two round different fp32 values).
    ``kept``: each rank keeps its slice's cuBLAS logits (as the unsharded kernel does a per-token
    head's), and the first maximum is found across the ranks as on them. ``recompute`` (no call
    may keep): each rank's slice takes the fused products, the forward's log-sum-exp and the
    backward's gradient product with the slice's column offset, and the unsharded kernel its
    fused recompute schedule; with label smoothing neither takes them, forward or backward."""
    per_rank = run_ranks(_bf16_worker, 2, tmp_path, [2, schedule, *BF16_CASES])
    smoothed = {case.name for case in BF16_CASES if case.options.get("label_smoothing")}
    failed = []
    for rank, results in enumerate(per_rank):
        for name, errors in results.items():
            fused, backward = errors.pop("fused"), errors.pop("backward")
            want = "lce_bwd_kept" if schedule == "kept" else "lce_bwd_recompute"
            if backward != [want]:
                failed.append(f"rank {rank} {name}: backward {backward}, not [{want}]")
            products = {"lse_products", "grad_products"}
            if schedule == "recompute" and name not in smoothed and not products <= set(fused):
                failed.append(f"rank {rank} {name}: fused products not taken ({fused})")
            if name in smoothed and fused:
                failed.append(f"rank {rank} {name}: fused products taken ({fused})")
            scale = max(errors.pop("scale"), 1.0)
            for key, err in errors.items():
                if not err <= 1e-2 * scale:
                    failed.append(f"rank {rank} {name} {key}: {err:.2e}")
    assert not failed, "\n".join(failed)


def _smoothing_worker(rank: int, port: int, out: str, args: list) -> None:
    world, smoothing = args

    def compute():
        g = torch.Generator().manual_seed(1)
        hidden = (3.0 * torch.randn(16, 16, generator=g)).bfloat16()
        weight = torch.randn(301, 16, generator=g).bfloat16()
        labels = torch.randint(0, 301, (16,), generator=g)
        rows = slice(0, 151) if rank == 0 else slice(151, 301)
        kw = dict(label_smoothing=smoothing, reduction="sum", low_memory=True)
        grads = {}
        for name, head, w in (("sharded", vocab_parallel_linear_cross_entropy, weight[rows]),
                              ("unsharded", linear_cross_entropy, weight)):  # fmt: skip
            h, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
            loss = head(h, w, labels, **kw).loss
            loss.backward()
            dw = w.grad if name == "sharded" else w.grad[rows]
            grads[name] = (loss.detach().float(), h.grad.float(), dw.float())
        errors = [(a - b).abs().max().item() for a, b in zip(*grads.values(), strict=True)]
        return dict(errors=errors, scale=grads["unsharded"][2].abs().max().item())

    gloo_rank(rank, port, world, out, compute)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_label_smoothing_in_bf16_recomputes_the_logits_of_its_log_sum_exp(smoothing, tmp_path):
    """bf16, large logits, the recompute schedule (``low_memory``): with label smoothing no slice
    takes the fused products, forward or backward, as the unsharded kernel takes none (their
    gradient has no smoothing term). A slice whose forward took them had the fp32 products'
    log-sum-exp while its backward recomputed bf16 logits against it: gradients off by a third of
    their largest. Each rank's loss and gradients equal the unsharded kernel's within bf16's
    rounding of the gradients (1e-2 of their largest)."""
    for result in run_ranks(_smoothing_worker, 2, tmp_path, [2, smoothing]):
        loss, dh, dw = result["errors"]
        bound = 1e-2 * result["scale"]
        assert loss <= 1e-3 and dh <= bound and dw <= bound, result


def _peaked_worker(rank: int, port: int, out: str, args: list) -> None:
    (world,) = args

    def compute():
        # Logits near 300, each token's target the largest by 16 (on rank 0) or below it (rank 1)
        hidden = torch.zeros(6, 4)
        weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        bias = torch.tensor([300.0, 290.0, 285.0, 284.0, 284.0, 280.0, 281.0, 283.0])
        labels = torch.tensor([0, 0, 1, 0, 4, 7])
        rows = slice(0, 4) if rank == 0 else slice(4, 8)
        sharded = vocab_parallel_linear_log_probs(hidden, weight[rows], labels, bias[rows])
        unsharded = linear_log_probs(hidden, weight, labels, bias)
        exact = linear_log_probs_reference(hidden.double(), weight.double(), labels,
                                           bias.double())  # fmt: skip
        errors = {name: (got.log_probs.double() - exact.log_probs).abs().tolist()
                  for name, got in (("sharded", sharded), ("unsharded", unsharded))}  # fmt: skip
        return {**errors, "exact": exact.log_probs.tolist()}

    gloo_rank(rank, port, world, out, compute)


def test_peaked_log_probs_keep_their_digits(tmp_path):
    """Large logits, the target the largest by 16 (a log-probability of about -1e-7): the sharded
    head's log-probabilities keep the unsharded kernel's digits (its loss is taken relative to
    the row's maximum, log s - (x_t - m)), where a difference of the whole vocabulary's
    log-sum-exp and the target's logit, both near 300, lost them: an error of 1.5e-5. A target
    on the rank without the peak: within a few fp32 steps of its log-probability (the ranks'
    log-sum-exps, near 300, differ there)."""
    for errors in run_ranks(_peaked_worker, 2, tmp_path, [2]):
        rows = zip(errors["sharded"], errors["unsharded"], errors["exact"], strict=True)
        for token, (sharded, unsharded, exact) in enumerate(rows):
            bound = 1e-10 if exact > -1.0 else 8 * 2.0**-23 * abs(exact)
            assert sharded <= 2 * unsharded + bound, (token, errors)


def _twice_worker(rank: int, port: int, out: str, args: list) -> None:
    def compute():
        case = Case("log-probs-twice", log_probs=True)
        hidden, weight, _, labels, _, upstream = _inputs(case)
        sizes = _split(case, 2)
        start = sum(sizes[:rank])
        w = weight[start : start + sizes[rank]].clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        calls = _count_backwards()
        out = vocab_parallel_linear_log_probs(h, w, labels, outputs=("log_probs", "entropy"))
        total = (out.log_probs * upstream).sum() + (out.entropy * upstream.flip(0)).sum()
        first = torch.autograd.grad(total, (h, w), retain_graph=True)
        second = torch.autograd.grad(total, (h, w))
        errors = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(first, second)]
        return {"backward": list(calls), "errors": errors}

    gloo_rank(rank, port, 2, out, compute)


def test_a_second_backward_recomputes_what_the_first_spent(tmp_path):
    """Through the same graph twice (``retain_graph``): the first backward turns each rank's kept
    logits into their gradient, the second recomputes them, and both give the same gradients."""
    for rank, result in enumerate(run_ranks(_twice_worker, 2, tmp_path, [])):
        assert result["backward"] == ["lce_bwd_kept", "lce_bwd_recompute"], (rank, result)
        assert max(result["errors"]) < 1e-5, (rank, result)
