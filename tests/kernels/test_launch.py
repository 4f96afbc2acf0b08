"""``FastLauncher`` (kernels/launch.py): launches compiled Triton kernels without
``JITFunction.run``'s per-call binding, and must never reuse a kernel compiled for another
specialization. On the GPU each case is launched through Triton (filling the cache), directly, and
with ``VERIFY`` (Triton's path, which must pick the cached kernel), each result against the
reference.
"""

from __future__ import annotations

import pytest
import torch

import surgery.kernels.launch as launch
import surgery.kernels.rope as rope_mod
from surgery.kernels import apply_rope_reference
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
