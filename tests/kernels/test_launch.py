"""``FastLauncher`` (kernels/launch.py): launches compiled Triton kernels without
``JITFunction.run``'s per-call binding, and must never reuse a kernel compiled for another
specialization. On the GPU each case is launched through Triton (filling the cache), directly, and
with ``VERIFY`` (Triton's path, which must pick the cached kernel), each result against the
reference. On any machine: the key holds every option Triton keys on, only verified Triton
releases launch directly, and the off switch works.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl

import surgery.kernels.launch as launch
import surgery.kernels.rope as rope_mod
from surgery.kernels import apply_rope_reference
from surgery.kernels.gated_activation import (
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_merged_bwd,
    gated_activation_merged_fwd,
)
from surgery.kernels.gather_sum import _gather_sum
from surgery.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
from surgery.kernels.rope import rope_cos_sin_fwd, rope_fwd

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(B, Hq, Hk, T, D, offset, layout, dtype=torch.bfloat16):
    n_q, n_k = B * T * Hq * D, B * T * Hk * D
    flat = torch.randn(n_q + n_k + 2 * offset + 64, device="cuda").to(dtype)
    q = flat[offset : offset + n_q]
    k = flat[n_q + 2 * offset : n_q + 2 * offset + n_k]
    if layout == "hf":
        q, k = q.view(B, T, Hq, D).transpose(1, 2), k.view(B, T, Hk, D).transpose(1, 2)
    else:
        q, k = q.view(B, Hq, T, D), k.view(B, Hk, T, D)
    return q, k


CASES = [
    # (B, Hq, Hk, T, D, element offset, layout): aligned and unaligned pointers, strides that are
    # 1 (B = 1 position ids), multiples of 16 and odd (Hq = 3, D = 40, T = 7)
    (2, 4, 2, 16, 64, 0, "hf"),
    (2, 4, 2, 16, 64, 1, "hf"),
    (1, 3, 1, 7, 40, 0, "hf"),
    (1, 3, 1, 7, 40, 3, "contiguous"),
    (3, 8, 8, 33, 128, 8, "contiguous"),
]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_direct_launches_match_reference_and_tritons_choice(monkeypatch, pos_dtype):
    """Per case, three launches on new tensors of the same layout (same key, other addresses
    and values): the first through Triton (fills the cache), the second direct, the third with
    ``VERIFY`` (Triton's path, which must pick the kernel cached under the key); every result
    against the fp64 reference."""
    assert rope_mod._launch_rope._direct, "this Triton release is not on the checked list"
    for B, Hq, Hk, T, D, offset, layout in CASES:
        for verify in (False, False, True):
            monkeypatch.setattr(launch, "VERIFY", verify)
            q, k = _inputs(B, Hq, Hk, T, D, offset, layout)
            pos = torch.randint(0, 4096, (B if B > 1 else 1, T), device="cuda", dtype=pos_dtype)
            inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
            want = apply_rope_reference(q.double(), k.double(), pos, inv.double())
            cos = torch.cos(pos[..., None].float() * torch.cat([inv, inv]))
            sin = torch.sin(pos[..., None].float() * torch.cat([inv, inv]))
            for got in (rope_fwd(q, k, pos, inv, 1.0, D), rope_cos_sin_fwd(q, k, cos, sin)):
                for g, w in zip(got, want):
                    torch.testing.assert_close(
                        g.double(), w.to(g.dtype).double(), atol=2e-2, rtol=0
                    )
    assert len(rope_mod._launch_rope._cache) >= len(CASES)


def _launched_kernels() -> dict:
    """One launch of each kernel that goes through ``launch.launch`` (RMSNorm forward, backward
    and its dw sum; the gated activations, flat and merged, both ways; the gather-sum), on fixed
    tensors: name -> outputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    x, w, dy = randn(300, 2048), randn(2048), randn(300, 2048)
    gate, up, dout = randn(300, 1000), randn(300, 1000), randn(300, 1000)
    gate_up = randn(300, 2 * 768)
    values, weights = randn(64, 512), randn(160)
    index = torch.randint(0, 64, (160,), device="cuda", generator=gen)
    y, rstd = rms_norm_fwd(x, w, 1e-6)
    return {
        "rms_norm_fwd": (y, rstd),
        "rms_norm_bwd": rms_norm_bwd(dy, x, w, rstd),
        "gated_fwd": gated_activation_fwd(gate, up, "silu"),
        "gated_bwd": gated_activation_bwd(dout, gate, up, "silu"),
        "merged_fwd": gated_activation_merged_fwd(gate_up, "silu"),
        "merged_bwd": gated_activation_merged_bwd(gate_up[:, :768].contiguous(), gate_up, "silu"),
        "gather_sum": _gather_sum(values, index, 4, weights),
    }


@cuda
@pytest.mark.gpu
def test_norm_activation_and_gather_kernels_launch_as_triton_would(monkeypatch):
    """The kernels launched through ``launch.launch``: their outputs with every launch through
    ``JITFunction.run`` equal, bit for bit, those of the direct launches and of ``VERIFY``'s
    (Triton's path, which must pick the kernel cached under the key)."""
    _launched_kernels()  # every launcher made
    launchers = list(launch._LAUNCHERS.values())
    assert len(launchers) >= 7 and all(fl._direct for fl in launchers)
    for fl in launchers:
        monkeypatch.setattr(fl, "_direct", False)
    tritons = _launched_kernels()
    monkeypatch.undo()
    direct = _launched_kernels()
    monkeypatch.setattr(launch, "VERIFY", True)
    verified = _launched_kernels()
    assert all(fl._cache for fl in launchers)
    for name, want in tritons.items():
        for got in (direct[name], verified[name]):
            for g, t in zip(got, want, strict=True):
                assert torch.equal(g, t), name


def test_launch_passes_tensors_then_scalars_and_a_three_dimensional_grid(monkeypatch):
    """``launch.launch(fn, grid, *args, **constexprs)``: the leading tensors as the launcher's
    tensors, the rest as its scalars, the grid padded to three dimensions, the constexprs in the
    order given; a tensor after a scalar is refused (the direct launch keys tensors apart)."""
    seen = []
    monkeypatch.setattr(
        launch.FastLauncher, "__call__", lambda self, *call: seen.append((self.fn, call))
    )
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    a, b = torch.zeros(2), torch.ones(3)

    def fn():  # stands for a kernel: its launcher is mocked
        pass

    launch.launch(fn, (5,), a, b, 7, 0.5, BLOCK=16, num_warps=4)
    launch.launch(fn, (5, 2), a, 7)
    assert seen == [
        (fn, ((5, 1, 1), (a, b), (7, 0.5), (("BLOCK", 16), ("num_warps", 4)))),
        (fn, ((5, 2, 1), (a,), (7,), ())),
    ]
    assert len(launch._LAUNCHERS) == 1  # one launcher per kernel
    with pytest.raises(TypeError, match="tensor arguments must come first"):
        launch.launch(fn, (1,), a, 7, b)


@cuda
@pytest.mark.gpu
def test_launch_hooks_take_tritons_own_path(monkeypatch):
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(1))
    q, k = _inputs(1, 4, 2, 8, 64, 0, "hf")
    pos = torch.arange(8, device="cuda")[None]
    inv = torch.ones(32, device="cuda")
    for _ in range(2):
        rope_fwd(q, k, pos, inv, 1.0, 64)
    assert len(seen) == 2


