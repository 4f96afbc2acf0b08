"""``surgery.kernels.shared_input_linear``: several linear layers over one input, the input's
gradient summed inside the backward's matrix products (``addmm_``) instead of by adds after them.

Against independent references: the outputs and the weight and bias gradients are those of
separate ``F.linear`` calls bit for bit (the same products on the same operands); the input's
gradient is the same sum rounded in another order, checked against an fp64 run of the separate
calls within the dtype's budget (and exactly in fp64, where no rounding is left).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surgery.kernels.shared_input_linear import SharedInputLinearFunction, shared_input_linear
from tests.utils import TOLERANCES

OUTS = (24, 8, 8)  # q, k, v of a tiny GQA attention


def operands(dtype, device, bias=(False, True, False), seed=0, tokens=(2, 5), hidden=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, hidden, generator=g)
    ws = [torch.randn(o, hidden, generator=g) / hidden**0.5 for o in OUTS]
    bs = [torch.randn(o, generator=g) if b else None for o, b in zip(OUTS, bias)]
    dys = [torch.randn(*tokens, o, generator=g) for o in OUTS]
    move = lambda t: None if t is None else t.to(device, dtype)
    return move(x), [move(w) for w in ws], [move(b) for b in bs], [move(d) for d in dys]


def run(fn, x, ws, bs, dys, reached=(True, True, True)):
    """(outputs, dx, dws, dbs) of ``fn(x, ws, bs)`` with ``dys`` into the reached outputs."""
    x = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in ws]
    bs = [None if b is None else b.detach().clone().requires_grad_() for b in bs]
    outs = fn(x, ws, bs)
    loss = sum((o * d).sum() for o, d, r in zip(outs, dys, reached) if r)
    loss.backward()
    return (
        [o.detach() for o in outs],
        x.grad,
        [w.grad for w in ws],
        [None if b is None else b.grad for b in bs],
    )


def separate(x, ws, bs):
    return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_parameter_gradients_are_separate_linears_bit_for_bit(dtype, device):
    ops = operands(dtype, device)
    got, want = run(shared_input_linear, *ops), run(separate, *ops)
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    for g, w in zip(got[2], want[2]):
        assert torch.equal(g, w)
    assert got[3][0] is None and got[3][2] is None
    assert torch.equal(got[3][1], want[3][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_gradient_within_the_dtype_budget_of_fp64(dtype, device):
    ops = operands(dtype, device)
    ref = run(separate, *operands(torch.float64, device))[1]
    eager = run(separate, *ops)[1]
    got = run(shared_input_linear, *ops)[1]
    assert got.dtype == dtype
    err = (got.double() - ref).abs().max().item()
    eager_err = (eager.double() - ref).abs().max().item()
    tol = TOLERANCES[dtype]
    assert err <= tol["factor"] * eager_err + tol["floor"] * ref.abs().max().item()


def test_input_gradient_exact_in_fp64(device):
    ops = operands(torch.float64, device)
    got, want = run(shared_input_linear, *ops), run(separate, *ops)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


def test_gradcheck():
    x, ws, bs, _ = operands(torch.float64, torch.device("cpu"), tokens=(3,), hidden=6)

    def fn(x, w0, w1, w2, b1):
        return shared_input_linear(x, [w0, w1, w2], [None, b1, None])

    inputs = [t.requires_grad_() for t in (x, *ws, bs[1])]
    assert torch.autograd.gradcheck(fn, inputs)


def test_outputs_the_loss_does_not_reach_and_frozen_weights(device):
    """An output without a gradient adds nothing to the input's; a weight without
    ``requires_grad`` gets none (and its product is not run)."""
    ops = operands(torch.float32, device)
    reached = (True, False, True)
    got = run(shared_input_linear, *ops, reached=reached)
    want = run(separate, *ops, reached=reached)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert got[2][1] is None and want[2][1] is None

    x, ws, bs, dys = ops
    x = x.clone().requires_grad_()
    frozen = [w.clone() for w in ws]
    trained = frozen[0].requires_grad_()
    outs = shared_input_linear(x, frozen, bs)
    sum((o * d).sum() for o, d in zip(outs, dys)).backward()
    assert trained.grad is not None and frozen[1].grad is None and frozen[2].grad is None
    assert x.grad is not None


def test_saves_the_input_once(device):
    """What the backward keeps: the input and the weights, nothing per layer."""
    x, ws, bs, _ = operands(torch.float32, device)
    x.requires_grad_()
    ws = [w.requires_grad_() for w in ws]
    outs = shared_input_linear(x, ws, bs)
    saved = outs[0].grad_fn.saved_tensors
    assert len(saved) == 1 + len(ws)
    assert saved[0].data_ptr() == x.data_ptr()
    assert outs[0].grad_fn.name() == f"{SharedInputLinearFunction.__name__}Backward"


def test_rejects_mismatched_operands():
    x, ws, bs, _ = operands(torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one"):
        shared_input_linear(x, [])
    with pytest.raises(ValueError, match="each weight must be"):
        shared_input_linear(x, [ws[0][:, :-1]])
    with pytest.raises(ValueError, match="biases"):
        shared_input_linear(x, ws, bs[:2])
    with pytest.raises(ValueError, match="bias of shape"):
        shared_input_linear(x, ws[:1], [torch.zeros(3)])
    with pytest.raises(TypeError, match="dtype"):
        shared_input_linear(x, [ws[0].double()])


def test_summed_input_grad_op():
    from torch.library import opcheck

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, o, generator=g) for o in OUTS]
    weights = [torch.randn(o, 16, generator=g) for o in OUTS]
    op = torch.ops.surgery.summed_input_grad.default
    torch.testing.assert_close(
        op(grads, weights), sum(gr @ w for gr, w in zip(grads, weights)), rtol=1e-5, atol=1e-5
    )
    opcheck(op, (grads, weights))


def test_compiled_matches_eager_and_runs_the_op():
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    ops = operands(torch.float32, torch.device("cpu"))
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(shared_input_linear, backend=backend, fullgraph=True)
    got, want = run(compiled, *ops), run(shared_input_linear, *ops)
    for a, b in zip(got[0] + [got[1]] + got[2], want[0] + [want[1]] + want[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    backward = [str(n.target) for gm in backend.bw_graphs for n in gm.graph.nodes]
    assert "surgery.summed_input_grad.default" in backward
    assert not any("addmm" in t for t in backward)  # no out-of-place addmm (it copies first)


@pytest.mark.gpu
def test_gpu_llama_shapes():
    """Llama ~1B's q/k/v (2048 -> 2048, 512, 512) and gate/up (2048 -> 8192, 8192) over 8192 bf16
    tokens on the GPU: outputs and weight gradients bit for bit the separate layers', the input
    gradient within the bf16 budget of an fp32 run of the separate layers."""
    cuda = torch.device("cuda")
    for outs in ((2048, 512, 512), (8192, 8192)):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 4096, 2048, generator=g)
        ws = [torch.randn(o, 2048, generator=g) / 2048**0.5 for o in outs]
        dys = [torch.randn(2, 4096, o, generator=g) for o in outs]
        bs = [None] * len(outs)

        def on(dtype, x=x, ws=ws, dys=dys, bs=bs):
            return (
                x.to(cuda, dtype),
                [w.to(cuda, dtype) for w in ws],
                bs,
                [d.to(cuda, dtype) for d in dys],
            )

        got = run(shared_input_linear, *on(torch.bfloat16))
        want = run(separate, *on(torch.bfloat16))
        ref = run(separate, *on(torch.float32))[1].double()
        assert all(torch.equal(a, b) for a, b in zip(got[0] + got[2], want[0] + want[2]))
        err = (got[1].double() - ref).abs().max().item()
        eager_err = (want[1].double() - ref).abs().max().item()
        tol = TOLERANCES[torch.bfloat16]
        assert err <= tol["factor"] * eager_err + tol["floor"] * ref.abs().max().item()
