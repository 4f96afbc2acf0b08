"""Forwards that other code put on a model before ``surgery.patch``: which are wrapped, which are
refused.

surgery replaces transformers' own forwards and nothing else. For each module it is about to
patch it finds where the forward that runs now comes from:

- the class's forward, with no instance forward: it must be transformers' own (or torch's
  ``nn.Linear.forward`` for the lm_head). A forward another library set on the class
  (Liger-Kernel's ``apply_liger_kernel_to_<model>()`` does) is refused;
- accelerate's hook (``add_hook_to_module``: ``device_map`` dispatch, disk/CPU offload): the
  hook's forward moves the weights and inputs onto the device, then calls
  ``module._old_forward``. surgery replaces that inner forward and keeps the hook;
- accelerate's mixed-precision wrapper (``Accelerator.prepare`` with ``mixed_precision``): a chain
  of wrappers built for this one model (fp32 outputs around ``torch.autocast`` around the model's
  forward), each pointing at the next through ``__wrapped__``. surgery replaces the innermost
  forward inside that chain, so the patched forward runs under accelerate's autocast;
- transformers' tensor parallelism (``from_pretrained(tp_plan=...)``): a forward on the instance
  that converts the inputs and outputs of the module's own forward to and from the DTensor
  layouts of its sharded parameters (``TENSOR_PARALLEL``). The lm_head's is replaced by the
  patched head, which computes the loss vocabulary-parallel on the head's rows and calls it for
  logits; modules surgery has no tensor-parallel kernel for are left to transformers
  (``api.patch``);
- anything else (another library's instance forward, a user's wrapper): refused with
  ``ForeignForwardError``, which names the function and the library it likely comes from, and
  nothing is changed. Replacing it would silently drop what it does.

Only chains whose outermost wrapper is accelerate's are walked: accelerate builds them per model,
so a reference replaced inside one changes that model alone.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "KERNEL_LIBRARIES",
    "TENSOR_PARALLEL",
    "ForeignForwardError",
    "ForwardSlot",
    "find_forward_slot",
    "foreign_kernel_modules",
    "hooked",
    "library_of",
    "lifted_hook",
    "restore_forward",
    "tensor_parallel_forward",
]

TENSOR_PARALLEL = "transformers' tensor parallelism"
"""The ``ForwardSlot.wrapper`` of a module whose forward transformers' tensor parallelism set."""

# Top-level packages of libraries that patch transformers models with kernels of their own.
KERNEL_LIBRARIES = {
    "liger_kernel": "Liger-Kernel",
    "unsloth": "Unsloth",
    "unsloth_zoo": "Unsloth",
    "cut_cross_entropy": "Cut Cross-Entropy",
}
_LIBRARY_NAMES = {
    **KERNEL_LIBRARIES,
    "trl": "TRL",
    "peft": "PEFT",
    "accelerate": "accelerate",
    "deepspeed": "DeepSpeed",
    "torch": "PyTorch",
    "transformers": "transformers",
}


class ForeignForwardError(RuntimeError):
    """A module surgery would patch runs a forward that neither transformers nor a wrapper surgery
    knows how to keep installed; ``surgery.patch`` changed nothing."""


def _function_of(obj: Any) -> Any:
    """The function behind a bound method or a ``functools.partial``."""
    obj = getattr(obj, "__func__", obj)
    return obj.func if isinstance(obj, functools.partial) else obj


def _module_name(obj: Any) -> str:
    obj = _function_of(obj)
    name = getattr(obj, "__module__", None)
    return name if isinstance(name, str) else type(obj).__module__


def library_of(obj: Any) -> str:
    """The library a function or class most likely comes from, for messages."""
    top = _module_name(obj).partition(".")[0]
    return _LIBRARY_NAMES.get(top, top)


def _describe(obj: Any) -> str:
    obj = _function_of(obj)
    qualname = getattr(obj, "__qualname__", type(obj).__qualname__)
    return f"{_module_name(obj)}.{qualname} ({library_of(obj)})"


def _is_own_function(function: Any) -> bool:
    """transformers' or torch's own code, not a function another library put in its place."""
    return _module_name(function).partition(".")[0] in ("transformers", "torch")


# ---------------------------------------------------------------------------------------------
# where a module's forward lives


@dataclass
class _Reference:
    """One place that holds a callable: a key of a ``__dict__``, or a closure cell (with the
    function owning it, whose ``__wrapped__`` follows the cell)."""

    holder: Any
    key: str | None = None
    owner: Any = None

    def get(self) -> Any:
        return self.holder.cell_contents if self.key is None else self.holder[self.key]

    def set(self, value: Any) -> None:
        old = self.get()
        if self.key is None:
            self.holder.cell_contents = value
        else:
            self.holder[self.key] = value
        owner = self.owner
        if owner is not None and getattr(owner, "__wrapped__", None) is old:
            owner.__wrapped__ = value  # accelerate unwraps along __wrapped__


