"""``linear_cross_entropy`` under ``torch.autocast`` (bf16 and fp16), with fp32 weights: what HF
Trainer(bf16=True) and accelerate's mixed precision run.

The bar is the unpatched computation under the same autocast: transformers' ``lm_head(hidden)``
(``F.linear``: hidden, weight and bias cast to the autocast dtype, logits in that dtype), the final
softcap applied to those logits, then the loss on ``logits.float()``. Error budget
(``tests.utils.TOLERANCES``): against the fp32 reference on the same (uncast) inputs, the kernel's
error may exceed that eager computation's error by the TOLERANCES margin of the autocast dtype. The
rule behind it (see ``linear_cross_entropy``): under autocast the inputs are cast on entry as
``F.linear`` casts them and nothing after that depends on autocast, so the result is bit for bit
that of the same call, without autocast, on the cast inputs.

The other kernels' autocast tests sit beside their own tests (test_rms_norm.py, test_rope.py,
test_gated_activation.py); whole models under autocast in tests/surgery/test_autocast.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surgery.kernels import (
    cross_entropy_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from tests.utils import DEVICE, assert_close_budget

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Which dtypes hidden and weight arrive in: both fp32 (an fp32 model), or hidden already in the
# autocast dtype (the output of an autocast matmul) with the fp32 weight of the model.
INPUTS = ["fp32", "mixed"]
CASES = {
    "plain": dict(),
    "bias": dict(bias=True),
    "softcap": dict(softcap=3.0),
    "bias-softcap": dict(bias=True, softcap=3.0, z_loss_scale=1e-3),
    "low_memory": dict(low_memory=True, softcap=3.0),
    "none": dict(reduction="none", bias=True),
}


def make_inputs(n, d, v, hidden_dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(DEVICE, hidden_dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(DEVICE).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(DEVICE).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    return x, w, b, labels.to(DEVICE)


def autocast(dtype):
    return torch.autocast(DEVICE.type, dtype=dtype)


def eager_under_autocast(x, w, b, labels, dtype, softcap=None, **kw):
    """transformers' unpatched path: logits = lm_head(hidden) under autocast, the final softcap on
    them (Gemma 2/3), then the loss on logits.float()."""
    with autocast(dtype):
        logits = F.linear(x, w, b)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
    assert logits.dtype == dtype
    return cross_entropy_reference(logits, labels, **kw)


def loss_and_grads(out, leaves, g_loss):
    loss = (out.loss * g_loss).sum() + (out.z_loss * g_loss).sum()
    return (out.loss.detach(), out.z_loss.detach(), *torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
def test_matches_eager_under_autocast(name, inputs, case):
    dtype = AUTOCAST_DTYPES[name]
    kw = dict(CASES[case])
    bias = kw.pop("bias", False)
    low_memory = kw.pop("low_memory", False)
    x, w, b, labels = make_inputs(37, 48, 1001, dtype if inputs == "mixed" else torch.float32, bias)
    leaves = [t for t in (x, w, b) if t is not None]
    n_out = 37 if kw.get("reduction") == "none" else 1
    g_loss = torch.randn(n_out, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    g_loss = g_loss.view(()) if n_out == 1 else g_loss

    with autocast(dtype):
        out = linear_cross_entropy(x, w, labels, b, low_memory=low_memory, **kw)
    got = loss_and_grads(out, leaves, g_loss)
    eager = loss_and_grads(eager_under_autocast(x, w, b, labels, dtype, **kw), leaves, g_loss)
    # Ground truth: the same definition in fp32 on fp32 copies of the inputs as given.
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    x32, w32, b32 = leaves32 if bias else (*leaves32, None)
    ref = loss_and_grads(linear_cross_entropy_reference(x32, w32, labels, b32, **kw), leaves32,
                         g_loss)  # fmt: skip

    assert out.loss.dtype == out.z_loss.dtype == torch.float32
    names = ("loss", "z_loss", "grad_hidden", "grad_weight", "grad_bias")
    for what, a, r, e in zip(names, got, ref, eager):
        assert a.dtype == e.dtype and a.shape == e.shape, what
        assert_close_budget(a, r, e, dtype, f"{name} {inputs} {case} {what}")


@pytest.mark.parametrize("backward", ["outside", "inside"])
@pytest.mark.parametrize("low_memory", [False, True], ids=["eager", "recompute"])
@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
def test_autocast_is_a_cast_on_entry(name, low_memory, backward):
    """Under autocast: bit for bit the same call without autocast on inputs cast to the autocast
    dtype, the gradients reaching the fp32 weight and bias through the cast. Nothing inside the
    kernel (its matrix products) runs under autocast, wherever the backward is called."""
    dtype = AUTOCAST_DTYPES[name]
    x, w, b, labels = make_inputs(37, 48, 1001, torch.float32, bias=True)
    kw = dict(softcap=3.0, z_loss_scale=1e-3, low_memory=low_memory)

    with autocast(dtype):
        out = linear_cross_entropy(x, w, labels, b, **kw)
        if backward == "inside":
            got = torch.autograd.grad(out.loss, (x, w, b))
    if backward == "outside":
        got = torch.autograd.grad(out.loss, (x, w, b))

    cast = [t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
    want = linear_cross_entropy(cast[0], cast[1], labels, cast[2], **kw)
    want_grads = torch.autograd.grad(want.loss, cast)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.z_loss, want.z_loss)
    for g, wg, leaf in zip(got, want_grads, (x, w, b)):
        assert g.dtype == leaf.dtype
        assert torch.equal(g, wg.to(leaf.dtype))


def test_autocast_traces_with_fullgraph_compile():
    """The cast on entry is traced by dynamo; the ops stay opaque: one graph, eager's answer."""
    x, w, b, labels = make_inputs(24, 16, 64, torch.float32, bias=True)

    def step(x, w, b):
        with autocast(torch.bfloat16):
            return linear_cross_entropy(x, w, labels, b, softcap=3.0).loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss_c = compiled(x, w, b)
    got = torch.autograd.grad(loss_c, (x, w, b))
    loss_e = step(x, w, b)
    want = torch.autograd.grad(loss_e, (x, w, b))
    torch.testing.assert_close(loss_c, loss_e)
    for a, e in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, e)


@pytest.mark.gpu
@pytest.mark.parametrize("low_memory", [False, True], ids=["eager", "recompute"])
def test_gpu_cuda_autocast_bf16_real_sizes(low_memory):
    """CUDA autocast bf16, fp32 hidden and weight at a real vocabulary size, several chunks."""
    x, w, _, labels = make_inputs(4096, 512, 32000, torch.float32, bias=False)
    chunk = 64 << 20  # several token chunks (eager) / vocabulary slices (recompute)
    leaves = (x, w)
    g_loss = torch.tensor(1.0, device=DEVICE)
    with autocast(torch.bfloat16):
        out = linear_cross_entropy(x, w, labels, softcap=30.0, low_memory=low_memory,
                                   chunk_bytes=chunk)  # fmt: skip
    got = loss_and_grads(out, leaves, g_loss)
    eager = loss_and_grads(
        eager_under_autocast(x, w, None, labels, torch.bfloat16, softcap=30.0), leaves, g_loss
    )
    leaves32 = [t.detach().clone().requires_grad_() for t in leaves]
    ref = loss_and_grads(
        linear_cross_entropy_reference(*leaves32, labels, softcap=30.0), leaves32, g_loss
    )
    for what, a, r, e in zip(("loss", "z_loss", "grad_hidden", "grad_weight"), got, ref, eager):
        assert a.dtype == e.dtype, what
        assert_close_budget(a, r, e, torch.bfloat16, what)
