"""A cheaper way to launch an already compiled Triton kernel.

``kernel[grid](*args, **constexprs)`` (``JITFunction.run``) binds every argument, specializes
each one, turns the specialization into a string key, looks the compiled kernel up and launches
it: 25-40 us of host time per launch for a 30-argument kernel on the GPU machine, more than the
kernel itself takes on a (4, 32, 2048, 128) RoPE, and two to three times as much on the autograd
engine's device thread, where backward functions run. ``FastLauncher`` keeps its own cache, keyed
on everything Triton's own cache key holds and more: the device; the options ``JITFunction.run``
reads from Triton's knobs on every launch (``knobs.runtime.debug``,
``knobs.compilation.instrumentation_mode`` and, in 3.9, ``fpsan_homomorphic_casts``); every
constexpr and launch option, and every scalar argument, by exact value and type; each tensor's
dtype and address modulo 128 (Triton specializes on 16-byte alignment). The first launch of a key
goes through ``JITFunction.run`` (which compiles, or finds the kernel compiled); later ones call
the compiled kernel's launcher directly, after the check ``JITFunction.run`` makes on every launch
that the global variables the kernel reads still hold the values it was compiled with (when one
changed, the launch goes through ``JITFunction.run``, which raises Triton's error). A finer key
can only cost a cache miss, never a kernel compiled for other arguments: a new sequence length is
a miss, then cached (up to ``MAX_ENTRIES`` keys per kernel).

The direct call uses the compiled kernel's launcher the way ``JITFunction.run`` does in the
Triton releases it was verified against on the GPU (3.6 and 3.9, checked at import); on any other
release, for kernels with annotated or ``do_not_specialize`` parameters, and whenever Triton's
launch hooks (a profiler), pre-run hooks or stage-inspection hook are set, every launch goes
through ``JITFunction.run``. ``launch(fn, grid, *args, **constexprs)`` is ``fn[grid](...)`` through
a ``FastLauncher`` made for ``fn`` on its first launch (the RMSNorm, gated-activation and
gather-sum kernels; compiled, their ops are called per layer and step like any other). Switches:

- ``SURGERY_FAST_LAUNCH=0``: every launch through ``JITFunction.run`` (read when a launcher is
  made, that is when the kernel modules are imported).
- ``SURGERY_VERIFY_LAUNCH=1``: every launch of a cached key goes through ``JITFunction.run``
  instead, and the compiled kernel Triton picks must be the one cached under the key (read at
  import; tests/kernels/test_launch.py runs the RoPE kernels both ways on the GPU).
"""

from __future__ import annotations

import operator
import os
from typing import Any

import torch

from .dispatch import off_current_device, triton_available

__all__ = ["FastLauncher", "keyed_compilation_knobs", "launch"]

# Per verified release, the ``knobs.compilation`` options that JITFunction.run adds to the launch
# options its cache key is made of (runtime/jit.py of 3.6.0 and 3.9.0; both add
# ``knobs.runtime.debug`` too). Both launch as ``kernel.run(grid_0, grid_1, grid_2, stream,
# kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` with
# ``args`` every parameter's value in signature order.
_VERIFIED_RELEASES = {
    (3, 6): ("instrumentation_mode",),
    (3, 9): ("instrumentation_mode", "fpsan_homomorphic_casts"),
}
VERIFY = os.environ.get("SURGERY_VERIFY_LAUNCH", "0") not in ("", "0")
"""Launch every cached key through Triton's own path instead and check that Triton picks the
cached kernel (read once, at import)."""
MAX_ENTRIES = 4096
_MISSING = object()


