"""A cheaper way to launch an already compiled Triton kernel.

``kernel[grid](*args, **constexprs)`` (``JITFunction.run``) binds every argument, specializes
each one, turns the specialization into a string key, looks the compiled kernel up and launches
it: 25-40 us of host time per launch for a 30-argument kernel on the GPU machine, more than the
kernel itself takes on a (4, 32, 2048, 128) RoPE, and two to three times as much on the autograd
engine's device thread, where backward functions run. ``FastLauncher`` keeps its own cache, keyed
on more than Triton specializes on: the device, every constexpr and launch option, every scalar
argument's exact value, and each tensor's dtype and address modulo 128 (Triton specializes on
16-byte alignment). The first launch of a key goes through ``JITFunction.run`` (which compiles,
or finds the kernel compiled); later ones call the compiled kernel's launcher directly. A finer
key can only cost a cache miss, never a kernel compiled for other arguments: a new sequence length
is a miss, then cached (up to ``MAX_ENTRIES`` keys per kernel).

The direct call uses the compiled kernel's launcher the way ``JITFunction.run`` does in the
Triton releases this was checked against (3.6 and 3.9); on any other release, for kernels with
annotated or ``do_not_specialize`` parameters, and whenever Triton's launch hooks (a profiler),
pre-run hooks or stage-inspection hook are set, every launch goes through ``JITFunction.run``;
in debug mode (``TRITON_DEBUG``, read when a key is first seen) nothing is cached.
``SURGERY_VERIFY_LAUNCH=1`` sends every launch of a cached key through ``JITFunction.run``
instead and checks that the compiled kernel Triton picks is the one cached under the key
(tests/kernels/test_launch.py runs the RoPE kernels both ways on the GPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .dispatch import triton_available

__all__ = ["FastLauncher"]

# Releases whose JITFunction.run launches as ``kernel.run(grid_0, grid_1, grid_2, stream,
# kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``
# with ``args`` every parameter's value in signature order (read in 3.6 and 3.9), and whose
# specialization depends on nothing the key leaves out.
_CHECKED_RELEASES = ((3, 6), (3, 7), (3, 8), (3, 9))
VERIFY = os.environ.get("SURGERY_VERIFY_LAUNCH", "0") not in ("", "0")
"""Launch every cached key through Triton's own path instead and check that Triton picks the
cached kernel (read once, at import)."""
MAX_ENTRIES = 4096


def _release() -> tuple[int, int] | None:
    import triton

    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


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
        if params is None or not triton_available() or _release() not in _CHECKED_RELEASES:
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
        self._runtime, self._driver = knobs.runtime, driver

    def _hooks_set(self) -> bool:
        runtime = self._runtime
        return bool(
            self.fn.pre_run_hooks
            or _hook_active(runtime.launch_enter_hook)
            or _hook_active(runtime.launch_exit_hook)
            or getattr(runtime, "add_stages_inspection_hook", None) is not None
        )

    def __call__(
        self,
        grid: tuple[int, int, int],
        tensors: tuple[torch.Tensor, ...],
        scalars: tuple,
        constexprs: tuple[tuple[str, Any], ...],
    ) -> None:
        """Launch on the current CUDA device and stream, as ``fn[grid]`` does."""
        if not self._direct or not tensors[0].is_cuda or self._hooks_set():
            self.fn[grid](*tensors, *scalars, **dict(constexprs))
            return
        driver = self._driver
        device = driver.active.get_current_device()
        key = (device, constexprs, scalars, *[(t.dtype, t.data_ptr() & 127) for t in tensors])
        entry = self._cache.get(key)
        if entry is None:
            options = dict(constexprs)
            kernel = self.fn[grid](*tensors, *scalars, **options)  # compiles (or finds), launches
            if hasattr(kernel, "result"):  # asynchronous compilation
                kernel = kernel.result()
            if self._runtime.debug:  # TRITON_DEBUG: keep every launch on Triton's own path
                return
            if len(self._cache) >= MAX_ENTRIES:
                self._cache.clear()
            values = tuple(options[name] for name in self._constexpr_names)
            self._cache[key] = (kernel, values)
            return
        kernel, values = entry
        if VERIFY:
            # Triton's own path picks (and launches) the kernel for these arguments: it must be
            # the very one cached under this key.
            chosen = self.fn[grid](*tensors, *scalars, **dict(constexprs))
            if chosen is not kernel and getattr(chosen, "result", lambda: None)() is not kernel:
                raise RuntimeError(
                    f"FastLauncher({self.fn.__name__}): Triton picks another compiled kernel "
                    "for these arguments than the one cached under their key"
                )
            return
        kernel.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device),
                   kernel.function, kernel.packed_metadata, None, None, None, *tensors, *scalars,
                   *values)  # fmt: skip