_MISSING = object()


@dataclass
class ForwardSlot:
    """Where a module's effective forward is held, and how to put another one there.

    ``reference`` is None for the class's forward with no instance forward (then the patched
    forward becomes the instance forward); ``current`` is what the slot holds now (None in that
    case); ``wrapper`` names what is kept around it (None: nothing)."""

    module: nn.Module
    reference: _Reference | None
    current: Any
    wrapper: str | None

    def install(self, function: Callable) -> Any:
        """Put ``function`` (a plain function taking the module first) in the slot, bound to the
        module or not as the slot's callers expect; return what was installed."""
        module = self.module
        if self.reference is None:
            value: Any = types.MethodType(function, module)
            module.__dict__["forward"] = value
            return value
        # The instance's own ``forward`` is called as module.forward(...): bound there (what it
        # held may be a bound method or a closure, transformers' tensor-parallel one); inside
        # accelerate's chain, bound or not as what it replaces.
        bound = _is_instance_forward(self.reference, module) or inspect.ismethod(self.current)
        value = types.MethodType(function, module) if bound else function
        self.reference.set(value)
        return value


def restore_forward(module: nn.Module, installed: Any, previous: Any) -> bool:
    """Put ``previous`` (a ``ForwardSlot.current``) back where ``installed`` is held now: the slot
    it was installed in, or, when accelerate wrapped the patched model afterwards
    (``Accelerator.prepare`` wraps the forward it finds), inside accelerate's chain. False when
    ``installed`` is found nowhere (other code replaced it)."""
    # accelerate's unwrap_model(keep_fp32_wrapper=False) leaves the innermost function of the
    # chain it strips, bound anew: the patched function without its decorators.
    function = getattr(installed, "__func__", installed)
    targets = (installed, function, inspect.unwrap(function))
    top = module.__dict__.get("forward", _MISSING)
    references: Iterator[_Reference] = iter(())
    if top is not _MISSING:
        top_reference = _Reference(module.__dict__, "forward")
        if _accelerate_hooked(module, top) or _accelerate_wrapper(top):
            references = _chain(module, top_reference)
        else:
            references = iter((top_reference,))
    for reference in references:
        current = reference.get()
        if not any(getattr(current, "__func__", current) is t for t in targets):
            continue
        own = _is_instance_forward(reference, module)
        if previous is None and own:
            del module.__dict__["forward"]
            return True
        if previous is None:  # the class forward, inside a chain built after patching
            previous = inspect.getattr_static(type(module), "forward")
        # Bound or not, as the holder's caller expects (accelerate keeps the bare function); the
        # instance's own forward gets back exactly what it held.
        if own or inspect.ismethod(current) == inspect.ismethod(previous):
            reference.set(previous)
        elif inspect.ismethod(current):
            reference.set(types.MethodType(previous, module))
        else:
            reference.set(previous.__func__)
        return True
    return False


def _is_instance_forward(reference: _Reference, module: nn.Module) -> bool:
    """Whether ``reference`` is the module instance's own ``forward`` attribute."""
    return reference.holder is module.__dict__ and reference.key == "forward"


def lifted_hook(*args) -> None:
    """What stands in a hook table for a hook surgery lifted while the module is patched (its
    forward does what the hook did: ``surgery.patching.swap``): it returns None, which leaves the
    inputs or the output as they are. Standing in the lifted hook's place keeps the table's order
    and handles as the caller knows them."""
    return None


def hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks besides its forward: forward, pre-forward, backward or
    pre-backward hooks of its own (not counting ``lifted_hook``), or global forward ones
    (DeepSpeed's gathers). A forward that reads such a module's weights instead of calling it
    would skip them."""
    hooks = nn.modules.module

    def runs(table) -> bool:
        return any(hook is not lifted_hook for hook in table.values())

    return bool(
        runs(module._forward_hooks)
        or runs(module._forward_pre_hooks)
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
    )


def tensor_parallel_forward(forward: Any) -> bool:
    """Whether ``forward`` is the one transformers' tensor parallelism sets on a sharded module's
    instance (``TensorParallelLayer.install_forward``, transformers 5.17 and later)."""
    return _module_name(forward) == "transformers.distributed.tensor_parallel" and getattr(
        forward, "__qualname__", ""
    ).endswith("install_forward.<locals>.tp_forward")


def _accelerate_hooked(module: nn.Module, forward: Any) -> bool:
    return (
        isinstance(forward, functools.partial)
        and _module_name(forward.func) == "accelerate.hooks"
        and "_old_forward" in module.__dict__
        and getattr(module, "_hf_hook", None) is not None
    )


def _accelerate_wrapper(forward: Any) -> bool:
    function = getattr(forward, "__func__", forward)
    wrapped = getattr(function, "__wrapped__", None)
    return wrapped is not None and library_of(type(wrapped)) == "accelerate"


def _inner_reference(outer: Any) -> _Reference | None:
    """Where ``outer`` (one wrapper of a chain) holds the next callable, ``outer.__wrapped__``."""
    function = getattr(outer, "__func__", outer)
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        return None
    for cell in getattr(function, "__closure__", None) or ():
        try:
            if cell.cell_contents is inner:
                return _Reference(cell, None, function)
        except ValueError:  # an empty cell
            continue
    attrs = getattr(function, "__dict__", {})
    for key, value in attrs.items():
        if value is inner and key != "__wrapped__":
            return _Reference(attrs, key, function)
    return None


def _chain(module: nn.Module, top: _Reference) -> Iterator[_Reference]:
    """The references of a chain of accelerate's wrappers from ``top`` inwards (hooks and
    autocast wrappers, nested in any order). Called only on a chain whose outermost wrapper is
    accelerate's, so every link was built for this model."""
    reference: _Reference | None = top
    for _ in range(16):  # a chain is a handful of wrappers; bound the walk on a cycle
        if reference is None:
            return
        yield reference
        current = reference.get()
        if _accelerate_hooked(module, current):
            reference = _Reference(module.__dict__, "_old_forward")
        else:
            reference = _inner_reference(current)


def _is_class_forward(module: nn.Module, obj: Any, class_forward: Callable) -> bool:
    if inspect.ismethod(obj):
        return obj.__self__ is module and obj.__func__ is class_forward
    return obj is class_forward


def find_forward_slot(module: nn.Module, what: str) -> ForwardSlot:
    """The slot holding ``module``'s effective forward, which must be transformers' (or torch's)
    own class forward, possibly wrapped by accelerate. Raises ``ForeignForwardError`` otherwise;
    ``what`` names the module in the message."""
    class_forward = inspect.getattr_static(type(module), "forward")
    if not _is_own_function(class_forward):
        raise ForeignForwardError(
            f"surgery.patch: {what} ({type(module).__name__}) runs {_describe(class_forward)}, "
            f"set on the class {type(module).__qualname__} in place of transformers' own forward; "
            "surgery patches transformers' forwards only. " + _advice(class_forward)
        )
    instance = module.__dict__.get("forward", _MISSING)
    if instance is _MISSING:
        return ForwardSlot(module, None, None, None)
    top = _Reference(module.__dict__, "forward")
    if _is_class_forward(module, instance, class_forward):
        return ForwardSlot(module, top, instance, None)
    if tensor_parallel_forward(instance):
        return ForwardSlot(module, top, instance, TENSOR_PARALLEL)
    if _accelerate_hooked(module, instance) or _accelerate_wrapper(instance):
        for reference in _chain(module, top):
            current = reference.get()
            if _is_class_forward(module, current, class_forward):
                wrapper = "accelerate's hook" if reference.key == "_old_forward" else "accelerate"
                return ForwardSlot(module, reference, current, wrapper)
        instance = current
    raise ForeignForwardError(
        f"surgery.patch: {what} ({type(module).__name__}) has the forward "
        f"{_describe(instance)} set on the instance by other code; surgery keeps accelerate's "
        "hooks and mixed-precision wrapper but does not replace or drop other forwards. "
        + _advice(instance)
    )


def _advice(obj: Any) -> str:
    library = library_of(obj)
    if library == "Liger-Kernel":
        return (
            "Liger-Kernel's patches (apply_liger_kernel_to_*, _apply_liger_kernel_to_instance) "
            "and surgery replace the same forwards: use one of them. Liger's class-level "
            "patches last for the whole process, so run surgery in a process that never "
            "applies them. Nothing was changed."
        )
    return (
        f"Patch the model before {library} changes it, or undo that change first. "
        "Nothing was changed."
    )


def foreign_kernel_modules(model: nn.Module) -> list[str]:
    """``name (Class from Library)`` for each module of ``model`` whose class or instance
    forward comes from another kernel library (``KERNEL_LIBRARIES``)."""
    found = []
    for name, module in model.named_modules():
        for obj in (type(module), module.__dict__.get("forward")):
            if obj is None:
                continue
            top = _module_name(obj).partition(".")[0]
            if top in KERNEL_LIBRARIES:
                found.append(f"{name or type(module).__name__} ({_describe(obj)})")
                break
    return found
