"""Activations that a patched forward can rebuild bit for bit are not kept for the backward.

Some tensors autograd keeps are only there for a linear layer's weight gradient and are one cheap,
deterministic kernel away from tensors that autograd keeps anyway:

- the gated MLP's product ``act(gate) * up`` (tokens x intermediate), saved by ``down_proj`` (and
  a LoRA on it), is ``gated_activation_fwd(gate, up)``, and ``gated_activation`` keeps gate and up;
- an RMSNorm's output (tokens x hidden), saved by the projections after it (q/k/v, gate/up), is
  ``rms_norm_fwd(x, weight)``, and the norm keeps x and its weight;
- inside a mixture of experts (``surgery.forwards.experts``), the experts' product, rebuilt from the
up
  GEMM's output the fused activation keeps, and the token rows gathered for the up GEMM, gathered
  again from the layer's input.

The producer (the patched MLP or norm forward) registers its output with the function that
rebuilds it (``register``). While a patched consumer runs its projections it opens
``saved_tensor_scope()``: saved-tensor hooks that store a registered output, or any view of it, as a
reference to its producer's inputs, and rebuild it on unpack with the same kernel on the same
inputs, under the autocast state the output was registered in (the backward may run under
another: autocast is thread-local): the same bits. A rebuilt tensor is shared by every consumer of
one output (q, k and v unpack one rebuild) and freed with the last of them.

Under ``torch.compile`` saved-tensor hooks cannot be traced, and the compiler's partitioner decides
what the backward keeps: it never recomputes an op it cannot see into (our kernels are
``torch.library`` ops), so it would keep every norm output and MLP product. There the producer runs
its kernel inside a one-op activation-checkpoint region instead (``compiled_recompute``), which
the partitioner honours: the region's output is rebuilt in the backward from its inputs, which
the kernel's own backward keeps anyway (the norm's input and weight; gate and up). The compiled
graph then keeps what the eager scope keeps. One region has no eager counterpart: behind q/k norms
the attention's rotated queries and keys are rebuilt from the projections the q/k norms keep (a
norm and a rotation, ``surgery.attention.forward``), which eager keeps twice.

Anything unexpected saves normally: the scope is not opened when other saved-tensor hooks are
active (activation checkpointing and CPU offload install theirs: the outer hooks own every saved
tensor), or with grad mode off; a tensor is only recognised while its producer's output is alive
and unmodified (same storage, dtype, device and version counter), and only when the producer's
inputs are kept by autograd anyway (the output requires grad), so a reference never costs more
than the tensor.
Autograd skips its in-place check for hooked saves; the hooks do it themselves.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "RECOMPUTE_ATTR",
    "RecomputePlan",
    "compiled_recompute",
    "compiling_with_grad",
    "recording",
    "register",
    "saved_tensor_scope",
]

RECOMPUTE_ATTR = "_surgery_recompute"
"""Instance attribute of a patched norm, attention or MLP when activations are recomputed: the
``RecomputePlan``."""


@dataclass(frozen=True)
class RecomputePlan:
    """What the patched forwards rebuild in the backward: a norm registers its output when
    ``norm_output``; an attention opens the scope around q/k/v, and an MLP around gate/up, when
    ``norm_output``; an MLP registers its product, and opens the scope around down_proj, when
    ``mlp_product``."""

    norm_output: bool
    mlp_product: bool


# Storage address of a registered output -> its producer. An entry lives as long as the output's
# Python object (a weakref callback removes it); while that lives the storage cannot be reused.
_SOURCES: dict[int, _Source] = {}
_NO_SCOPE = contextlib.nullcontext()


class _Source:
    """A registered output: how to rebuild it, and what it must look like."""

    __slots__ = (
        "__weakref__",
        "autocast",
        "cache",
        "device",
        "dtype",
        "fn",
        "input_shapes",
        "input_versions",
        "inputs",
        "nbytes",
        "offset",
        "output_ref",
        "size",
        "stride",
        "version",
    )

    def __init__(self, output: torch.Tensor, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        self.fn = fn
        self.inputs = inputs
        self.input_versions = tuple(t._version for t in inputs)
        self.input_shapes = tuple(t.shape for t in inputs)
        self.version = output._version
        self.dtype, self.device = output.dtype, output.device
        self.size, self.stride, self.offset = (
            output.size(),
            output.stride(),
            output.storage_offset(),
        )
        self.nbytes = output.untyped_storage().nbytes()
        dev = output.device.type
        self.autocast = (
            None
            if dev == "meta"
            else (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        )
        self.cache: torch.Tensor | None = None
        self.output_ref: weakref.ref | None = None

    def matches(self, t: torch.Tensor) -> bool:
        return (
            t.dtype == self.dtype
            and t.device == self.device
            and t._version == self.version
            and t.untyped_storage().nbytes() == self.nbytes
        )

    def _forward_autocast(self):
        # The forward's autocast state on the output's device; no context on the common path,
        # autocast off both in the forward and now.
        if self.autocast is None:
            return _NO_SCOPE
        enabled, dtype = self.autocast
        dev = self.device.type
        if not enabled and not torch.is_autocast_enabled(dev):
            return _NO_SCOPE
        return torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=False)

    def rebuild(self) -> torch.Tensor:
        if self.cache is None:
            if tuple(t._version for t in self.inputs) != self.input_versions:
                raise RuntimeError(
                    "surgery: a tensor needed to recompute an activation for the backward was "
                    "modified in place after the forward (an input of an RMSNorm or of the gated "
                    "MLP activation); patch with recompute_norm_output=False / "
                    "recompute_mlp_product=False to keep the activation instead"
                )
            if tuple(t.shape for t in self.inputs) != self.input_shapes:
                raise RuntimeError(
                    "surgery: a tensor needed to recompute an activation for the backward changed "
                    "shape since the forward (a parameter released outside its module's call, as "
                    "DeepSpeed ZeRO-3 does); patch with recompute_norm_output=False / "
                    "recompute_mlp_product=False to keep the activation instead"
                )
            with torch.no_grad(), self._forward_autocast():
                out = self.fn(*self.inputs)
            if out.size() != self.size or out.stride() != self.stride or out.dtype != self.dtype:
                raise RuntimeError(  # a bug, never expected: the rebuild is the forward's kernel
                    f"surgery: recomputed activation has shape {tuple(out.shape)}, strides "
                    f"{out.stride()}, {out.dtype}; expected {tuple(self.size)}, {self.stride}, "
                    f"{self.dtype}"
                )
            self.cache = out
        return self.cache


class _Packed:
    """What a hooked save stores for a view of a registered output."""

    __slots__ = ("offset", "size", "source", "stride")

    def __init__(self, source: _Source, t: torch.Tensor):
        self.source = source
        self.size, self.stride = t.size(), t.stride()
        self.offset = t.storage_offset() - source.offset


def _pack(t: torch.Tensor):
    if _SOURCES:
        try:
            source = _SOURCES.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            source = None
        if source is not None and source.matches(t):
            return _Packed(source, t)
    # Saved as it is, with the in-place check autograd does for saves without hooks.
    return t, t._version


def _unpack(packed):
    if type(packed) is tuple:
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: tensor of shape {tuple(t.shape)} is at version {t._version}; "
                f"expected version {version} instead (saved inside a surgery recompute scope)"
            )
        return t
    rebuilt = packed.source.rebuild()
    return rebuilt.as_strided(packed.size, packed.stride, rebuilt.storage_offset() + packed.offset)


def recording() -> bool:
    """Whether saved-tensor hooks of ours would take effect now: grad mode on, eager (not traced
    by torch.compile), hooks enabled, and no other saved-tensor hooks active."""
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and torch._C._autograd._saved_tensors_hooks_is_enabled()
        and not _other_hooks_active()
    )


def _other_hooks_active() -> bool:
    # Private torch API, its argument (ignore_is_tracing) added in 2.x: unknown counts as active.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except TypeError:
        return top() is not None


def saved_tensor_scope(enabled: bool = True):
    """A context manager under which saved views of registered outputs are stored as references to
    their producers' inputs; a no-op one where that cannot work (see ``recording``)."""
    if enabled and recording():
        return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    return _NO_SCOPE


