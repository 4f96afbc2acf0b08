"""Swapping one module's forward for a generic one, and putting it back.

A swap is planned first (``plan_swap``: where the forward lives now, see
``surgery.patching.foreign``, and whether the replacement takes the same arguments), then installed
with the others (``apply_swaps``, all or nothing). What a patched forward needs lives in plain
attributes of the module's ``__dict__`` (the swap's ``extra``), never in parameters, buffers or
submodules, so ``state_dict`` and ``named_modules`` are unchanged.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from surgery.patching.foreign import (
    TENSOR_PARALLEL,
    ForwardSlot,
    find_forward_slot,
    lifted_hook,
    restore_forward,
)
from surgery.patching.signature import generic_name

__all__ = [
    "ORIGINAL_ATTR",
    "Installed",
    "Swap",
    "apply_swaps",
    "check_signature",
    "is_swapped",
    "plan_swap",
    "restore_swap",
]

ORIGINAL_ATTR = "_surgery_original_forward"
"""Key of a patched module's ``Installed`` record in its ``__dict__``."""


@dataclass(frozen=True)
class Installed:
    """What was installed on a module, what it replaced (``ForwardSlot.current``: None for the
    class forward), the names of the attributes added beside it, and the hooks lifted from it as
    (hook table, handle id, hook)."""

    value: Any
    previous: Any
    extra: tuple[str, ...] = ()
    lifted: tuple[tuple[str, int, Callable], ...] = ()


@dataclass
class Swap:
    """One planned swap: checked before anything is changed. ``lift``: hooks (hook table such as
    ``"_forward_pre_hooks"``, handle id) the new forward does itself, lifted while the module is
    patched (torch's tensor-parallel layout hooks: ``surgery.forwards.tensor_parallel``): in the
    table ``lifted_hook`` stands in the hook's place, so hooks others add or remove meanwhile keep
    their order and handles, and ``unpatch`` puts the hook back in its place (unless its handle
    was removed meanwhile)."""

    module: nn.Module
    function: Callable
    extra: dict[str, Any]
    slot: ForwardSlot
    lift: tuple[tuple[str, int], ...] = ()


def is_swapped(module: nn.Module) -> bool:
    return ORIGINAL_ATTR in module.__dict__


def _positional(sig: inspect.Signature, drop_self: bool) -> list[inspect.Parameter]:
    params = list(sig.parameters.values())
    return params[1:] if drop_self else params


def check_signature(module: nn.Module, original: Callable, replacement: Callable) -> None:
    """The replacement must accept every argument the original accepts, in the same positions
    (callers pass them by position too): a transformers release that changes a forward fails
    here, not silently. An argument transformers renamed counts under its new name on both sides
    (``surgery.patching.signature.RENAMED``)."""
    orig = _positional(inspect.signature(original), drop_self=not inspect.ismethod(original))
    repl = _positional(inspect.signature(replacement), drop_self=True)
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    repl_positional = [generic_name(p.name) for p in repl if p.kind in positional_kinds]
    repl_names = {generic_name(p.name) for p in repl}
    repl_var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in repl)
    i = 0
    for p in orig:
        name = generic_name(p.name)
        if p.kind in positional_kinds:
            ok = i < len(repl_positional) and repl_positional[i] == name
            i += 1
        elif p.kind == inspect.Parameter.KEYWORD_ONLY:
            ok = name in repl_names or repl_var_kw
        elif p.kind == inspect.Parameter.VAR_KEYWORD:
            ok = repl_var_kw
        else:  # *args: the replacement takes the named positionals only
            ok = False
        if not ok:
            raise RuntimeError(
                f"surgery cannot patch {type(module).__name__}.forward: transformers' "
                f"{inspect.signature(original)} does not match the replacement "
                f"{replacement.__name__}{inspect.signature(replacement)} at {p.name!r}; this "
                "transformers version is not supported"
            )


def plan_swap(module: nn.Module, function: Callable, extra: dict[str, Any], name: str,
              lift: tuple[tuple[str, int], ...] = ()):  # fmt: skip
    """The swap of ``module``'s forward for ``function`` (lifting the hooks ``lift`` names:
    ``Swap``), checked; None when already patched. Raises ``ForeignForwardError`` for a forward
    other code installed that surgery cannot keep, and ``RuntimeError`` for a signature this
    transformers version changed."""
    if ORIGINAL_ATTR in module.__dict__:
        return None  # already patched: a no-op
    slot = find_forward_slot(module, name or "the model")
    original = slot.current if slot.current is not None else type(module).forward
    if slot.wrapper == TENSOR_PARALLEL:  # (*args, **kwargs) around the module's own forward
        original = type(module).forward
    check_signature(module, original, function)
    return Swap(module, function, extra, slot, lift)


def apply_swaps(swaps: list[Swap]) -> None:
    """Install every planned swap; on any failure undo those already installed and re-raise."""
    done: list[nn.Module] = []
    try:
        for swap in swaps:
            module = swap.module
            value = swap.slot.install(swap.function)
            lifted = tuple((t, key, getattr(module, t)[key]) for t, key in swap.lift)
            for table, key in swap.lift:
                getattr(module, table)[key] = lifted_hook
            module.__dict__[ORIGINAL_ATTR] = Installed(
                value, swap.slot.current, tuple(swap.extra), lifted
            )
            done.append(module)
            module.__dict__.update(swap.extra)
    except BaseException:
        for module in reversed(done):
            restore_swap(module)
        raise


def restore_swap(module: nn.Module) -> None:
    installed: Installed | None = module.__dict__.get(ORIGINAL_ATTR)
    if installed is None:
        return
    if not restore_forward(module, installed.value, installed.previous):
        warnings.warn(
            f"surgery.unpatch: {type(module).__name__}.forward was replaced after surgery.patch "
            "(by another library?); leaving that module as it is",
            stacklevel=3,
        )
        return
    del module.__dict__[ORIGINAL_ATTR]
    for name in installed.extra:
        module.__dict__.pop(name, None)
    for table, key, hook in installed.lifted:
        hooks = getattr(module, table)
        if hooks.get(key) is lifted_hook:
            hooks[key] = hook
