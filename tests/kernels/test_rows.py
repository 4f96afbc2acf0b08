"""The row-gather ops (``surgery.kernels.rows``) and the grouped weight-gradient loop
(``surgery.kernels.grouped_mm``): forward and gradients against their references, fake tensors
and autograd registration as torch.library checks them."""

from __future__ import annotations

import torch
from torch.library import opcheck

from surgery.attention.unpadding import padded_layout
from surgery.kernels.grouped_mm import grouped_weight_grad_loop, grouped_weight_grad_reference
from surgery.kernels.rows import (
    padded_rows,
    padded_rows_reference,
    real_rows,
    real_rows_reference,
    token_rows,
    token_rows_reference,
)


def test_padded_and_real_rows_are_each_others_backward():
    """``surgery::padded_rows`` and ``surgery::real_rows``: each the other's backward (gathers)."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    layout = padded_layout(mask, (mask - 1) * 100, -100, unpad=True).layout  # padding ignored
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    full = padded_rows(x, *layout.layout)
    assert torch.equal(full, padded_rows_reference(x, *layout.layout))
    assert torch.equal(full[layout.index], x) and not full[layout.padding].any()
    assert torch.equal(real_rows(full, *layout.layout), x)
    assert torch.autograd.gradcheck(lambda t: padded_rows(t, *layout.layout), (x,))
    y = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    assert torch.equal(real_rows(y, *layout.layout), real_rows_reference(y, *layout.layout))
    assert torch.autograd.gradcheck(lambda t: real_rows(t, *layout.layout), (y,))
    opcheck(torch.ops.surgery.padded_rows.default, (x, *layout.layout))
    opcheck(torch.ops.surgery.real_rows.default, (y, *layout.layout))


def test_token_rows_backward_sums_each_tokens_slots():
    """Five tokens, two slots each, routed to three experts: the rows in expert order, and the
    backward (each token's slots summed in fp32, ``gather_sum``) equal to indexing's
    scatter-add."""
    top_k, tokens = 2, 5
    g = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 3, (tokens * top_k,), generator=g)
    perm = torch.argsort(experts, stable=True)  # slot j sits at row inverse[j]
    rows, inverse = perm // top_k, torch.argsort(perm)
    hidden = torch.randn(tokens, 4, generator=g, requires_grad=True)
    got = token_rows(hidden, rows, inverse, top_k)
    want = token_rows_reference(hidden, rows)
    assert torch.equal(got, want)
    grad = torch.randn(got.shape, generator=g)
    (got_grad,) = torch.autograd.grad(got, hidden, grad)
    (want_grad,) = torch.autograd.grad(want, hidden, grad)
    torch.testing.assert_close(got_grad, want_grad)  # two slots a token, summed in fp32
    opcheck(torch.ops.surgery.token_rows.default, (hidden, rows, inverse, top_k))


def test_grouped_weight_grad_loop_against_fp32_products():
    """Groups of 3, 0 (empty: zeros) and 4 rows."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=g)
    b = torch.randn(7, 6, generator=g)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    got = grouped_weight_grad_loop(a, b, offs)
    assert got.shape == (3, 5, 6) and not got[1].any()
    torch.testing.assert_close(got, grouped_weight_grad_reference(a, b, offs))
    opcheck(torch.ops.surgery.grouped_weight_grad_loop.default, (a, b, offs))