def _forget(key: int, source_ref: weakref.ref) -> Callable:
    def callback(_):
        # Only this registration's entry: the address may have been registered again since.
        if _SOURCES.get(key) is source_ref():
            del _SOURCES[key]

    return callback


def register(output: torch.Tensor, fn: Callable, *inputs: torch.Tensor) -> None:
    """Declare that ``fn(*inputs)`` (run under no_grad, and under the autocast state of this call)
    rebuilds ``output`` exactly: same values, shape, strides and dtype. Call it right after
    computing ``output`` from ``inputs`` in the producer, and only where ``recording()``; it is
    skipped unless the output requires grad (then autograd keeps the inputs for the producer's own
    backward)."""
    if not output.requires_grad or output.numel() == 0:
        return
    if any(hasattr(t, "ds_id") for t in inputs):
        # A DeepSpeed ZeRO-3 parameter is released (emptied in place) after its module's call:
        # nothing could be rebuilt from it in the backward. Keep the activation.
        return
    source = _Source(output, fn, inputs)
    key = output.untyped_storage().data_ptr()
    # The callback holds the key and a weak reference to the source: nothing that keeps the
    # output or the inputs alive. The source holds the weakref, so the callback runs while the
    # entry exists.
    source.output_ref = weakref.ref(output, _forget(key, weakref.ref(source)))
    _SOURCES[key] = source


# ---------------------------------------------------------------------------------------------
# under torch.compile


def compiling_with_grad() -> bool:
    """Whether torch.compile is tracing a forward whose backward it will build (grad mode on)."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


def compiled_recompute(fn: Callable, *args, modules: tuple[nn.Module | None, ...] = ()):
    """``fn(*args)`` traced as an activation-checkpoint region of its own, so that the compiler's
    partitioner rebuilds its output in the backward (from ``args``) instead of keeping it. Call it
    only where ``compiling_with_grad()``, with ``fn`` deterministic and its tensor arguments kept
    anyway (by its own backward, or shared, as an attention mask), so that the rebuild keeps
    nothing more. ``modules``: those ``fn`` calls, whose parameters it reads without taking them
    as arguments. A DeepSpeed ZeRO-3 parameter among the arguments or those (released after its
    module's call) makes it a plain call."""
    params = [p for m in modules if m is not None for p in m.parameters()]
    if any(isinstance(t, torch.Tensor) and hasattr(t, "ds_id") for t in (*args, *params)):
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=False
    )
