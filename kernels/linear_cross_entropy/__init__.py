"""Fused linear cross entropy: the loss of ``hidden @ weight.T (+ bias)`` holding at most one
budgeted chunk of the (tokens x vocab) logits a call, however many tokens.

Three schedules share the row kernels of ``cross_entropy`` (cuBLAS does the matrix products):

* eager (default, any reduction but "none", when gradients are needed): tokens in chunks; for each
  chunk the logits are computed once, the row kernel turns them into the loss AND, in place, into
  the logit gradient for the known per-token weights, and the two gradient products follow at
  once. Three matrix products in all, the practical floor. The backward only scales the stored
  gradients by the upstream scalar. The weight gradient is accumulated in fp32 across chunks.
* kept (reduction "none" and per-token outputs, whose upstream gradient is known only in the
  backward, where the eager schedule's plan takes the tokens in one chunk and no other call's
  kept logits wait on the device; eager mode only): the forward keeps the logits; the backward
  writes their gradient in place of them and runs the two gradient products. Three products, the
  logits held from the forward to the backward (under ``skip_ignored``, recomputed instead where
  fewer than two thirds of the kept rows have a gradient: ``ops.kept_pays``). A softcapped head
  keeps the fused product's Q instead (below), with no pass over the logits at all; under an
  ``UpstreamHint`` this is taken rather than speculating on a uniform upstream gradient.
* recompute (``low_memory=True``, a per-token upstream gradient whose logits one chunk cannot
  hold or under ``torch.compile``, or a gradient reaching ``z_loss`` on its own): the forward
  keeps only the per-token logsumexp; the backward recomputes the logits one vocabulary slice at a
  time, so each slice of the weight gradient is complete after one product and no fp32 copy of
  the weight gradient exists. Four matrix products.

Extra memory is bounded by ``chunk_bytes`` (logits of one chunk, in the input dtype) plus, in the
recompute schedule, an fp32 hidden-gradient accumulator of at most twice it (rows in blocks), and
in the eager schedule with several chunks, one fp32 weight-sized accumulator (one chunk is taken,
and in the kept schedule held, up to twice that budget: ``plan_token_chunk``); it does not grow
with the number of tokens. Under ``torch.no_grad()`` only the loss is computed.

Under ``torch.autocast`` the public function casts hidden, weight and bias to the autocast dtype on
entry, as ``F.linear`` (transformers' ``lm_head``) casts them, and the ops run with autocast
disabled: their products are then the products of the unpatched head, and nothing inside them is
cast again (autocast is thread-local state that a custom op would otherwise inherit, forward and
backward, and ``torch.mm(..., out=...)`` rejects the dtype autocast would pick).

On a GPU of compute capability 9 or later, bf16 heads without a bias or label smoothing (a logit
scale and a temperature are taken) use the fused products (``products``) in place of cuBLAS's
logits product and the row kernels: the cross entropy (and any requested statistics, and the
entropy's gradient) in the product's epilogue, so the logits are never written (the recompute
schedule's forward), written as their gradient (its backward), or, with a final softcap of at
most 60 once divided by the temperature, written as exp(x - r)(1 - t^2) (r = ``products.
cap_reference``) whose row scale folds into the gradient products (the eager schedule, its z-loss
within a bound; and the kept schedule without a z-loss, the Q kept for the backward). Anything
else, the eager and kept schedules of a head without a softcap included, runs as above.

Modules, in reading order: ``products`` (the fused products: one persistent Triton GEMM, three
epilogues) -> ``terms`` (the gradient products of a softcapped head's Q and their row passes) ->
``ops`` (the upstream-scaling kernel, the chunk plan, and the two torch.library ops
``lce_fwd``, ``lce_bwd_kept`` and ``lce_bwd_recompute`` that run the schedules) -> ``api`` (the one
autograd.Function over them, the argument checks, ``linear_cross_entropy`` and
``linear_cross_entropy_statistics``).
"""

from __future__ import annotations

from .api import (
    LinearCrossEntropyFunction,
    UpstreamHint,
    input_needs,
    linear_cross_entropy,
    linear_cross_entropy_statistics,
    prepare_head_inputs,
)
from .ops import (
    DEFAULT_CHUNK_BYTES,
    LOW_MEMORY_CHUNK_BYTES,
    chunk_budget,
    lce_bwd_kept,
    lce_bwd_recompute,
    lce_fwd,
    plan_token_chunk,
    scale_by_upstream_,
    scaled_by_upstream,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "LOW_MEMORY_CHUNK_BYTES",
    "LinearCrossEntropyFunction",
    "UpstreamHint",
    "chunk_budget",
    "input_needs",
    "lce_bwd_kept",
    "lce_bwd_recompute",
    "lce_fwd",
    "linear_cross_entropy",
    "linear_cross_entropy_statistics",
    "plan_token_chunk",
    "prepare_head_inputs",
    "scale_by_upstream_",
    "scaled_by_upstream",
]
