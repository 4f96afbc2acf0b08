"""``apply_<name>(**options)`` / ``revert()``: patch the models of a class built from now on.

One ``apply_<name>`` per spec of the registry (``surgery.models.SPECS``), made here at import:
a text spec's causal LM together with the multimodal wrappers of its ``model_type``
(``apply_gemma3``: ``Gemma3ForCausalLM`` and ``Gemma3ForConditionalGeneration``), and every other
wrapper under its own ``model_type`` (``apply_qwen2_5_vl``; ``apply_mistral3``, one wrapper for
several text specs). Each wraps the classes' ``__init__`` so that a model built afterwards
(``from_pretrained``, ``from_config``, the constructor) is ``surgery.patch``-ed with the options;
``revert()`` puts every ``__init__`` back.

IDEs and type checkers do not run the loop that makes the functions: they read ``apply.pyi``
beside this file, generated from the registry by ``write_stub()`` (a test checks that it names
exactly the functions made here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from surgery.api import patch
from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS
from surgery.options import PatchOptions

# and apply_<name> for every spec (below); apply_targets and write_stub are this module's own
__all__ = ["revert"]

ClassGetters = tuple[tuple[str, Callable[[], type]], ...]
"""(class name, class getter) pairs: the classes one ``apply_<name>`` patches."""

_APPLIED: dict[type, Callable | None] = {}


def apply_targets() -> dict[str, ClassGetters]:
    """``apply_<name>`` -> the classes it patches, registry order, causal LMs first; nothing is
    imported."""
    targets: dict[str, list[tuple[str, Callable[[], type]]]] = {
        spec.apply_name: [(spec.causal_lm, spec.causal_lm_class)] for spec in SPECS
    }
    seen: set[tuple[str, str]] = set()
    for spec in SPECS + MULTIMODAL_ONLY_SPECS:
        for wrapper in spec.multimodal:
            if (wrapper.module, wrapper.wrapper) not in seen:
                seen.add((wrapper.module, wrapper.wrapper))
                name = "apply_" + wrapper.model_type
                targets.setdefault(name, []).append((wrapper.wrapper, wrapper.wrapper_class))
    return {name: tuple(classes) for name, classes in targets.items()}


def _patching_init(original_init: Callable, options: dict[str, Any]) -> Callable:
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        patch(self, **options)

    return __init__


def _apply(classes: ClassGetters, options: dict[str, Any]) -> None:
    options.pop("strict", None)
    options.pop("fallback", None)  # the class is supported
    PatchOptions(**options)  # fail now on a bad option, not in a later from_pretrained
    for _, get_class in classes:
        cls = get_class()
        _revert_class(cls)
        own_init = cls.__dict__.get("__init__")  # None: inherited (put back by deleting ours)
        cls.__init__ = _patching_init(own_init or cls.__init__, options)
        _APPLIED[cls] = own_init


def _revert_class(cls: type) -> None:
    if cls not in _APPLIED:
        return
    own_init = _APPLIED.pop(cls)
    if own_init is None:
        del cls.__init__
    else:
        cls.__init__ = own_init


def revert() -> None:
    """Undo every ``apply_<name>``: the classes get their own ``__init__`` back. Models built while
    applied stay patched until ``unpatch(model)``."""
    for cls in list(_APPLIED):
        _revert_class(cls)


def _apply_function(name: str, classes: ClassGetters) -> Callable[..., None]:
    def apply(**options: Any) -> None:
        _apply(classes, options)

    apply.__name__ = apply.__qualname__ = name
    names = " and ".join(f"``{class_name}``" for class_name, _ in classes)
    apply.__doc__ = (
        f"Patch every {names} built from now on (``from_pretrained``, ``from_config``, the "
        "constructor) with ``patch(model, **options)``; ``surgery.revert()`` undoes it. Applying "
        "again replaces the options."
    )
    return apply


for _name, _classes in apply_targets().items():
    globals()[_name] = _apply_function(_name, _classes)
    __all__.append(_name)
del _name, _classes

STUB = Path(__file__).with_suffix(".pyi")
"""The stub IDEs and type checkers read for this module."""


def stub() -> str:
    """The text of ``apply.pyi`` for the registry as it is."""
    names = list(apply_targets())
    lines = [
        "# Generated from the registry by surgery.apply.write_stub(): do not edit.",
        "from collections.abc import Callable",
        "from typing import Any",
        "",
        "__all__ = [",
        *(f'    "{name}",' for name in sorted(["revert", *names])),
        "]",
        "",
        "def apply_targets() -> dict[str, tuple[tuple[str, Callable[[], type]], ...]]: ...",
        "def revert() -> None: ...",
        "def stub() -> str: ...",
        "def write_stub() -> None: ...",
        *(f"def {name}(**options: Any) -> None: ..." for name in names),
    ]
    return "\n".join(lines) + "\n"


def write_stub() -> None:
    """Write ``apply.pyi`` for the registry as it is (after adding a spec)."""
    STUB.write_text(stub())