def test_interpreter_or_cpu_falls_back():
    """Without CUDA (the interpreter's CPU tensors) every launch is Triton's own."""
    q = torch.randn(1, 2, 4, 8)
    calls = []

    class Fn:
        params = None

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launcher = launch.FastLauncher(Fn())
    assert not launcher._direct
    launcher((1, 1, 1), (q,), (3,), (("N", 4),))
    assert calls == [((1, 1, 1), (q, 3), {"N": 4})]


def test_hook_chains_count_only_when_they_hold_hooks():
    from surgery.kernels.launch import _hook_active

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_active(None) and not _hook_active(Chain([]))
    assert _hook_active(Chain([print])) and _hook_active(print)


# --------------------------------------------------------------------------------------------
# The key and the switches, on any machine: a stand-in for a JITFunction whose launches are
# recorded, and the key computed as a CUDA launch computes it.


class FakeParam:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr
        self.do_not_specialize = self.do_not_specialize_on_alignment = False
        self.annotation = ""


class FakeJITFunction:
    """What FastLauncher reads of a JITFunction: params, hooks, used globals, fn[grid](...)."""

    __name__ = "fake_kernel"

    def __init__(self):
        self.params = [FakeParam("x_ptr", False), FakeParam("n", False), FakeParam("BLOCK", True)]
        self.pre_run_hooks = []
        self.used_global_vals = {}
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _key(launcher, x, n=7, block=64):
    return launcher._key(torch.device("cpu"), (x,), (n,), (("BLOCK", block), ("num_warps", 4)))


