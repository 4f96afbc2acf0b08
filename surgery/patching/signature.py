"""A generic forward called with the arguments of the transformers forward it replaces.

transformers' forwards of one kind of module take the same arguments in other orders (Gemma 4's
attention takes ``shared_kv_states`` before the cache, Gemma 3n's after; Ministral 3's
takes ``position_ids`` between ``attention_mask`` and the cache), and a caller may pass
any of them by position. The generic forwards read their arguments by name, so one generic forward
serves every order: ``in_signature_of`` gives it the original's order, read once at patch time.

transformers 5.24 renamed the cache argument ``past_key_values`` (and the linear-attention layers'
``cache_params``) to ``cache``, in every forward, mask builder and output. The generic forwards take
the new name; ``RENAMED`` holds the old ones as names for the same argument, in either release: an
old name passed by position takes the place of ``cache``, and passed by name is read by
``cache_argument``. What surgery passes to transformers' own code it passes under this release's
name, ``CACHE``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast

__all__ = [
    "CACHE",
    "RENAMED",
    "cache_argument",
    "generic_name",
    "in_signature_of",
    "update_cache",
]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

RENAMED = {"past_key_values": "cache", "cache_params": "cache"}
"""Old name -> the generic forwards' name, for arguments transformers renamed."""

CACHE = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
    else "past_key_values"
)
"""The name this transformers release gives the KV cache: its forwards' argument, its mask
builders' argument and its outputs' field (``cache`` from 5.24, ``past_key_values`` before)."""


def generic_name(name: str) -> str:
    """The generic forwards' name of transformers' argument ``name`` (``RENAMED``)."""
    return RENAMED.get(name, name)


def cache_argument(cache, kwargs: dict):
    """The cache a generic forward was given: ``cache``, or the one passed by an old name
    (``RENAMED``; taken out of ``kwargs``: transformers before 5.24 pass it so, and so may a
    caller's code written for them). Two given raises ``ValueError``, as transformers does."""
    for old in RENAMED:
        value = kwargs.pop(old, None)
        if value is None:
            continue
        if cache is not None:
            raise ValueError(f"both cache and {old} were given; pass the cache once")
        cache = value
    return cache


def update_cache(cache: Cache, key, value, layer_idx: int, kwargs: dict):
    """``cache.update`` as this release's attention layers call it: the release that renamed the
    cache (5.24) also hands it the layer's keyword arguments (continuous batching's paged cache
    reads and extends them in place); earlier ones do not."""
    if CACHE == "cache":
        return cache.update(key, value, layer_idx, kwargs=kwargs)
    return cache.update(key, value, layer_idx)


def _positional_names(function: Callable) -> list[str]:
    """The names of ``function``'s positional parameters after ``self``, renamed ones under the
    generic forwards' names (``RENAMED``)."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [generic_name(p.name) for p in params if p.kind in _POSITIONAL]


@functools.cache
def in_signature_of(generic: Callable, original: Callable) -> Callable:
    """``generic`` (a forward ``(self, ...)`` that takes every argument by name) taking its
    arguments as ``original`` (a class's ``forward``) does: an argument passed by position is
    passed on under the name ``original`` gives that position, one passed by name as it is. The
    result reports ``original``'s signature, so ``surgery.patching.swap.check_signature`` accepts
    it.

    ``generic`` itself when its positional parameters begin with ``original``'s, in order (then a
    positional call already means the same; a renamed argument (``RENAMED``) counts as its new
    name, which the generic forward reads with ``cache_argument``). A name of ``original`` that
    ``generic`` neither names nor takes in its ``**kwargs`` raises ``RuntimeError`` (a
    transformers release whose forward takes something the generic one cannot). One function per
    pair, shared by every module of the class.
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
