"""A generic forward called with the arguments of the transformers forward it replaces.

transformers' forwards of one kind of module take the same arguments in other orders (Gemma 4's
attention takes ``shared_kv_states`` before ``past_key_values``, Gemma 3n's after; Ministral 3's
takes ``position_ids`` between ``attention_mask`` and ``past_key_values``), and a caller may pass
any of them by position. The generic forwards read their arguments by name, so one generic forward
serves every order: ``in_signature_of`` gives it the original's order, read once at patch time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

__all__ = ["in_signature_of"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _positional_names(function: Callable) -> list[str]:
    """The names of ``function``'s positional parameters after ``self``."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [p.name for p in params if p.kind in _POSITIONAL]


@functools.cache
def in_signature_of(generic: Callable, original: Callable) -> Callable:
    """``generic`` (a forward ``(self, ...)`` that takes every argument by name) taking its
    arguments as ``original`` (a class's ``forward``) does: an argument passed by position is
    passed on under the name ``original`` gives that position, one passed by name as it is. The
    result reports ``original``'s signature, so ``surgery.swap.check_signature`` accepts it.

    ``generic`` itself when its positional parameters begin with ``original``'s, in order (then a
    positional call already means the same). A name of ``original`` that ``generic`` neither names
    nor takes in its ``**kwargs`` raises ``RuntimeError`` (a transformers release whose forward
    takes something the generic one cannot). One function per pair, shared by every module of the
    class.
    """
    theirs, ours = _positional_names(original), _positional_names(generic)
    if ours[: len(theirs)] == theirs:
        return generic
    params = inspect.signature(generic).parameters
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [name for name in theirs if name not in params and not takes_any]
    if unknown:
        raise RuntimeError(
            f"surgery cannot patch {original.__qualname__}: {generic.__name__} takes no argument "
            f"{unknown[0]!r}; this transformers version is not supported"
        )
    names = tuple(theirs)

    def forward(self, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError(
                f"{original.__qualname__}() takes {len(names)} positional arguments after self "
                f"but {len(args)} were given"
            )
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{original.__qualname__}() got multiple values for {name!r}")
            kwargs[name] = value
        return generic(self, **kwargs)

    forward.__name__ = generic.__name__
    forward.__qualname__ = generic.__qualname__
    forward.__doc__ = generic.__doc__
    forward.__module__ = generic.__module__
    forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    return forward