@pytest.mark.parametrize(
    "knob",
    ["runtime.debug", "compilation.instrumentation_mode", "compilation.fpsan_homomorphic_casts"],
)
def test_key_changes_with_each_option_triton_keys_on(knob):
    """JITFunction.run adds these knobs to the options its cache key is made of (3.6: debug and
    instrumentation_mode; 3.9 also fpsan_homomorphic_casts): a kernel cached under one setting
    must not be launched under another."""
    from triton import knobs

    group, name = knob.split(".")
    if not hasattr(getattr(knobs, group), name):
        pytest.skip(f"triton {triton.__version__} has no knobs.{knob}")
    launcher = launch.FastLauncher(FakeJITFunction())
    assert launcher._direct
    x = torch.empty(16)
    before = _key(launcher, x)
    with getattr(knobs, group).scope():
        value = getattr(getattr(knobs, group), name)
        setattr(getattr(knobs, group), name, "nvidia" if isinstance(value, str) else not value)
        assert _key(launcher, x) != before
    assert _key(launcher, x) == before


def test_key_tells_apart_equal_values_of_other_types():
    """1, 1.0 and True are equal (and hash alike) in Python, not to Triton: an int, a float and a
    bool argument are different kernels, and so are constexprs of another type."""
    launcher = launch.FastLauncher(FakeJITFunction())
    x = torch.empty(16)
    assert len({_key(launcher, x, n=n) for n in (1, 1.0, True)}) == 3
    assert len({_key(launcher, x, block=b) for b in (1, 1.0, True)}) == 3


@pytest.mark.parametrize(
    "version,direct",
    [("3.6.0", True), ("3.9.0", True), ("3.9.1+git1234", True), ("3.7.0", False),
     ("3.10.0", False), ("4.0.0", False), ("nightly", False)],
)  # fmt: skip
def test_only_verified_triton_releases_launch_directly(monkeypatch, version, direct):
    """The direct launch was read against Triton 3.6 and 3.9: any other release (read once, at
    import) launches through JITFunction.run."""
    keyed = launch.keyed_compilation_knobs(version)
    assert (keyed is not None) == direct
    monkeypatch.setattr(launch, "_KEYED_COMPILATION_KNOBS", keyed)
    fn = FakeJITFunction()
    launcher = launch.FastLauncher(fn)
    assert launcher._direct == direct
    if not direct:
        x = torch.empty(16)
        launcher((2, 1, 1), (x,), (7,), (("BLOCK", 64),))
        assert fn.calls == [((2, 1, 1), (x, 7), {"BLOCK": 64})]


class CompiledKernel:
    """What the direct launch calls of a compiled kernel: ``run`` (recorded)."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return f"stream{device}"


class OnCuda(torch.Tensor):
    """A CPU tensor the launcher takes for a CUDA one: the direct path's logic without a GPU."""

    is_cuda = True


class PickingJITFunction(FakeJITFunction):
    """A ``FakeJITFunction`` whose own launches (Triton's path) return the compiled kernels
    given, in turn, as ``JITFunction.run`` returns the kernel it picked."""

    def __init__(self, compiled: list):
        super().__init__()
        self.picks = iter(compiled)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return next(self.picks)

        return run


def direct_launcher(monkeypatch, compiled: list) -> tuple[launch.FastLauncher, FakeJITFunction]:
    """A direct-launching ``FastLauncher`` over a ``PickingJITFunction``, on a fake driver."""
    fn = PickingJITFunction(compiled)
    monkeypatch.setattr(launch, "off_current_device", lambda t: False)
    launcher = launch.FastLauncher(fn)
    launcher._driver = FakeDriver
    assert launcher._direct
    return launcher, fn


