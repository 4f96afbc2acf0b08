"""``shared_input_linear``: several linear layers over one input (an attention's q/k/v projections,
a gated MLP's gate and up), with the input's gradient summed inside the matrix products.

Called one by one, each projection's backward writes its own input gradient (tokens x hidden) and
autograd adds them up: for q/k/v two more tensors of that size written and an add kernel reading
three, every layer. Here the backward writes the first product and adds each further one into it
in the GEMM's epilogue (``torch.addmm``, beta 1), which reads the running sum once while the
product is computed:

    dx = g_1 W_1;  dx += g_2 W_2;  ...     (cuBLAS addmm_, the sum read in the epilogue)
    dW_i = g_i^T x,  db_i = sum over tokens of g_i

The forward is ``F.linear`` per layer (the layers' own outputs, bit for bit), and the weight and
bias gradients are the products and sums ``F.linear``'s backward runs. The input gradient is the
same sum in another order of rounding: each addition is rounded once to the input's dtype, as
autograd's accumulation rounds, but the addend is the fp32 product rather than its rounded value.
Saved for the backward: the input (once, as each layer would save it) and the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["SharedInputLinearFunction", "shared_input_linear"]


@torch.library.custom_op("surgery::summed_input_grad", mutates_args=())
def _summed_input_grad(grads: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    """``sum_i grads[i] @ weights[i]`` (2-D grads): the first product, then each further one added
    into it by an in-place ``addmm_`` (beta 1). An op of its own: under ``torch.compile`` an
    ``addmm`` in the graph runs out of place, and PyTorch's out-of-place addmm first copies the
    running sum into its output (a device-to-device copy as long as the add saved)."""
    dx = torch.mm(grads[0], weights[0])
    for g, w in zip(grads[1:], weights[1:]):
        dx.addmm_(g, w)
    return dx


@_summed_input_grad.register_fake
def _(grads, weights):
    return grads[0].new_empty(grads[0].shape[0], weights[0].shape[1])


class SharedInputLinearFunction(torch.autograd.Function):
    """``tuple(F.linear(x, w_i, b_i))`` with the backward of the module docstring; ``params`` is
    the weights, then one bias (or None) per weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *params: torch.Tensor | None):
        n = len(params) // 2
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.set_materialize_grads(False)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x, *weights = ctx.saved_tensors
        n = len(weights)
        need = ctx.needs_input_grad
        x2d = x.reshape(-1, x.shape[-1])
        dws: list[torch.Tensor | None] = [None] * n
        dbs: list[torch.Tensor | None] = [None] * n
        reached = []  # (2-D gradient, weight) of each output the loss reaches
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            g2d = g.reshape(-1, g.shape[-1])
            reached.append((g2d, w))
            if need[1 + i]:
                dws[i] = g2d.t().mm(x2d)
            if ctx.has_bias[i] and need[1 + n + i]:
                dbs[i] = g2d.sum(0)
        dx = None
        if need[0] and reached:
            gs, ws = zip(*reached)
            dx = _summed_input_grad(list(gs), list(ws)).view(x.shape)
        return (dx, *dws, *dbs)


def shared_input_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
    biases: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))`` (see the module docstring).
    x (..., in), each weight (out_i, in), each bias (out_i,) or None; all of one dtype and
    device. Outside autocast: the caller decides (``surgery.forwards.layers.projections`` calls the
    modules instead under autocast, whose casts it would otherwise have to repeat)."""
    if not weights:
        raise ValueError("shared_input_linear needs at least one weight")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights and {len(biases)} biases")
    for w, b in zip(weights, biases):
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(
                f"each weight must be (out, {x.shape[-1]}) for an input of shape "
                f"{tuple(x.shape)}, got {tuple(w.shape)}"
            )
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"a bias of shape {tuple(b.shape)} for a weight {tuple(w.shape)}")
        if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
            raise TypeError(
                f"weights and biases must have the input's dtype {x.dtype}, got {w.dtype}"
                + ("" if b is None else f" / {b.dtype}")
            )
    return SharedInputLinearFunction.apply(x, *weights, *biases)
