"""The generic RMSNorm, gated-MLP and input-embedding forwards: one each for every architecture, its
differences read from the spec (the norm's style, the MLP's activation).

The MLP forward calls its projections as modules, so adapters on them (PEFT LoRA), hooks and
FSDP2's unsharding all run as in the original forward. It reads the weights of plain projections
itself (``plain_linear``: an ``nn.Linear`` of its own class, without hooks or a partitioned
weight), inside the module whose call unsharded them, as ``nn.Linear`` would: a bias-free
``down_proj``'s (for ``gated_linear``) and, through ``projections`` (also the attention's
q/k/v), those of layers that share one input (``share_input``, ``shared_input_linear``). Under
transformers' tensor parallelism, ``projections`` computes column-parallel projections on their
local shards, their input's gradient all-reduced once for the group
(``surgery.forwards.tensor_parallel``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from surgery.forwards import recompute
from surgery.forwards.recompute import RECOMPUTE_ATTR, RecomputePlan
from surgery.forwards.tensor_parallel import all_reduce_grad, local_tensor, shared_column_group
from surgery.kernels import embedding, gated_activation, rms_norm
from surgery.kernels.gated_activation import gated_activation_fwd, gated_linear, gated_linear_fuses
from surgery.kernels.rms_norm import rms_norm_fwd
from surgery.kernels.shared_input_linear import shared_input_linear
from surgery.models import RMSNormStyle
from surgery.patching.foreign import hooked

__all__ = [
    "EMBEDDING_ATTR",
    "MLP_ATTR",
    "NORM_ATTR",
    "RECOMPUTE_ATTR",
    "RecomputePlan",
    "embedding_forward",
    "gated_mlp_forward",
    "gated_mlp_forward_for",
    "gated_mlp_forward_hidden_states",
    "input_embeddings",
    "plain_linear",
    "projections",
    "rms_norm_forward",
    "rms_norm_forward_for",
    "rms_norm_forward_x",
    "share_input",
]

NORM_ATTR = "_surgery_rms_norm"
"""Instance attribute of a patched norm: its ``RMSNormStyle``."""
MLP_ATTR = "_surgery_gated_mlp"
"""Instance attribute of a patched MLP: the ``gated_activation`` name of its activation."""
EMBEDDING_ATTR = "_surgery_embedding"
"""Instance attribute of a patched input embedding (True)."""


def _rebuild_rms_norm(x, weight, eps, offset, casting):
    # The forward's launcher on the forward's inputs (``rms_norm`` without its autograd).
    return rms_norm_fwd(x.reshape(-1, x.shape[-1]), weight, eps, offset, casting)[0].view(x.shape)


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    style: RMSNormStyle = module.__dict__[NORM_ATTR]
    eps = getattr(module, style.eps_attr)
    weight = getattr(module, "weight", None)
    if weight is None:  # a norm without a scale (Gemma 3n/4's with_scale=False): a scale of 1
        weight = torch.full((x.shape[-1],), 1.0 - style.offset, dtype=x.dtype, device=x.device)
    plan: RecomputePlan | None = module.__dict__.get(RECOMPUTE_ATTR)
    if plan is not None and plan.norm_output and recompute.compiling_with_grad():
        return recompute.compiled_recompute(
            rms_norm, x, weight, float(eps), float(style.offset), style.casting
        )
    y = rms_norm(x, weight, eps, style.offset, style.casting)  # type: ignore[arg-type]
    if (
        plan is not None
        and plan.norm_output
        and y.requires_grad
        and x.is_contiguous()  # the norm keeps a view of x itself, not a copy
        and recompute.recording()
    ):
        eps, offset = float(eps), float(style.offset)
        recompute.register(
            y, lambda x, w: _rebuild_rms_norm(x, w, eps, offset, style.casting), x, weight
        )
    return y


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``forward(hidden_states)`` of Llama, Mistral and Qwen2/3's RMSNorm, through ``rms_norm``."""
    return _rms_norm(self, hidden_states)


