"""The projections transformers' tensor parallelism sharded, run on their local shards.

Under ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` transformers
shards each projection's weight as a DTensor and sets a forward on the instance
(``TensorParallelLayer.install_forward``) that wraps the input into a DTensor, runs
``nn.Linear.forward`` through DTensor's dispatch and unwraps the output. In training every
projection pays that dispatch on the host (sharding propagation, redistributes, the DTensor
autograd wrappers): on an 8B model at one 8192-token row per rank the step was bound by the host,
not by the GPU (``benchmarks/scale.py --profile``, docs/benchmarks.md).

For the two styles of transformers' plans whose arithmetic is a plain local product, this forward
does the same arithmetic on the shards with one collective where the layout needs it, as
Megatron's column- and row-parallel linears do:

- column-wise (``"colwise"``: the weight's rows and the bias sharded, ``Shard(0)``; the input
  replicated; the output this rank's slice of the features): ``x @ W_r.T + b_r``; backward, the
  input's gradient is all-reduced over the group (each rank holds its rows' part of it);
- row-wise (``"rowwise"``: the weight's columns sharded, ``Shard(1)``, the bias replicated; the
  input this rank's slice of the features): ``all_reduce(x_r @ W_r.T) + b``; backward, the
  output's gradient is the same on every rank and passes through.

The weights stay the DTensor parameters transformers made (``to_local`` is differentiable: their
gradients are DTensors of the same placements, as with transformers' forward), so optimizers,
checkpoints and ``unpatch`` see what they saw. With transformers' FSDP2 over the tensor
parallelism (``DistributedConfig(tp_size=..., fsdp_size=...)``, an (fsdp, tp) mesh) the same runs
on the ``tp`` dimension, FSDP2 having gathered the other before the forward. Anything else (other
styles, other meshes, a quantized layer, an input that is already a DTensor) keeps transformers'
forward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from surgery.patching.foreign import hooked, tensor_parallel_forward

__all__ = [
    "TP_LINEAR_ATTR",
    "LocalShards",
    "all_reduce_grad",
    "local_shards",
    "local_tensor",
    "shared_column_group",
    "tensor_parallel_linear_forward",
]

TP_LINEAR_ATTR = "_surgery_tensor_parallel_linear"
"""Instance attribute of a patched projection: its ``LocalShards``."""


class LocalShards(NamedTuple):
    """How a projection transformers sharded runs on its shards: ``style`` ``"colwise"`` or
    ``"rowwise"``, over the process ``group`` of the weight's one-dimensional mesh; ``previous``
    is transformers' forward, kept for an input this forward does not take (a DTensor)."""

    style: str
    group: Any
    previous: Any


def _closure(function) -> dict[str, Any]:
    cells = function.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, cells)}


