"""A mixture of experts' routed experts: transformers' grouped GEMMs with the gated activation fused
between them, as one more of transformers' experts implementations.

transformers 5 keeps a MoE layer's experts as 3-D parameters (``gate_up_proj`` (E, 2 I, H) holding
gate then up, ``down_proj`` (E, H, I)) in a class decorated with ``use_experts_implementation``,
whose forward dispatches through ``ExpertsInterface`` on ``config._experts_implementation``
(``"grouped_mm"``, transformers' default wherever torch can run it; ``"batched_mm"``; ``"eager"``,
the class's own loop; ...). surgery registers one more name there, ``SURGERY_EXPERTS``
(``"surgery_grouped_mm"``), so that ``set_experts_implementation`` and the model's own dispatch stay
in charge; ``surgery.patch`` selects it (``PatchOptions.experts_implementation``) and marks each
experts module it may fuse with an ``ExpertsPlan`` (a plain instance attribute): which, and how,
is ``surgery.patching.experts_install``.

``fused_grouped_mm_experts_forward`` computes what transformers' ``grouped_mm_experts_forward``
computes, with its grouped GEMMs (``_grouped_linear``: ``torch.nn.functional.grouped_mm`` where
torch can run it, transformers' own per-expert loop op elsewhere, CPU included): rows sorted by
expert, one grouped GEMM up, ``act(gate) * up``, one grouped GEMM down, the routing weights, the
rows put back and summed per token in transformers' order. Five things differ; the first two
change roundings (fewer, and in another order), the others change nothing but the kernels the
backward runs:

- ``act(gate) * up`` is ``gated_activation_merged`` on the GEMM's (rows, 2 I) output: computed in
  fp32 and rounded once (transformers rounds act(gate) and the product), and only that output is
  kept for the backward (transformers keeps it and act(gate));
- the down GEMM, the routing weights and the per-token sum are one autograd step,
  ``y_t = sum_k w_r (h_r @ W_e^T)`` over the token's rows r (h the product, W_e the row's expert's
  ``down_proj``, w its routing weight), the weighting and the sum one kernel (``gather_sum``: in
  fp32, rounded once, where transformers rounds ``out * w`` and then the sum). Its backward needs
  only h, W and w, never the GEMM's (rows, hidden) output that autograd keeps for transformers'
  ``out * w``: with dy_r the row's token's gradient (a gather) and g = dy @ W_e (the grouped GEMM
  the backward runs anyway), dw = <g, h> per row, dh = g * w and dW_e = sum over the expert's rows
  of dy^T (w h). The same GEMMs as transformers; the same math, rounded in another order:
  transformers scales dy by w before both GEMMs (``(dy * w) @ W_e``, ``(dy * w)^T h``) and takes dw
  as <dy, out>;
- the product, kept for the down GEMM's weight gradient and for dw, is rebuilt in the backward
  from the gated activation's kept input with the same kernel, bit for bit
  (``surgery.forwards.recompute``; ``recompute_mlp_product``);
- the token rows gathered for the up GEMM (rows = tokens x top_k, hidden wide), kept for its
  weight gradient, are gathered again in the backward from the layer's input, which the router
  keeps anyway (``surgery.forwards.recompute``; always, it is a copy);
- the gather of the token rows and the per-token sum are adjoint, and each one's backward is the
  other (``surgery.kernels.rows.token_rows``, ``_DownProjectionAndSum``): a gather, where
  autograd's backward of an index scatter-adds into zeros (atomics and a zero fill on a GPU).
  The same values: the gradient rows a token receives are summed in fp32 in slot order and
  rounded once.

Per layer that is (rows x 2 (hidden + I)) elements less kept for the backward. A module surgery has
not marked, or one that is expert-parallel or in a dtype without a kernel, runs transformers'
``grouped_mm_experts_forward`` itself. What is never fused: experts with biases, without a gate,
with an interleaved gate/up layout, a ``_apply_gate`` of their own (GPT-OSS's clamped gate) or a
norm after each expert, and activations without a kernel
(``surgery.patching.experts_install.unfusable_reason``).

Llama 4's experts (``ArchitectureSpec.batched_experts``) are not dispatched through transformers'
experts implementations: every token runs through every expert as two batched GEMMs, the MoE
block having scaled each expert's copy of the tokens by its routing weight (zero where the router
did not pick the expert). surgery swaps their forward for ``batched_experts_forward``: the same
``bmm`` calls on the same operands, ``gated_activation_merged`` between them (rounded once, only
the up GEMM's output kept) and the product rebuilt in the backward; the routing stays the block's.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from surgery.forwards import recompute
from surgery.kernels.gated_activation import gated_activation_merged, gated_activation_merged_fwd
from surgery.kernels.gather_sum import gather_sum
from surgery.kernels.grouped_mm import grouped_weight_grad_loop
from surgery.kernels.rows import token_rows
from surgery.kernels.saved_first import OutputNode, checked_output, stand_in

try:
    from transformers.integrations import moe as transformers_moe
    from transformers.integrations.moe import (
        ALL_EXPERTS_FUNCTIONS,
        ExpertsInterface,
        grouped_mm_experts_forward,
    )
except ImportError:  # pragma: no cover - transformers before experts implementations
    ALL_EXPERTS_FUNCTIONS = ExpertsInterface = grouped_mm_experts_forward = None

__all__ = [
    "EXPERTS_AUTO",
    "EXPERTS_PLAN_ATTR",
    "SURGERY_EXPERTS",
    "ExpertsPlan",
    "batched_experts_forward",
    "fused_grouped_mm_experts_forward",
]

SURGERY_EXPERTS = "surgery_grouped_mm"
"""surgery's name in transformers' ``ExpertsInterface``."""
EXPERTS_AUTO = "auto"
"""``experts_implementation`` default: ``SURGERY_EXPERTS`` where the model runs ``grouped_mm``."""
EXPERTS_PLAN_ATTR = "_surgery_experts"
"""Instance attribute of an experts module surgery fuses: its ``ExpertsPlan``."""

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _private_grouped_linear():
    """transformers' ``_grouped_linear(input, weight, offs, bias=None, is_transposed=False)``, the
    grouped GEMM (with its device and compile dispatch) its ``grouped_mm`` experts run; None when
    this transformers has no function of that signature, or no ``_can_use_grouped_mm(input,
    weight, offs)``, that dispatch's choice between torch's grouped GEMM and transformers'
    per-expert loop, which the backward's weight-gradient GEMM follows (then nothing is fused).
    Private in transformers: checked here, compared with the public ``grouped_mm`` implementation
    in tests/surgery/test_experts.py (CPU and GPU), and ``experts_implementation="grouped_mm"``
    turns them off."""
    try:
        from transformers.integrations.moe import _can_use_grouped_mm, _grouped_linear
    except ImportError:
        return None
    signatures = (
        list(inspect.signature(_grouped_linear).parameters),
        list(inspect.signature(_can_use_grouped_mm).parameters),
    )
    expected = (["input", "weight", "offs", "bias", "is_transposed"], ["input", "weight", "offs"])
    return _grouped_linear if signatures == expected else None


_grouped_linear = _private_grouped_linear()


@dataclass(frozen=True)
class ExpertsPlan:
    """What ``fused_grouped_mm_experts_forward`` does on one experts module."""

    activation: str
    """The ``gated_activation`` name of the experts' activation."""
    recompute_product: bool
    """Rebuild ``act(gate) * up`` in the backward instead of keeping it
    (``recompute_mlp_product``)."""