def rms_norm_forward_x(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``forward(x)`` of Gemma 1/2/3's RMSNorm: the same, under the argument name Gemma uses."""
    return _rms_norm(self, x)


def rms_norm_forward_for(module: nn.Module) -> Callable:
    """The norm forward whose argument is named like the one of ``module``'s class forward (the
    patch checks that the names match, so a caller passing it by keyword still works). The class
    forward, not an instance one: what ``patch`` replaces is always transformers' own forward,
    possibly inside accelerate's hook (``surgery.patching.foreign``)."""
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    return rms_norm_forward_x if params[:1] == ["x"] else rms_norm_forward


def plain_linear(linear: nn.Module | None, bias: bool = False) -> bool:
    """Whether a forward may read ``linear``'s weight (and bias, where ``bias`` allows one)
    itself instead of calling it: a plain ``nn.Linear`` without hooks (its own or global ones:
    DeepSpeed's gathers), a forward of the instance's own (accelerate's) or a weight that is not a
    plain tensor (ZeRO-3 partitions, DTensors). Anything else (a LoRA layer, a quantized linear)
    is called."""
    return (
        type(linear) is nn.Linear
        and (bias or linear.bias is None)
        and "forward" not in linear.__dict__
        and not hooked(linear)
        and not hasattr(linear.weight, "ds_id")
        and not isinstance(linear.weight, DTensor)
    )


def share_input(linears) -> bool:
    """Whether ``linears`` (the layers over one input) may run through ``shared_input_linear``:
    several, all ``plain_linear`` (biases allowed), or all column-parallel on their local shards
    over one group (``shared_column_group``). ``projections`` adds what a call decides."""
    return _plain_projections(linears) or shared_column_group(linears) is not None


def _plain_projections(linears) -> bool:
    return len(linears) > 1 and all(plain_linear(m, bias=True) for m in linears)


def projections(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``; where they ``share_input``, are of ``x``'s
    dtype, and a gradient is to be taken outside autocast, through ``shared_input_linear``: the
    same outputs, and the input's gradient summed inside the matrix products of the backward
    instead of by adds after them. Column-parallel projections on their local shards over one
    group (``surgery.forwards.tensor_parallel``) compute on those shards, their input's gradient
    all-reduced once for all of them."""
    if isinstance(x, DTensor):  # a layout hook's input: each projection's own forward takes it
        return tuple(m(x) for m in linears)
    group = shared_column_group(linears)
    if group is not None:
        x = all_reduce_grad(x, group)
        weights = [local_tensor(m.weight) for m in linears]
        biases = [local_tensor(m.bias) for m in linears]
    elif _plain_projections(linears):
        weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    else:
        return tuple(m(x) for m in linears)
    if (
        torch.is_grad_enabled()
        and not torch.is_autocast_enabled(x.device.type)
        and all(
            w.dtype == x.dtype and (b is None or b.dtype == x.dtype)
            for w, b in zip(weights, biases)
        )
    ):
        return shared_input_linear(x, weights, biases)
    if group is None:
        return tuple(m(x) for m in linears)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


def _fused_down(module: nn.Module, plan: RecomputePlan, gate, up) -> bool:
    # With the product rebuilt anyway, rebuild it in the activation's backward (gated_linear).
    down = module.down_proj
    return plan.mlp_product and plain_linear(down) and gated_linear_fuses(gate, up, down.weight)


def gated_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the product through ``gated_activation``:
    act(gate) is neither materialised for backward nor rounded on its own. With
    ``recompute_mlp_product`` and a plain ``down_proj`` the product and the down projection are
    one step (``gated_linear``), whose backward rebuilds the product in the activation's backward
    kernel; otherwise the product is rebuilt on its own before the backward needs it."""
    activation = self.__dict__[MLP_ATTR]
    plan: RecomputePlan | None = self.__dict__.get(RECOMPUTE_ATTR)
    if plan is None:
        gate, up = projections(x, self.gate_proj, self.up_proj)
        return self.down_proj(gated_activation(gate, up, activation))
    if recompute.compiling_with_grad():
        # The compiler's partitioner decides what is kept; the norm that produced x marked its
        # output for rebuilding itself (see surgery.forwards.recompute).
        gate, up = projections(x, self.gate_proj, self.up_proj)
        if _fused_down(self, plan, gate, up):
            return gated_linear(gate, up, self.down_proj.weight, activation)
        if plan.mlp_product:
            product = recompute.compiled_recompute(gated_activation, gate, up, activation)
        else:
            product = gated_activation(gate, up, activation)
        return self.down_proj(product)
    # Saved by the projections: the input (a norm's output, rebuilt if registered) and, for
    # down_proj, the product (rebuilt from gate and up, which gated_activation keeps).
    with recompute.saved_tensor_scope(plan.norm_output):
        gate, up = projections(x, self.gate_proj, self.up_proj)
    if _fused_down(self, plan, gate, up):
        return gated_linear(gate, up, self.down_proj.weight, activation)
    product = gated_activation(gate, up, activation)
    record = plan.mlp_product and recompute.recording()
    if (
        record
        and gate.dtype == up.dtype
        and gate.is_contiguous()
        and up.is_contiguous()  # gated_activation kept gate and up themselves, not copies
    ):
        recompute.register(product, lambda g, u: gated_activation_fwd(g, u, activation), gate, up)
    with recompute.saved_tensor_scope(record):
        return self.down_proj(product)


def gated_mlp_forward_hidden_states(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``gated_mlp_forward`` under the argument name Gemma 3n's MLP uses."""
    return gated_mlp_forward(self, hidden_states)


def gated_mlp_forward_for(module: nn.Module) -> Callable:
    """The MLP forward whose argument is named like the one of ``module``'s class forward (as
    ``rms_norm_forward_for``)."""
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    return gated_mlp_forward_hidden_states if params[:1] == ["hidden_states"] else gated_mlp_forward


def input_embeddings(text: nn.Module) -> list[nn.Embedding]:
    """The tables under the text model ``text``'s input embedding that ``embedding_forward``
    replaces: the embedding itself, or inside a PEFT adapter its base layer, or inside PEFT's
    ``modules_to_save`` the original and the trained copies; each a plain ``nn.Embedding``
    without ``max_norm`` or sparse gradients. Gemma's scaled embeddings are subclasses with a
    forward of their own, and keep it."""
    embed = text.get_input_embeddings()
    return [
        m
        for m in embed.modules()
        if type(m) is nn.Embedding
        and m.weight.shape == embed.weight.shape
        and m.max_norm is None
        and not m.sparse
    ]


def embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` with the weight's gradient from ``surgery.kernels.embedding``."""
    return embedding(input, self.weight, self.padding_idx, self.scale_grad_by_freq)