def _tensor_parallel_placement(t: torch.Tensor | None) -> Any:
    """How ``t`` is laid out over the tensor-parallel ranks: its placement on a one-dimensional
    mesh, or on the ``"tp"`` dimension of transformers' (fsdp, tp) mesh (FSDP2 over tensor
    parallelism, ``DistributedConfig(tp_size=..., fsdp_size=...)``: FSDP2 gathers the other
    dimension before the forward); None for anything else."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    if mesh.ndim == 1:
        return t.placements[0]
    names = mesh.mesh_dim_names or ()
    return t.placements[names.index("tp")] if "tp" in names else None


def local_shards(module: nn.Module) -> LocalShards | None:
    """The ``LocalShards`` of ``module`` when transformers' tensor parallelism sharded it in one of
    the two styles this forward computes on the shards, else None: an ``nn.Linear`` (its own class,
    no hooks), its forward transformers' ``tp_forward`` of a ``ColwiseParallel`` (replicated
    input, output sharded on the features) or a ``RowwiseParallel`` (input sharded on the
    features, output replicated) that returns plain tensors, over a one-dimensional mesh (the
    ``"tp"`` dimension of a larger one), its weight a DTensor sharded so, and not one of
    transformers' quantized layers."""
    forward = module.__dict__.get("forward")
    if type(module) is not nn.Linear or not tensor_parallel_forward(forward):
        return None
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None
    if getattr(module, "_hf_quantized_needs_local_tp", False):
        return None
    from transformers.distributed import tensor_parallel as tp

    closure = _closure(forward)
    layout, mesh = closure.get("self"), closure.get("mesh")
    if mesh is None or not (mesh.ndim == 1 or "tp" in (mesh.mesh_dim_names or ())):
        return None
    if type(layout) is tp.ColwiseParallel:
        style, weight_placement, bias_placement = "colwise", Shard(0), Shard(0)
        layouts = (Replicate(), Shard(-1))
    elif type(layout) is tp.RowwiseParallel:
        style, weight_placement, bias_placement = "rowwise", Shard(1), Replicate()
        layouts = (Shard(-1), Replicate())
    else:
        return None
    if (
        getattr(layout, "use_local_output", False) is not True
        or (getattr(layout, "input_layouts", None), getattr(layout, "output_layouts", None))
        != layouts
        or _tensor_parallel_placement(module.weight) != weight_placement
        or (module.bias is not None and _tensor_parallel_placement(module.bias) != bias_placement)
    ):
        return None
    # The group transformers' own forward reduces over (its tp_forward's mesh).
    group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    return LocalShards(style, group, forward)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over ``group`` (a column-parallel
    projection's replicated input: each rank's rows give their part of its gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # the engine's may be shared
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduce(torch.autograd.Function):
    """The sum over ``group`` (a row-parallel projection's partial outputs); backward, the
    gradient of the replicated sum, the same on every rank, passes through."""

    @staticmethod
    def forward(ctx, x, group):
        # In place on the product's own output (its backward keeps its inputs, not it).
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor (differentiably), anything else as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce_grad(x: torch.Tensor, group) -> torch.Tensor:
    """``x``, its gradient summed over ``group`` in the backward (when one is taken)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllReduceGrad.apply(x, group)
    return x


def _runs_this_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` would run ``tensor_parallel_linear_forward`` and nothing else:
    still its forward (no other code replaced it since the patch), no hook of its own or global
    one (hooks added after the patch must run, so such a projection is called, not read)."""
    forward = getattr(module.__dict__.get("forward"), "__func__", None)
    return forward is tensor_parallel_linear_forward and not hooked(module)


def shared_column_group(linears) -> Any:
    """The process group when ``linears`` (layers over one input: q/k/v, gate and up) are several
    projections patched to run column-wise on their local shards over one group, each still
    running that forward alone (no hook since), else None: their input's gradient is then
    all-reduced once for all of them (``surgery.forwards.layers.projections``) rather than once
    each."""
    shards = [m.__dict__.get(TP_LINEAR_ATTR) for m in linears]
    if len(shards) < 2 or any(s is None or s.style != "colwise" for s in shards):
        return None
    if not all(_runs_this_forward(m) for m in linears):
        return None
    group = shards[0].group
    return group if all(s.group is group for s in shards) else None


def tensor_parallel_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``'s forward on this rank's shards (see the module docstring); what
    transformers' forward returns, a plain tensor: this rank's slice of the output features
    (column-wise) or the whole output (row-wise)."""
    shards: LocalShards = self.__dict__[TP_LINEAR_ATTR]
    if isinstance(input, DTensor):
        return shards.previous(input)
    weight = self.weight.to_local()
    if shards.style == "colwise":
        return F.linear(all_reduce_grad(input, shards.group), weight, local_tensor(self.bias))
    partial = F.linear(input, weight)
    if torch.is_grad_enabled():
        output = _AllReduce.apply(partial, shards.group)
    else:
        output = partial
        dist.all_reduce(output, group=shards.group)
    if self.bias is None:
        return output
    # In the product's dtype, as nn.Linear's under autocast (a no-op outside it).
    return output + local_tensor(self.bias).to(output.dtype)