# ---------------------------------------------------------------------------------------------
# the experts implementation


def _expert_offsets(expert_ids_sorted: torch.Tensor, num_experts: int) -> torch.Tensor:
    """End row of each expert's group, as transformers computes it for ``grouped_mm``: ``histc``
    rather than ``bincount`` (CUDA graphs), on float ids on CPU and MPS, where histc takes no
    integers, and int ids elsewhere (deterministic mode's CUDA kernel takes no floats)."""
    device_type = expert_ids_sorted.device.type
    ids = expert_ids_sorted.float() if device_type in ("cpu", "mps") else expert_ids_sorted.int()
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def _gather_rows(hidden_states, rows, inverse, top_k: int, dtype: torch.dtype):
    return token_rows(hidden_states, rows, inverse, top_k).to(dtype)


def _gathered(hidden_states, rows, inverse, dtype: torch.dtype, top_k: int, record: bool):
    """``hidden_states[rows]`` in the weights' dtype (``token_rows``), registered (``record``) to
    be gathered again in the backward where holding ``hidden_states`` instead never costs more
    (top_k rows per token)."""
    gather = functools.partial(_gather_rows, top_k=top_k, dtype=dtype)
    if recompute.compiling_with_grad():
        return recompute.compiled_recompute(gather, hidden_states, rows, inverse)
    x = gather(hidden_states, rows, inverse)
    if record and hidden_states.element_size() <= top_k * x.element_size():
        recompute.register(x, gather, hidden_states, rows, inverse)
    return x


