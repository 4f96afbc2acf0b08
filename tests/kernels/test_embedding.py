"""``surgery.kernels.embedding``: ``F.embedding`` with its weight gradient from one op, bit for bit
the eager gradient, and under ``torch.compile`` that op instead of Inductor's decomposition."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs

from surgery.kernels import embedding, embedding_reference


def _grads(fn, indices, weight, upstream, **kw):
    w = weight.detach().clone().requires_grad_()
    out = fn(indices, w, **kw)
    out.backward(upstream)
    return out, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [{}, {"padding_idx": 3}, {"padding_idx": -2}, {"scale_grad_by_freq": True}],
    ids=["plain", "padding", "padding-negative", "by-frequency"],
)
def test_gradient_is_the_eager_one_bit_for_bit(dtype, options):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 24, generator=g).to(dtype)
    indices = torch.randint(0, 37, (3, 50), generator=g)
    indices[0, :7] = 3  # repeated rows (and the padding row)
    indices[1, :5] = 35
    upstream = torch.randn(3, 50, 24, generator=g).to(dtype)
    out, grad = _grads(embedding, indices, weight, upstream, **options)
    want_out, want_grad = _grads(embedding_reference, indices, weight, upstream, **options)
    assert torch.equal(out, want_out)
    assert torch.equal(grad, want_grad)
    if "padding_idx" in options:
        assert not grad[options["padding_idx"]].any()
    if dtype == torch.float32 and not options.get("scale_grad_by_freq"):
        # The rows that tokens selected, each token's gradient added once. (In bf16 the CPU
        # kernel, eager as ours, sums in bf16; on CUDA it sums in fp32.)
        rows = torch.zeros(37, 24).index_add_(0, indices.flatten(), upstream.flatten(0, 1))
        if "padding_idx" in options:
            rows[options["padding_idx"]] = 0
        torch.testing.assert_close(grad, rows, rtol=0, atol=1e-5)


def test_without_a_gradient_it_is_the_lookup():
    weight = torch.randn(10, 4)
    indices = torch.tensor([[1, 2, 9]])
    assert torch.equal(embedding(indices, weight), weight[indices])
    with torch.no_grad():
        out = embedding(indices, weight.requires_grad_())
    assert out.grad_fn is None


def test_compiled_backward_calls_the_op_not_a_decomposition():
    """Compiled, the backward graph holds ``surgery::embedding_backward`` (PyTorch's eager kernel)
    and no ``embedding_dense_backward``, which Inductor would turn into an fp32 copy of the table;
    the gradient is the eager one."""
    weight = torch.randn(50, 8, dtype=torch.bfloat16)
    indices = torch.randint(0, 50, (2, 30))
    upstream = torch.randn(2, 30, 8, dtype=torch.bfloat16)
    recorder = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda i, w: embedding(i, w) * 2, backend=recorder, fullgraph=True)
    _, grad = _grads(lambda i, w: compiled(i, w), indices, weight, upstream)
    _, want = _grads(lambda i, w: embedding_reference(i, w) * 2, indices, weight, upstream)
    assert torch.equal(grad, want)
    ops = [str(n.target) for gm in recorder.bw_graphs for n in gm.graph.nodes]
    assert "surgery.embedding_backward.default" in ops
    assert not any("embedding_dense_backward" in op for op in ops)


@pytest.mark.gpu
def test_compiled_backward_holds_no_fp32_table_on_the_gpu():
    """Inductor, bf16, a 151936 x 1024 table: the compiled step's gradient is the eager kernel's
    bit for bit, and the backward allocates the bf16 gradient and little else (Inductor's
    decomposition of ``F.embedding``'s backward holds an fp32 table, twice that, beside it)."""
    vocab, dim = 151936, 1024
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16)
    indices = torch.randint(0, vocab, (2, 4096), device="cuda")
    upstream = torch.randn(2, 4096, dim, device="cuda", dtype=torch.bfloat16)

    def peak_and_grad(fn):
        torch._dynamo.reset()
        step = torch.compile(lambda i, w: fn(i, w) * 2)
        _grads(step, indices, weight, upstream)  # compile
        w = weight.detach().clone().requires_grad_()
        out = step(indices, w)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out.backward(upstream)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, w.grad

    table = vocab * dim * 2
    peak, grad = peak_and_grad(embedding)
    decomposed_peak, _ = peak_and_grad(embedding_reference)
    _, eager = _grads(lambda i, w: embedding_reference(i, w) * 2, indices, weight, upstream)
    assert torch.equal(grad, eager)
    assert peak < 1.2 * table
    assert decomposed_peak > 2 * table  # what the op avoids, on this torch