def keyed_compilation_knobs(version: str) -> tuple[str, ...] | None:
    """The ``knobs.compilation`` options Triton ``version`` keys its kernel cache on, or None for a
    release the direct launch was not verified against."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return _VERIFIED_RELEASES.get((major, minor))


def _installed_release_knobs() -> tuple[str, ...] | None:
    if not triton_available():
        return None
    import triton

    return keyed_compilation_knobs(triton.__version__)


_KEYED_COMPILATION_KNOBS = _installed_release_knobs()


def _hook_active(hook) -> bool:
    # Triton 3.6+ keeps launch hooks in a HookChain (always set, empty unless a profiler adds to
    # it); older releases and users may set a plain callable.
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """Launches ``fn`` (a ``@triton.jit`` function whose tensor parameters all come first, then
    its scalar ones, then its constexprs) like ``fn[grid](*tensors, *scalars, **constexprs)``.

    ``constexprs`` is a tuple of (name, value) pairs: every constexpr parameter (defaults are not
    filled in) and launch options such as ``num_warps``. A caller that builds it in the same order
    every time hits the cache; another order is only a miss.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self._cache: dict[Any, Any] = {}
        self._constexpr_names: list[str] = []
        self._direct = False
        params = getattr(fn, "params", None)  # None for the interpreter's InterpretedFunction
        enabled = os.environ.get("SURGERY_FAST_LAUNCH", "1") not in ("", "0")
        if not enabled or params is None or _KEYED_COMPILATION_KNOBS is None:
            return
        n_runtime = sum(not p.is_constexpr for p in params)
        # The direct path needs every runtime parameter plain and before every constexpr one.
        self._direct = all(
            not p.is_constexpr
            and not p.do_not_specialize
            and not p.do_not_specialize_on_alignment
            and not p.annotation
            for p in params[:n_runtime]
        ) and all(p.is_constexpr for p in params[n_runtime:])
        self._constexpr_names = [p.name for p in params[n_runtime:]]
        from triton import knobs
        from triton.runtime import driver

        # Bound once: the launch path runs per layer and step.
        self._runtime, self._compilation, self._driver = knobs.runtime, knobs.compilation, driver
        self._compilation_options = operator.attrgetter(*_KEYED_COMPILATION_KNOBS)

    def _hooks_set(self) -> bool:
        runtime = self._runtime
        return bool(
            self.fn.pre_run_hooks
            or _hook_active(runtime.launch_enter_hook)
            or _hook_active(runtime.launch_exit_hook)
            or getattr(runtime, "add_stages_inspection_hook", None) is not None
        )

    def _key(self, device, tensors, scalars, constexprs) -> tuple:
        # Types too: 1, 1.0 and True are equal keys in Python, but an i32, an fp32 and an i1
        # argument (or constexprs printed differently) to Triton.
        return (
            device,
            self._runtime.debug,
            self._compilation_options(self._compilation),
            constexprs,
            tuple(type(value) for _, value in constexprs),
            scalars,
            tuple(map(type, scalars)),
            *[(t.dtype, t.data_ptr() & 127) for t in tensors],
        )

    def _globals_unchanged(self) -> bool:
        """JITFunction.run's check, on every launch, that the globals the kernel reads still hold
        the values it was compiled with."""
        for (name, _), (value, scope) in self.fn.used_global_vals.items():
            if scope.get(name, _MISSING) != value:  # compared as Triton compares
                return False
        return True

    def __call__(
        self,
        grid: tuple[int, int, int],
        tensors: tuple[torch.Tensor, ...],
        scalars: tuple,
        constexprs: tuple[tuple[str, Any], ...],
    ) -> None:
        """Launch on the first tensor's CUDA device (made current for the launch if it is not)
        and that device's current stream."""
        first = tensors[0]
        if off_current_device(first):
            with torch.cuda.device(first.device):
                return self(grid, tensors, scalars, constexprs)
        if not self._direct or not first.is_cuda or self._hooks_set():
            self.fn[grid](*tensors, *scalars, **dict(constexprs))
            return
        driver = self._driver
        device = driver.active.get_current_device()
        key = self._key(device, tensors, scalars, constexprs)
        entry = self._cache.get(key)
        if entry is None or VERIFY or not self._globals_unchanged():
            # Triton's own path picks (and launches) the kernel for these arguments: compiled or
            # found on a miss, and with VERIFY the very one cached under this key.
            options = dict(constexprs)
            kernel = self.fn[grid](*tensors, *scalars, **options)
            if hasattr(kernel, "result"):  # asynchronous compilation
                kernel = kernel.result()
            if entry is None and kernel is not None:  # None: a jit_cache_hook skipped compiling
                if len(self._cache) >= MAX_ENTRIES:
                    self._cache.clear()
                self._cache[key] = (kernel, tuple(options[n] for n in self._constexpr_names))
            elif entry is not None and VERIFY and kernel is not entry[0]:
                raise RuntimeError(
                    f"FastLauncher({self.fn.__name__}): Triton picks another compiled kernel "
                    "for these arguments than the one cached under their key"
                )
            return
        kernel, values = entry
        kernel.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device),
                   kernel.function, kernel.packed_metadata, None, None, None, *tensors, *scalars,
                   *values)  # fmt: skip


_LAUNCHERS: dict[Any, FastLauncher] = {}


def launch(fn, grid: tuple[int, ...], *args, **constexprs) -> None:
    """``fn[grid](*args, **constexprs)`` through ``fn``'s ``FastLauncher`` (made on its first
    launch). ``args``: the kernel's runtime parameters in signature order, its tensors first;
    ``constexprs``: its constexpr parameters and launch options (``num_warps``), named in the same
    order at every launch of one call site (another order is only a cache miss); ``grid``: one to
    three dimensions."""
    launcher = _LAUNCHERS.get(fn)
    if launcher is None:
        launcher = _LAUNCHERS.setdefault(fn, FastLauncher(fn))
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    if any(isinstance(a, torch.Tensor) for a in args[n:]):
        raise TypeError(f"launch({fn.__name__}): tensor arguments must come first")
    launcher((*grid, 1, 1)[:3], args[:n], args[n:], tuple(constexprs.items()))