def _gated(gate_up: torch.Tensor, plan: ExpertsPlan, record: bool) -> torch.Tensor:
    if not plan.recompute_product:
        return gated_activation_merged(gate_up, plan.activation)
    if recompute.compiling_with_grad():
        return recompute.compiled_recompute(gated_activation_merged, gate_up, plan.activation)
    product = gated_activation_merged(gate_up, plan.activation)
    if record and gate_up.is_contiguous():  # the kernel kept gate_up itself
        rebuild = functools.partial(gated_activation_merged_fwd, activation=plan.activation)
        recompute.register(product, rebuild, gate_up)
    return product


def _grouped_weight_grad(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """(groups, a's columns, b's columns): group g's rows of ``a`` transposed times its rows of
    ``b`` (a grouped GEMM's weight gradient), in ``weight``'s dtype; torch's grouped GEMM (groups
    along the reduction) wherever transformers' dispatch runs it for ``weight``, else a loop."""
    a, b = a.to(weight.dtype), b.to(weight.dtype)
    # Looked up on each call, as ``_grouped_linear`` looks it up: one decision for both.
    if transformers_moe._can_use_grouped_mm(b, weight, offs):
        grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return grouped_mm(a.t(), b, offs=offs)
    return grouped_weight_grad_loop(a, b, offs)


class _DownProjectionAndSum(torch.autograd.Function):
    """The node of each token's ``top_k`` rows of ``_grouped_linear(product, weight, offsets)``
    times their routing weights, summed (``gather_sum``), whose backward keeps only its inputs
    (not the GEMM's output, which ``out * w`` would keep for dw); the module docstring gives the
    math and its differences in rounding from transformers'. Its forward saves and returns a
    stand-in for the output, which ``_DownProjectionAndSumOutput`` computes, so that a
    checkpointed layer's recomputation stops before the GEMM (``saved_first``)."""

    @staticmethod
    def forward(
        ctx, product, weight, offsets, row_weights, inverse, rows, top_k: int, is_transposed: bool
    ):
        # Saved inside the caller's recompute scope: the product is kept as a reference to what
        # rebuilds it.
        ctx.save_for_backward(product, weight, offsets, row_weights, rows)
        ctx.is_transposed = is_transposed
        hidden = weight.shape[-1] if is_transposed else weight.shape[-2]
        return stand_in((inverse.numel() // top_k, hidden), weight.dtype, product.device)

    @staticmethod
    def backward(ctx, grad_output):
        product, weight, offsets, row_weights, rows = ctx.saved_tensors
        needs_product, needs_weight, _, needs_row_weights = ctx.needs_input_grad[:4]
        grad_product = grad_weight = grad_row_weights = None
        scale = row_weights.unsqueeze(-1)
        dy = grad_output[rows]  # each row's token's gradient (the sum's adjoint): a gather
        if needs_weight:
            # sum over an expert's rows of (w dy)^T h, as dy^T (w h): the scaled operand is the
            # narrower one (expert width, not hidden)
            scaled = product * scale
            if ctx.is_transposed:  # weight (experts, I, hidden)
                grad_weight = _grouped_weight_grad(scaled, dy, offsets, weight)
            else:  # weight (experts, hidden, I)
                grad_weight = _grouped_weight_grad(dy, scaled, offsets, weight)
            del scaled
        if needs_product or needs_row_weights:
            grad = _grouped_linear(dy, weight, offsets, is_transposed=not ctx.is_transposed)
            if needs_row_weights:
                dot = (grad * product).sum(-1, dtype=torch.float32)
                grad_row_weights = dot.to(row_weights.dtype)
            if needs_product:
                grad_product = grad.mul_(scale).to(product.dtype)  # the GEMM's output: ours
        return grad_product, grad_weight, None, grad_row_weights, None, None, None, None


class _DownProjectionAndSumOutput(OutputNode):
    """The output for ``_DownProjectionAndSum``'s stand-in."""

    @staticmethod
    def forward(ctx, standing_in, product, weight, offsets, row_weights, inverse, top_k: int,
                is_transposed: bool):  # fmt: skip
        out = _grouped_linear(product, weight, offsets, is_transposed=is_transposed)
        return checked_output(gather_sum(out, inverse, top_k, row_weights), standing_in)


def fused_grouped_mm_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts with ``act(gate) * up`` fused between the grouped GEMMs,
    the down GEMM's output not kept for the routing weights' gradient, and the gathered rows and
    product rebuilt in the backward (the module docstring); the signature and result of
    transformers' experts forwards: ``hidden_states`` (tokens, hidden), ``top_k_index`` and
    ``top_k_weights`` (tokens, top_k), returns (tokens, hidden) in ``hidden_states``' dtype."""
    plan: ExpertsPlan | None = self.__dict__.get(EXPERTS_PLAN_ATTR)
    weight = self.gate_up_proj
    if (
        plan is None
        or _grouped_linear is None
        or getattr(self, "_is_expert_parallel", False)  # rows routed to other ranks: transformers'
        or weight.dtype not in _KERNEL_DTYPES
    ):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    top_k = top_k_index.size(-1)
    # Rows (token, slot) sorted by expert, each expert's rows one group of the grouped GEMMs.
    expert_ids_sorted, perm = torch.sort(top_k_index.reshape(-1))
    offsets = _expert_offsets(expert_ids_sorted, self.num_experts)
    weights_sorted = top_k_weights.reshape(-1)[perm]
    inverse = torch.empty_like(perm)  # slot j (token j // top_k) sits at sorted row inverse[j]
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    rows = perm // top_k  # the token of each sorted row
    record = recompute.recording()  # read before the scope, whose hooks it would count
    with recompute.saved_tensor_scope(record):
        x = _gathered(hidden_states, rows, inverse, weight.dtype, top_k, record)
        gate_up = _grouped_linear(x, weight, offsets, is_transposed=self.is_transposed)
        product = _gated(gate_up, plan, record)
        # transformers' reduction: the top_k rows of a token summed in slot order (deterministic).
        standing_in = _DownProjectionAndSum.apply(
            product, self.down_proj, offsets, weights_sorted, inverse, rows, top_k,
            self.is_transposed,
        )  # fmt: skip
        per_token = _DownProjectionAndSumOutput.apply(
            standing_in, product, self.down_proj, offsets, weights_sorted, inverse, top_k,
            self.is_transposed,
        )  # fmt: skip
    return per_token.to(hidden_states.dtype)


def batched_experts_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts (``ArchitectureSpec.batched_experts``) with ``act(gate) * up`` fused
    between their batched GEMMs: ``hidden_states`` (experts x tokens, hidden), expert e's tokens
    in rows [e T, (e + 1) T), already scaled by their routing weights, viewed (experts, tokens,
    hidden); ``bmm`` with ``gate_up_proj`` (experts, hidden, 2 I), ``gated_activation_merged`` on
    its output, ``bmm`` with ``down_proj`` (experts, I, hidden); returns (experts x tokens, hidden).
    transformers' own forward with act(gate) * up computed in fp32 and rounded once, only the up
    GEMM's output kept for the backward and the product rebuilt there (``recompute_mlp_product``).
    Weights in a dtype without a kernel run the class's forward."""
    plan: ExpertsPlan = self.__dict__[EXPERTS_PLAN_ATTR]
    if self.gate_up_proj.dtype not in _KERNEL_DTYPES:
        return type(self).forward(self, hidden_states)
    x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate_up = torch.bmm(x, self.gate_up_proj)
    record = recompute.recording()  # read before the scope, whose hooks it would count
    with recompute.saved_tensor_scope(record):
        product = _gated(gate_up, plan, record)
        out = torch.bmm(product, self.down_proj)
    return out.view(-1, self.hidden_size)