def test_direct_launch_caches_the_kernel_triton_picks_and_runs_it(monkeypatch):
    """The GPU-only path, on the CPU: a new key goes through Triton's own launch and caches the
    kernel it returns; the same key again runs that kernel's launcher directly with Triton's
    arguments (grid, stream, function, metadata, no hooks, the tensors, scalars and constexpr
    values in signature order); another key (another scalar) is a miss; a kernel Triton did not
    compile (a cache hook's None) is not cached; past ``MAX_ENTRIES`` the cache starts again."""
    first, second = CompiledKernel(), CompiledKernel()
    launcher, fn = direct_launcher(monkeypatch, [first, second, None, CompiledKernel()])
    x = torch.Tensor._make_subclass(OnCuda, torch.zeros(4))
    launcher((2, 1, 1), (x,), (7,), (("BLOCK", 64),))
    assert len(fn.calls) == 1 and first.runs == []
    launcher((3, 1, 1), (x,), (7,), (("BLOCK", 64),))
    assert len(fn.calls) == 1
    assert first.runs == [(3, 1, 1, "stream0", "function", "metadata", None, None, None, x, 7, 64)]
    launcher((2, 1, 1), (x,), (8,), (("BLOCK", 64),))
    assert len(fn.calls) == 2 and len(launcher._cache) == 2
    launcher((2, 1, 1), (x,), (9,), (("BLOCK", 64),))  # Triton returned None: not cached
    assert len(fn.calls) == 3 and len(launcher._cache) == 2
    monkeypatch.setattr(launch, "MAX_ENTRIES", 2)
    launcher((2, 1, 1), (x,), (10,), (("BLOCK", 64),))
    assert len(launcher._cache) == 1


def test_verify_switch_raises_where_triton_picks_another_kernel(monkeypatch):
    """``SURGERY_VERIFY_LAUNCH``: a cached key launches through Triton's own path, which must
    pick the cached kernel; another is an error."""
    cached = CompiledKernel()
    launcher, fn = direct_launcher(monkeypatch, [cached, cached, CompiledKernel()])
    monkeypatch.setattr(launch, "VERIFY", True)
    x = torch.Tensor._make_subclass(OnCuda, torch.zeros(4))
    args = ((1, 1, 1), (x,), (7,), (("BLOCK", 64),))
    launcher(*args)
    launcher(*args)  # Triton picks the cached one: fine, and nothing runs directly
    assert len(fn.calls) == 2 and cached.runs == []
    with pytest.raises(RuntimeError, match="another compiled kernel"):
        launcher(*args)


def test_off_switch(monkeypatch):
    """SURGERY_FAST_LAUNCH=0 (read when a launcher is made, at import for the kernels' own):
    every launch through JITFunction.run."""
    monkeypatch.setenv("SURGERY_FAST_LAUNCH", "0")
    assert not launch.FastLauncher(FakeJITFunction())._direct
    monkeypatch.setenv("SURGERY_FAST_LAUNCH", "1")
    assert launch.FastLauncher(FakeJITFunction())._direct


def test_changed_global_takes_tritons_own_path():
    """JITFunction.run raises when a global the kernel reads has changed since it compiled; a
    direct launch must not skip that check, so it leaves the launch (and the error) to Triton."""
    fn = FakeJITFunction()
    scope = {"SCALE": 2}
    fn.used_global_vals = {("SCALE", id(scope)): (2, scope)}
    launcher = launch.FastLauncher(fn)
    assert launcher._globals_unchanged()
    scope["SCALE"] = 3
    assert not launcher._globals_unchanged()
    del scope["SCALE"]
    assert not launcher._globals_unchanged()


# A kernel that reads a global constexpr, as JITFunction.run checks on every launch.
SCALE = tl.constexpr(2.0)


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)


def _launch_scale(launcher, x, y):
    launcher((1, 1, 1), (x, y), (x.numel(),), (("BLOCK", 128),))


@cuda
@pytest.mark.gpu
def test_changed_global_raises_as_triton_does(monkeypatch):
    launcher = launch.FastLauncher(scale_kernel)
    x = torch.randn(100, device="cuda")
    y = torch.full_like(x, float("nan"))
    for _ in range(2):  # the second launch is direct
        _launch_scale(launcher, x, y)
    assert len(launcher._cache) == 1
    torch.testing.assert_close(y, 2 * x)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", tl.constexpr(3.0))
    with pytest.raises(RuntimeError, match="SCALE"):
        _launch_scale(launcher, x, y)


@cuda
@pytest.mark.gpu
def test_debug_knob_launches_tritons_debug_kernel():
    """After a key was cached, TRITON_DEBUG's knob set at run time must reach Triton (which
    compiles a debug build), not launch the cached kernel."""
    from triton import knobs

    launcher = launch.FastLauncher(scale_kernel)
    x = torch.randn(100, device="cuda")
    y = torch.full_like(x, float("nan"))
    for _ in range(2):
        _launch_scale(launcher, x, y)
    with knobs.runtime.scope():
        knobs.runtime.debug = True
        for _ in range(2):
            _launch_scale(launcher, x, y)
    assert len(launcher._cache) == 2
    (plain, _), (debug, _) = launcher._cache.values()
    assert plain is not debug
    torch.testing.assert_close(y, 2 * x)
