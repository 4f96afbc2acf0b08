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

A model parallelised by hand with torch's ``parallelize_module`` (torchtitan's plans) keeps its
projections' ``ColwiseParallel`` / ``RowwiseParallel`` in two layout hooks per module
(``distribute_module``'s: the input made a DTensor before the forward, the output made local
after), which run around any forward, so the same dispatch costs remain whatever the forward. When
the hooks are exactly torch's for those two styles with their default layouts (replicated input,
features-sharded output, local outputs; and the reverse), patching after the parallelisation lifts
them for as long as it is patched (``surgery.patching.swap``: a no-op stands in their place, and
``unpatch`` puts them back) and runs this forward, which does what they and ``nn.Linear`` did;
patched before, torch's hooks wrap surgery's forward as they wrap any.
"""

from __future__ import annotations

import functools
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
    """How a projection transformers (or torch's ``parallelize_module``) sharded runs on its
    shards: ``style`` ``"colwise"`` or ``"rowwise"``, over the process ``group`` of the weight's
    one-dimensional mesh; ``previous`` is transformers' forward, kept for an input this forward
    does not take (a DTensor); ``lifted``, torch's layout hooks as (hook table, handle id, hook),
    lifted from the module while it is patched (``surgery.patching.swap``), and run around
    ``nn.Linear.forward`` for such an input. A deep copy of a patched model shares it."""

    style: str
    group: Any
    previous: Any
    lifted: tuple = ()

    def __deepcopy__(self, memo) -> LocalShards:
        # A process group cannot be copied, and a copy of the model reduces over the same ranks.
        return self


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


_PLACEMENTS = {"colwise": (Shard(0), Shard(0)), "rowwise": (Shard(1), Replicate())}
"""Each style's weight and bias placements."""


def _sharded_so(module: nn.Module, style: str) -> bool:
    weight, bias = _PLACEMENTS[style]
    return _tensor_parallel_placement(module.weight) == weight and (
        module.bias is None or _tensor_parallel_placement(module.bias) == bias
    )


def local_shards(module: nn.Module) -> LocalShards | None:
    """The ``LocalShards`` of ``module`` when transformers' tensor parallelism sharded it in one of
    the two styles this forward computes on the shards, else None: an ``nn.Linear`` (its own class,
    no hooks), its forward transformers' ``tp_forward`` of a ``ColwiseParallel`` (replicated
    input, output sharded on the features) or a ``RowwiseParallel`` (input sharded on the
    features, output replicated) that returns plain tensors, over a one-dimensional mesh (the
    ``"tp"`` dimension of a larger one), its weight a DTensor sharded so, and not one of
    transformers' quantized layers. Or torch's ``parallelize_module`` sharded it so
    (``_torch_local_shards``)."""
    forward = module.__dict__.get("forward")
    if type(module) is nn.Linear and forward is None:
        return _torch_local_shards(module)
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
        style, layouts = "colwise", (Replicate(), Shard(-1))
    elif type(layout) is tp.RowwiseParallel:
        style, layouts = "rowwise", (Shard(-1), Replicate())
    else:
        return None
    if (
        getattr(layout, "use_local_output", False) is not True
        or (getattr(layout, "input_layouts", None), getattr(layout, "output_layouts", None))
        != layouts
        or not _sharded_so(module, style)
    ):
        return None
    # The group transformers' own forward reduces over (its tp_forward's mesh).
    group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    return LocalShards(style, group, forward)


def _torch_local_shards(module: nn.Module) -> LocalShards | None:
    """The ``LocalShards`` of an ``nn.Linear`` whose only hooks are the two that torch's
    ``parallelize_module`` registers (``distribute_module``) for a ``ColwiseParallel`` or
    ``RowwiseParallel`` with its default layouts and local outputs, on a one-dimensional mesh, its
    weight a DTensor sharded so; else None. The hooks are read from their closures (the style's
    input and output functions and their layouts, compared exactly): anything else (sequence
    parallelism's layouts, DTensor outputs, hooks of other code beside them) keeps them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if (
        module._backward_hooks
        or module._backward_pre_hooks
        or module._forward_pre_hooks_with_kwargs
        or module._forward_hooks_with_kwargs
        or module._forward_hooks_always_called
        or len(module._forward_pre_hooks) != 1
        or len(module._forward_hooks) != 1
    ):
        return None
    ((pre_id, pre),) = module._forward_pre_hooks.items()
    ((post_id, post),) = module._forward_hooks.items()
    if not (hasattr(pre, "__closure__") and hasattr(post, "__closure__")):
        return None
    before, after = _closure(pre), _closure(post)
    mesh = before.get("device_mesh")
    inputs, outputs = before.get("input_fn"), after.get("output_fn")
    if (
        mesh is None
        or after.get("device_mesh") is not mesh
        or mesh.ndim != 1
        or not isinstance(inputs, functools.partial)
        or not isinstance(outputs, functools.partial)
        or inputs.keywords
        or outputs.keywords
    ):
        return None
    styles = (
        ("colwise", ColwiseParallel, ((Replicate(),), (Replicate(),)), ((Shard(-1),), True)),
        ("rowwise", RowwiseParallel, ((Shard(-1),), (Shard(-1),)), ((Replicate(),), True)),
    )
    for style, parallel, input_args, output_args in styles:
        if (
            inputs.func is parallel._prepare_input_fn
            and outputs.func is parallel._prepare_output_fn
            and inputs.args == input_args
            and outputs.args == output_args
            and _sharded_so(module, style)
        ):
            lifted = (("_forward_pre_hooks", pre_id, pre), ("_forward_hooks", post_id, post))
            return LocalShards(style, mesh.get_group(), None, lifted)
    return None


def _through_lifted_hooks(module: nn.Module, lifted: tuple, input: Any) -> Any:
    """What calling ``module`` did before its layout hooks were lifted: the pre-forward hooks on
    the input, ``nn.Linear.forward``, the forward hooks on the output."""
    args = (input,)
    for table, _, hook in lifted:
        if table == "_forward_pre_hooks":
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    output = nn.Linear.forward(module, *args)
    for table, _, hook in lifted:
        if table == "_forward_hooks":
            result = hook(module, args, output)
            if result is not None:
                output = result
    return output


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
        if shards.lifted:
            return _through_lifted_hooks(self, shards.lifted, input)
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
