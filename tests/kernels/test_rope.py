"""RoPE kernels against the fp64 reference and transformers' own rotary modules.

CPU: the Triton kernels run through the interpreter (small shapes). ``gpu``-marked tests run the
real sizes on the GPU machine (the CPU tests run there too, on CUDA tensors). Error budget: the
kernel's relative error against the fp64 reference may exceed eager transformers' error in the same
dtype only by the margin of ``tests.utils.TOLERANCES``, and against transformers' own rotary modules
it must be no worse than their bf16 path; packed and offset rotations equal the unpacked ones
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import surgery.kernels.rope.api as rope_api
import surgery.kernels.rope.launch as rope_launch
from surgery.kernels import apply_rope, apply_rope_reference, apply_rotary_pos_emb
from surgery.kernels.rope import DEFAULT_LAUNCH, RopeLaunch, rope_bwd, rope_cos_sin_fwd, rope_fwd
from tests.utils import DEVICE, assert_close_budget, poisoned_empty, rel_err

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---------------------------------------------------------------------------------------------
# Helpers: inputs in the layouts callers hand over, and transformers' eager formula.


def make_qk(B, Hq, Hk, T, D, dtype, layout, device=DEVICE, requires_grad=False):
    """Random q (B, Hq, T, D) and k (B, Hk, T, D) in one of the layouts callers hand over."""
    if layout == "hf":  # transformers: proj(x).view(B, T, H, D).transpose(1, 2)
        q = torch.randn(B, T, Hq, D, device=device).transpose(1, 2)
        k = torch.randn(B, T, Hk, D, device=device).transpose(1, 2)
    elif layout == "contiguous":
        q = torch.randn(B, Hq, T, D, device=device)
        k = torch.randn(B, Hk, T, D, device=device)
    elif layout == "qkv":  # slices of one fused projection: not dense
        fused = torch.randn(B, T, (Hq + 2 * Hk) * D, device=device)
        q = fused[..., : Hq * D].view(B, T, Hq, D).transpose(1, 2)
        k = fused[..., Hq * D : (Hq + Hk) * D].view(B, T, Hk, D).transpose(1, 2)
    elif layout == "strided_d":  # head_dim stride 2
        q = torch.randn(B, Hq, T, 2 * D, device=device)[..., ::2]
        k = torch.randn(B, Hk, T, 2 * D, device=device)[..., ::2]
    else:
        raise AssertionError(layout)
    # .to() keeps the layout; detach() makes a leaf view that may require grad.
    q, k = q.to(dtype).detach(), k.to(dtype).detach()
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad)


def default_inv_freq(rotary_dim, theta=10000.0, device=DEVICE):
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (theta**exps)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_cos_sin(position_ids, inv_freq, scaling, dtype):
    """What a transformers rotary module returns: fp32 angles, cos/sin rounded to ``dtype``."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def eager_apply(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb in the inputs' dtype (Phi-3's form when r < D)."""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]

    def rot(x):
        xr = x[..., :r]
        return torch.cat((xr * cos + rotate_half(xr) * sin, x[..., r:]), dim=-1)

    return rot(q), rot(k)


def reference64(q, k, position_ids, inv_freq, scaling, rotary_dim):
    """fp64 ground truth, differentiable w.r.t. fp64 leaves made from q and k."""
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    out = apply_rope_reference(q64, k64, position_ids, inv_freq.double(), scaling, rotary_dim)
    return q64, k64, out


def assert_no_worse_than_transformers(x, ref, hf, what):
    """The issue's bar against transformers' modules: no worse than their own bf16 path (one
    rounding in fp32 against their bf16 cos/sin and bf16 products)."""
    err, err_hf = rel_err(x, ref), rel_err(hf, ref)
    assert err <= err_hf, f"{what}: rel err {err:.3e} > transformers' {err_hf:.3e}"


def check_against_transformers(got, ref, hf, dtype, tag):
    """(q, k, grad q, grad k) of a kernel vs the fp64 reference, beside transformers' own."""
    for what, x, r, h in zip(("q", "k", "grad q", "grad k"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{tag} {what}")
        assert_no_worse_than_transformers(x, r, h, f"{tag} {what}")


def grads(outputs, inputs, upstream):
    loss = sum((o * g.to(o.dtype)).sum() for o, g in zip(outputs, upstream))
    return torch.autograd.grad(loss, inputs)


# ---------------------------------------------------------------------------------------------
# Forward and gradients against the fp64 reference, across shapes, layouts and dtypes.


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hk: int
    T: int
    D: int
    dtype: torch.dtype
    rotary_dim: int | None = None
    pos: str = "BT"  # "BT": (B, T); "1T": (1, T); "expand": (1, T) expanded to (B, T), stride 0
    pos_dtype: torch.dtype = torch.int64
    layout: str = "hf"
    scaling: float = 1.0

    @property
    def id(self):
        rd = f"-rd{self.rotary_dim}" if self.rotary_dim else ""
        pos = f"pos{self.pos}-{str(self.pos_dtype).removeprefix('torch.')}"
        sc = f"-s{self.scaling}" if self.scaling != 1.0 else ""
        return (
            f"B{self.B}-Hq{self.Hq}-Hk{self.Hk}-T{self.T}-D{self.D}{rd}-{DTYPE_NAMES[self.dtype]}"
            f"-{pos}-{self.layout}{sc}"
        )


CASES = [
    Case(2, 4, 2, 37, 64, torch.bfloat16),
    Case(1, 3, 1, 5, 32, torch.float32, pos="1T", pos_dtype=torch.int32, layout="contiguous"),
    Case(2, 4, 4, 16, 64, torch.float16, rotary_dim=32, pos_dtype=torch.int32, scaling=1.25),
    Case(3, 2, 1, 7, 48, torch.bfloat16, rotary_dim=16, pos="1T", layout="qkv"),
    Case(2, 2, 1, 11, 80, torch.float32, rotary_dim=32, layout="strided_d"),  # Phi-2-like
    Case(1, 5, 5, 9, 96, torch.bfloat16, layout="hf", scaling=0.8),  # rotary_dim/2 = 48: padded
    Case(2, 2, 1, 6, 32, torch.float16, pos="expand", pos_dtype=torch.int32, layout="contiguous"),
]


def random_positions(case, device=DEVICE):
    rows = case.B if case.pos == "BT" else 1
    # Offsets up to 4096 (large fp32 angles) and a restart inside the row.
    start = torch.randint(0, 4096, (rows, 1), device=device)
    pos = start + torch.arange(case.T, device=device)
    pos[:, case.T // 2 :] -= pos[:, case.T // 2 : case.T // 2 + 1].clone()
    pos = pos.to(case.pos_dtype)
    return pos.expand(case.B, case.T) if case.pos == "expand" else pos


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_and_grads_match_reference(case):
    c = case
    q, k = make_qk(c.B, c.Hq, c.Hk, c.T, c.D, c.dtype, c.layout, requires_grad=True)
    pos = random_positions(c)
    rd = c.rotary_dim or c.D
    inv = default_inv_freq(rd)

    # Launcher into poisoned outputs of another layout: every element must be written.
    out = (poisoned_empty(*q.shape, dtype=c.dtype), poisoned_empty(*k.shape, dtype=c.dtype))
    oq, ok = rope_fwd(q.detach(), k.detach(), pos, inv, c.scaling, rd, out=out)
    aq, ak = apply_rope(q, k, pos, inv, c.scaling, c.rotary_dim)
    assert torch.equal(aq, oq) and torch.equal(ak, ok), "apply_rope differs from rope_fwd"
    assert aq.stride() == torch.empty_like(q).stride(), "output layout differs from q's"

    q64, k64, (rq, rk) = reference64(q, k, pos, inv, c.scaling, rd)
    cos, sin = eager_cos_sin(pos, inv, c.scaling, c.dtype)
    eq, ek = eager_apply(q, k, cos, sin)
    assert_close_budget(aq, rq, eq, c.dtype, "q forward")
    assert_close_budget(ak, rk, ek, c.dtype, "k forward")
    if rd < c.D:  # pass-through channels are copied bit for bit
        assert torch.equal(aq[..., rd:], q[..., rd:]) and torch.equal(ak[..., rd:], k[..., rd:])

    up = (torch.randn_like(rq), torch.randn_like(rk))
    gq, gk = grads((aq, ak), (q, k), up)
    rgq, rgk = grads((rq, rk), (q64, k64), up)
    egq, egk = grads((eq, ek), (q, k), up)
    assert_close_budget(gq, rgq, egq, c.dtype, "grad q")
    assert_close_budget(gk, rgk, egk, c.dtype, "grad k")

    # The backward launcher into poisoned outputs gives the same gradients.
    gout = (poisoned_empty(*q.shape, dtype=c.dtype), poisoned_empty(*k.shape, dtype=c.dtype))
    bq, bk = rope_bwd(up[0].to(c.dtype), up[1].to(c.dtype), pos, inv, c.scaling, rd, out=gout)
    assert torch.equal(bq, gq) and torch.equal(bk, gk)


@pytest.mark.parametrize(
    "launch",
    [
        DEFAULT_LAUNCH,  # the GPU's configuration (CPU tests otherwise use the interpreter's)
        RopeLaunch(block_t=4, head_groups=2),
        RopeLaunch(block_t=16, tile_elems=64, head_groups=3),  # BLOCK_H 1, heads over 3 programs
        RopeLaunch(block_t=8, tile_elems=128, head_groups=99),  # more groups than head blocks
    ],
    ids=["gpu-default", "T4-G2", "T16-H1-G3", "T8-G99"],
)
def test_launch_configs_agree(launch):
    # Every element's arithmetic is the same in any tiling, so results are identical.
    q, k = make_qk(2, 5, 3, 13, 32, torch.bfloat16, "hf")
    pos = torch.randint(0, 500, (2, 13), device=DEVICE)
    inv = default_inv_freq(24)
    cos, sin = eager_cos_sin(pos, inv, 1.0, torch.float32)
    for fn, args in ((rope_fwd, (pos, inv, 1.0, 24)), (rope_cos_sin_fwd, (cos, sin))):
        want = fn(q, k, *args)
        out = (poisoned_empty(*q.shape, dtype=q.dtype), poisoned_empty(*k.shape, dtype=k.dtype))
        got = fn(q, k, *args, launch=launch, out=out)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fn.__name__


# ---------------------------------------------------------------------------------------------
# Packed sequences and cache offsets: each token's rotation depends on its position only.


def test_packed_rows_equal_sequences_rotated_alone():
    Hq, Hk, D, lens = 4, 2, 32, (13, 8)
    T = sum(lens)
    q, k = make_qk(1, Hq, Hk, T, D, torch.bfloat16, "hf", requires_grad=True)
    pos = torch.cat([torch.arange(n, device=DEVICE) for n in lens])[None]
    inv = default_inv_freq(D)
    up = (torch.randn(1, Hq, T, D, device=DEVICE), torch.randn(1, Hk, T, D, device=DEVICE))

    pq, pk = apply_rope(q, k, pos, inv)
    packed_grads = grads((pq, pk), (q, k), up)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        qa = q.detach()[:, :, sl].clone().requires_grad_()
        ka = k.detach()[:, :, sl].clone().requires_grad_()
        aq, ak = apply_rope(qa, ka, torch.arange(n, device=DEVICE)[None], inv)
        assert torch.equal(pq[:, :, sl], aq) and torch.equal(pk[:, :, sl], ak)
        ga = grads((aq, ak), (qa, ka), (up[0][:, :, sl], up[1][:, :, sl]))
        assert torch.equal(packed_grads[0][:, :, sl], ga[0])
        assert torch.equal(packed_grads[1][:, :, sl], ga[1])
        start += n


def test_cache_offset_equals_tail_of_full_sequence():
    # Decoding after a KV cache: T new tokens at positions P..P+T-1.
    P, T, D = 250, 6, 64
    q, k = make_qk(1, 4, 1, P + T, D, torch.float16, "hf")
    inv = default_inv_freq(D, theta=500000.0)
    full = apply_rope(q, k, torch.arange(P + T, device=DEVICE)[None], inv)
    tail = apply_rope(q[:, :, P:], k[:, :, P:], torch.arange(P, P + T, device=DEVICE)[None], inv)
    assert torch.equal(full[0][:, :, P:], tail[0]) and torch.equal(full[1][:, :, P:], tail[1])


# ---------------------------------------------------------------------------------------------
# Agreement with transformers' rotary modules built from configs.

ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    },  # attention_scaling != 1
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def llama_rotary(rope_type, head_dim, max_pos=64, device=DEVICE):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        rope_parameters=dict(ROPE_PARAMETERS[rope_type]),
    )
    return LlamaRotaryEmbedding(cfg).to(device)


@pytest.mark.parametrize("rope_type", list(ROPE_PARAMETERS))
def test_matches_transformers_rotary_module(rope_type):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    B, Hq, Hk, T, D, dtype = 2, 4, 2, 24, 32, torch.bfloat16
    module = llama_rotary(rope_type, D)
    q, k = make_qk(B, Hq, Hk, T, D, dtype, "hf", requires_grad=True)
    # Rows at different offsets, past max_position_embeddings: dynamic rescales its inv_freq.
    pos = torch.tensor([[0], [90]], device=DEVICE) + torch.arange(T, device=DEVICE)
    cos, sin = module(q, pos)  # updates inv_freq / attention_scaling first for dynamic
    inv, scaling = module.inv_freq, module.attention_scaling
    if rope_type == "dynamic":
        assert not torch.equal(inv, module.original_inv_freq), "dynamic rope did not rescale"

    hq, hk = hf_apply(q, k, cos, sin)
    aq, ak = apply_rope(q, k, pos, inv, scaling)
    dq, dk = apply_rotary_pos_emb(q, k, cos, sin)
    q64, k64, (rq, rk) = reference64(q, k, pos, inv, scaling, D)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    hg = grads((hq, hk), (q, k), up)
    rg = grads((rq, rk), (q64, k64), up)
    for name, outs in (("apply_rope", (aq, ak)), ("apply_rotary_pos_emb", (dq, dk))):
        got = (*outs, *grads(outs, (q, k), up))
        check_against_transformers(got, (rq, rk, *rg), (hq, hk, *hg), dtype, f"{rope_type} {name}")

    # In fp32, with fp32 cos/sin, the result is transformers' to rounding.
    q32, k32 = q.detach().float(), k.detach().float()
    cos32, sin32 = module(q32, pos)
    want = hf_apply(q32, k32, cos32, sin32)
    for got in (
        apply_rope(q32, k32, pos, inv, scaling),
        apply_rotary_pos_emb(q32, k32, cos32, sin32),
    ):
        assert rel_err(got[0], want[0]) < 2e-6 and rel_err(got[1], want[1]) < 2e-6


def test_partial_rotary_matches_transformers_phi3():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    cfg = Phi3Config(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        partial_rotary_factor=0.5,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    module = Phi3RotaryEmbedding(cfg).to(DEVICE)
    B, T, D, dtype = 2, 10, 32, torch.bfloat16
    q, k = make_qk(B, 2, 1, T, D, dtype, "hf", requires_grad=True)
    pos = torch.randint(0, 64, (B, T), device=DEVICE)
    cos, sin = module(q, pos)
    rd = 2 * module.inv_freq.shape[0]
    assert rd == 16 and cos.shape[-1] == rd

    hq, hk = phi3_apply(q, k, cos, sin)
    aq, ak = apply_rope(q, k, pos, module.inv_freq, module.attention_scaling, rotary_dim=rd)
    dq, dk = apply_rotary_pos_emb(q, k, cos, sin)
    q64, k64, (rq, rk) = reference64(q, k, pos, module.inv_freq, module.attention_scaling, rd)
    for what, (oq, ok) in (("apply_rope", (aq, ak)), ("apply_rotary_pos_emb", (dq, dk))):
        assert_close_budget(oq, rq, hq, dtype, f"{what} q")
        assert_close_budget(ok, rk, hk, dtype, f"{what} k")
    up = (torch.randn_like(rq), torch.randn_like(rk))
    g, hg, rg = (
        grads((aq, ak), (q, k), up),
        grads((hq, hk), (q, k), up),
        grads((rq, rk), (q64, k64), up),
    )
    assert_close_budget(g[0], rg[0], hg[0], dtype, "grad q")
    assert_close_budget(g[1], rg[1], hg[1], dtype, "grad k")


# ---------------------------------------------------------------------------------------------
# Under torch.autocast, in an fp32 model: the rotary module's cos/sin are fp32 (computed from the
# fp32 hidden states), q/k arrive in the autocast dtype (q_proj under autocast) or in fp32 (after
# Qwen3's fp32-weight q/k norms). transformers' ``q * cos`` promotes to fp32; apply_rope returns
# q's dtype. Attention casts q/k to the autocast dtype before reading them (sdpa and eager's
# matmuls are autocast ops; flash attention casts to the autocast dtype itself), so what it sees
# is the same.

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def causal_attention(q, k, v):
    """sdpa as transformers calls it, GQA keys and values repeated (``repeat_kv``)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("entry", ["apply_rope", "apply_rotary_pos_emb"])
@pytest.mark.parametrize("qk", ["autocast", "fp32"], ids=["qk_autocast", "qk_fp32"])
@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
def test_under_autocast_attention_sees_transformers_values(name, qk, entry):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    dtype = AUTOCAST_DTYPES[name]
    B, Hq, Hk, T, D = 2, 4, 2, 24, 32
    module = llama_rotary("default", D)
    in_dtype = dtype if qk == "autocast" else torch.float32
    q, k = make_qk(B, Hq, Hk, T, D, in_dtype, "hf", requires_grad=True)
    v = torch.randn(B, Hk, T, D, device=DEVICE).to(in_dtype).requires_grad_()
    pos = torch.tensor([[0], [90]], device=DEVICE) + torch.arange(T, device=DEVICE)
    hidden = torch.randn(B, T, Hq * D, device=DEVICE)  # the fp32 residual stream
    inv, scaling = module.inv_freq, module.attention_scaling

    def ours(q, k, cos, sin):
        if entry == "apply_rope":
            return apply_rope(q, k, pos, inv, scaling)
        return apply_rotary_pos_emb(q, k, cos, sin)

    plain = ours(q, k, *module(hidden, pos))
    with torch.autocast(DEVICE.type, dtype=dtype):
        cos, sin = module(hidden, pos)
        assert cos.dtype == sin.dtype == torch.float32
        hq, hk = hf_apply(q, k, cos, sin)
        aq, ak = ours(q, k, cos, sin)
        # Autocast changes nothing inside the kernel: the call without it, bit for bit.
        assert torch.equal(aq, plain[0]) and torch.equal(ak, plain[1])
        assert hq.dtype == torch.float32 and aq.dtype == ak.dtype == q.dtype
        out = causal_attention(aq, ak, v)
        hf_out = causal_attention(hq, hk, v)
    assert out.dtype == hf_out.dtype == dtype

    # What attention reads: transformers' fp32 rotation and ours, both in the autocast dtype, equal
    # but for rare one-ulp differences (another cos/sin, and one rounding where transformers has
    # two in fp32, can move a value across a rounding boundary).
    for what, a, h in (("q", aq, hq), ("k", ak, hk)):
        a, h = a.to(dtype), h.to(dtype)
        torch.testing.assert_close(a, h, rtol=torch.finfo(dtype).eps, atol=0, msg=what)
        assert (a != h).float().mean() <= 0.01, what

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64 = causal_attention(*apply_rope_reference(q64, k64, pos, inv.double(), scaling), v64)
    up = torch.randn_like(out64)
    got = (out, *grads((out,), (q, k, v), (up,)))
    hf = (hf_out, *grads((hf_out,), (q, k, v), (up,)))
    ref = (out64, *grads((out64,), (q64, k64, v64), (up,)))
    for what, a, r, h in zip(("attention", "grad q", "grad k", "grad v"), got, ref, hf):
        assert a.dtype == h.dtype, what
        assert_close_budget(a, r, h, dtype, f"{entry} {name} {qk} {what}")


# ---------------------------------------------------------------------------------------------
# The cos/sin drop-in.


@pytest.mark.parametrize(
    "cos_rows,r,unsqueeze_dim,cos_dtype",
    [(1, 64, 1, torch.bfloat16), (2, 64, 2, torch.float32), (2, 48, -3, torch.bfloat16)],
    ids=["cos(1,T,D)-ud1-bf16cos", "cos(B,T,D)-ud2-fp32cos", "cos(B,T,48)-ud-3-partial"],
)
def test_cos_sin_dropin(cos_rows, r, unsqueeze_dim, cos_dtype):
    B, Hq, Hk, T, D, dtype = 2, 4, 2, 19, 64, torch.bfloat16
    q, k = make_qk(B, Hq, Hk, T, D, dtype, "hf", requires_grad=True)
    # Arbitrary cos/sin (not [c, c]): the drop-in must give transformers' formula for any.
    cos = torch.randn(cos_rows, T, r, device=DEVICE).to(cos_dtype)
    sin = torch.randn(cos_rows, T, r, device=DEVICE).to(cos_dtype)
    if unsqueeze_dim == 2:  # the caller holds (B, T, H, D)
        qi, ki = q.transpose(1, 2), k.transpose(1, 2)
        oq, ok = apply_rotary_pos_emb(qi, ki, cos, sin, unsqueeze_dim=2)
        assert oq.shape == qi.shape
        oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
    else:
        oq, ok = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = eager_apply(q64, k64, cos.double(), sin.double())
    eq, ek = eager_apply(q, k, cos.to(dtype), sin.to(dtype))
    assert_close_budget(oq, rq, eq, dtype, "q")
    assert_close_budget(ok, rk, ek, dtype, "k")
    up = (torch.randn_like(rq), torch.randn_like(rk))
    g, rg, eg = (
        grads((oq, ok), (q, k), up),
        grads((rq, rk), (q64, k64), up),
        grads((eq, ek), (q, k), up),
    )
    assert_close_budget(g[0], rg[0], eg[0], dtype, "grad q")
    assert_close_budget(g[1], rg[1], eg[1], dtype, "grad k")


def test_cos_sin_requiring_grad_get_their_gradients():
    q, k = make_qk(1, 2, 1, 6, 16, torch.float32, "hf", requires_grad=True)
    cos = torch.randn(1, 6, 16, device=DEVICE, requires_grad=True)
    sin = torch.randn(1, 6, 16, device=DEVICE, requires_grad=True)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    want = eager_apply(q, k, cos, sin)
    up = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for a, b in zip(grads(got, (q, k, cos, sin), up), grads(want, (q, k, cos, sin), up)):
        assert rel_err(a, b) < 1e-6


def assert_double_backward_matches(q, k, kernel, reference, what=""):
    """The backward is differentiable too (create_graph=True), e.g. for gradient penalties: with
    q_grad = R^T g, d<h, q_grad>/dg = R h. ``kernel(q, k, dtype)`` (fp32) against
    ``reference(q, k, dtype)`` (fp64) at both levels, for random g and h."""
    g = [torch.randn_like(q), torch.randn_like(k)]
    h = [torch.randn_like(q), torch.randn_like(k)]

    def second_order(apply, dtype):
        qq = q.detach().to(dtype).requires_grad_()
        kk = k.detach().to(dtype).requires_grad_()
        gg = [x.detach().to(dtype).requires_grad_() for x in g]
        first = torch.autograd.grad(apply(qq, kk, dtype), (qq, kk), gg, create_graph=True)
        inner = sum((f * x.to(dtype)).sum() for f, x in zip(first, h))
        return first, torch.autograd.grad(inner, gg)

    first, second = second_order(kernel, torch.float32)
    first64, second64 = second_order(reference, torch.float64)
    for name, x, r in zip(("dq", "dk", "d2 g_q", "d2 g_k"), (*first, *second),
                          (*first64, *second64)):  # fmt: skip
        assert rel_err(x, r) < 1e-5, f"{what} {name}: {rel_err(x, r):.2e}"


@pytest.mark.parametrize("entry", ["apply_rope", "apply_rotary_pos_emb"])
def test_double_backward_matches_reference(entry):
    B, Hq, Hk, T, D = 2, 4, 2, 6, 16
    q, k = make_qk(B, Hq, Hk, T, D, torch.float32, "hf", requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [3, 4, 5, 6, 7, 8]], device=DEVICE)
    inv_freq = default_inv_freq(D)
    if entry == "apply_rope":
        kernel = lambda qq, kk, dtype: apply_rope(qq, kk, pos, inv_freq.to(dtype), 0.9)
    else:
        cos, sin = eager_cos_sin(pos, inv_freq, 0.9, torch.float32)
        kernel = lambda qq, kk, dtype: apply_rotary_pos_emb(qq, kk, cos, sin)
    reference = lambda qq, kk, dtype: apply_rope_reference(qq, kk, pos, inv_freq.to(dtype), 0.9)
    assert_double_backward_matches(q, k, kernel, reference, entry)


# ---------------------------------------------------------------------------------------------
# Safety: inputs untouched, the PyTorch fallback, errors before any launch.


def test_inputs_never_written_and_outputs_are_new():
    q, k = make_qk(2, 2, 1, 5, 16, torch.bfloat16, "hf", requires_grad=True)
    q0, k0 = q.detach().clone(), k.detach().clone()
    pos = torch.arange(5, device=DEVICE)[None]
    oq, ok = apply_rope(q, k, pos, default_inv_freq(16))
    assert oq.data_ptr() != q.data_ptr() and ok.data_ptr() != k.data_ptr()
    up = [torch.randn_like(oq), torch.randn_like(ok)]
    up0 = [u.clone() for u in up]
    torch.autograd.backward((oq, ok), up)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(up[0], up0[0]) and torch.equal(up[1], up0[1]), "upstream grads written"


def test_pytorch_fallback_without_interpreter(monkeypatch):
    # Plain CPU (no TRITON_INTERPRET) runs the PyTorch path with the same fp32 math.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = CASES[3]
    q, k = make_qk(c.B, c.Hq, c.Hk, c.T, c.D, c.dtype, c.layout, device="cpu", requires_grad=True)
    pos = random_positions(c, device="cpu")
    rd = c.rotary_dim
    inv = default_inv_freq(rd, device="cpu")

    def launched(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched without the interpreter")

    monkeypatch.setattr(rope_launch, "_launch_rope", launched)
    monkeypatch.setattr(rope_launch, "_launch_cos_sin", launched)
    aq, ak = apply_rope(q, k, pos, inv, 1.0, rd)
    q64, k64, (rq, rk) = reference64(q, k, pos, inv, 1.0, rd)
    cos, sin = eager_cos_sin(pos, inv, 1.0, c.dtype)
    eq, ek = eager_apply(q, k, cos, sin)
    assert_close_budget(aq, rq, eq, c.dtype, "fallback q")
    assert_close_budget(ak, rk, ek, c.dtype, "fallback k")
    up = (torch.randn_like(rq), torch.randn_like(rk))
    g, rg, eg = (
        grads((aq, ak), (q, k), up),
        grads((rq, rk), (q64, k64), up),
        grads((eq, ek), (q, k), up),
    )
    assert_close_budget(g[0], rg[0], eg[0], c.dtype, "fallback grad q")
    assert_close_budget(g[1], rg[1], eg[1], c.dtype, "fallback grad k")
    dq, dk = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close_budget(dq, rq, eq, c.dtype, "fallback drop-in q")
    assert_close_budget(dk, rk, ek, c.dtype, "fallback drop-in k")


def _bad(**over):
    args = {
        "q": torch.randn(2, 4, 5, 16),
        "k": torch.randn(2, 2, 5, 16),
        "position_ids": torch.arange(5)[None],
        "inv_freq": default_inv_freq(16, device="cpu"),
        "rotary_dim": None,
    }
    args.update(over)
    return args


BAD_INPUTS = {
    "q-3d": (_bad(q=torch.randn(2, 5, 16)), ValueError, r"\(2, 5, 16\)"),
    "batch-mismatch": (_bad(k=torch.randn(3, 2, 5, 16)), ValueError, r"\(3, 2, 5, 16\)"),
    "seq-mismatch": (_bad(k=torch.randn(2, 2, 6, 16)), ValueError, r"\(2, 2, 6, 16\)"),
    "head_dim-mismatch": (_bad(k=torch.randn(2, 2, 5, 8)), ValueError, r"\(2, 2, 5, 8\)"),
    "dtype-mismatch": (_bad(k=torch.randn(2, 2, 5, 16).half()), TypeError, "float16"),
    "fp64": (
        _bad(q=torch.randn(2, 4, 5, 16).double(), k=torch.randn(2, 2, 5, 16).double()),
        TypeError,
        "float64",
    ),
    "odd-rotary_dim": (_bad(rotary_dim=7), ValueError, "rotary_dim.*got 7"),
    "rotary_dim>D": (_bad(rotary_dim=32), ValueError, r"head_dim=16.*\(2, 4, 5, 16\)"),
    "odd-head_dim": (
        _bad(q=torch.randn(2, 4, 5, 15), k=torch.randn(2, 2, 5, 15)),
        ValueError,
        r"rotary_dim.*\(2, 4, 5, 15\)",
    ),
    "pos-1d": (_bad(position_ids=torch.arange(5)), ValueError, r"\(2, 5\) or \(1, 5\).*\(5,\)"),
    "pos-batch": (_bad(position_ids=torch.zeros(3, 5, dtype=torch.long)), ValueError, r"\(3, 5\)"),
    "pos-seq": (_bad(position_ids=torch.arange(6)[None]), ValueError, r"\(1, 6\)"),
    "pos-float": (_bad(position_ids=torch.zeros(1, 5)), TypeError, "int32 or int64"),
    "inv_freq-length": (_bad(inv_freq=torch.ones(4)), ValueError, r"8 entries.*\(4,\)"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise_before_launch(name, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("launched before validating")

    monkeypatch.setattr(rope_api, "_rope", launched)
    args, exc, match = BAD_INPUTS[name]
    with pytest.raises(exc, match=match):
        apply_rope(**args)


BAD_COS_SIN = {
    "cos-2d": (dict(cos=torch.randn(5, 16), sin=torch.randn(5, 16)), ValueError, r"\(5, 16\)"),
    "cos-seq": (
        dict(cos=torch.randn(1, 4, 16), sin=torch.randn(1, 4, 16)),
        ValueError,
        r"\(1, 4, 16\)",
    ),
    "cos-batch": (
        dict(cos=torch.randn(3, 5, 16), sin=torch.randn(3, 5, 16)),
        ValueError,
        r"\(3, 5, 16\)",
    ),
    "cos-odd": (
        dict(cos=torch.randn(1, 5, 7), sin=torch.randn(1, 5, 7)),
        ValueError,
        r"\(1, 5, 7\)",
    ),
    "sin-shape": (
        dict(cos=torch.randn(1, 5, 16), sin=torch.randn(2, 5, 16)),
        ValueError,
        r"\(2, 5, 16\)",
    ),
    "unsqueeze_dim": (dict(unsqueeze_dim=0), ValueError, "unsqueeze_dim"),
    "k-heads-dim": (dict(k=torch.randn(2, 2, 6, 16)), ValueError, r"\(2, 2, 6, 16\)"),
}


@pytest.mark.parametrize("name", list(BAD_COS_SIN))
def test_bad_cos_sin_raise_before_launch(name, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("launched before validating")

    monkeypatch.setattr(rope_api, "_rope_cos_sin", launched)
    over, exc, match = BAD_COS_SIN[name]
    args = {
        "q": torch.randn(2, 4, 5, 16),
        "k": torch.randn(2, 2, 5, 16),
        "cos": torch.randn(1, 5, 16),
        "sin": torch.randn(1, 5, 16),
    }
    args.update(over)
    with pytest.raises(exc, match=match):
        apply_rotary_pos_emb(**args)


def test_empty_sequence():
    q, k = make_qk(2, 2, 1, 0, 16, torch.float32, "hf")
    oq, ok = apply_rope(
        q, k, torch.zeros(1, 0, dtype=torch.long, device=DEVICE), default_inv_freq(16)
    )
    assert oq.shape == q.shape and ok.shape == k.shape


# ---------------------------------------------------------------------------------------------
# torch.library registration: schema, fake tensors, autograd, and tracing with fullgraph=True.


def test_ops_pass_opcheck():
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32, "hf", requires_grad=True)
    pos, inv = torch.arange(3, device=DEVICE)[None], default_inv_freq(8)
    cos, sin = torch.randn(1, 3, 8, device=DEVICE), torch.randn(1, 3, 8, device=DEVICE)
    ops = torch.ops.surgery
    torch.library.opcheck(ops.rope_fwd.default, (q, k, pos, inv, 0.5, 8))
    # The AOT-dispatch check compiles (seconds on CPU); one op covers it, the rest get the others.
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.rope_bwd.default, (q, k, pos, inv, 0.5, 8), test_utils=quick)
    torch.library.opcheck(ops.rope_cos_sin_fwd.default, (q, k, cos, sin), test_utils=quick)
    torch.library.opcheck(ops.rope_cos_sin_bwd.default, (q, k, cos, sin), test_utils=quick)


def test_traces_with_fullgraph_on_cpu():
    # Inductor needs a compiler on CPU; aot_eager still checks fake tensors and the graph.
    q, k = make_qk(2, 2, 1, 5, 16, torch.bfloat16, "hf", requires_grad=True)
    pos, inv = torch.arange(5, device=DEVICE)[None], default_inv_freq(16)
    fn = torch.compile(
        lambda a, b: apply_rope(a, b, pos, inv, 1.0), fullgraph=True, backend="aot_eager"
    )
    got, want = fn(q, k), apply_rope(q, k, pos, inv, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    up = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for a, b in zip(grads(got, (q, k), up), grads(want, (q, k), up)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: real sizes, long-context angles, torch.compile and CUDA graphs.

REAL = [(4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL, ids=lambda s: "B{}-Hq{}-Hk{}-T{}-D{}".format(*s))
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_gpu_real_sizes_match_transformers(shape, rope_type):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    B, Hq, Hk, T, D = shape
    dtype = torch.bfloat16
    module = llama_rotary(rope_type, D, max_pos=131072)
    q, k = make_qk(B, Hq, Hk, T, D, dtype, "hf", requires_grad=True)
    # Packed rows (positions restart every 1000 tokens) at long-context offsets.
    pos = (torch.arange(T, device="cuda") % 1000)[None] + torch.randint(
        0, 120000, (B, 1), device="cuda"
    )
    cos, sin = module(q, pos)
    hq, hk = hf_apply(q, k, cos, sin)
    aq, ak = apply_rope(q, k, pos, module.inv_freq, module.attention_scaling)
    dq, dk = apply_rotary_pos_emb(q, k, cos, sin)
    q64, k64, (rq, rk) = reference64(q, k, pos, module.inv_freq, module.attention_scaling, D)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    hg, rg = grads((hq, hk), (q, k), up), grads((rq, rk), (q64, k64), up)
    for name, outs in (("apply_rope", (aq, ak)), ("apply_rotary_pos_emb", (dq, dk))):
        got = (*outs, *grads(outs, (q, k), up))
        check_against_transformers(got, (rq, rk, *rg), (hq, hk, *hg), dtype, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpu_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    B, Hq, Hk, T, D = 2, 32, 8, 1024, 128
    module = llama_rotary("llama3", D)

    def attention_inputs(x_q, x_k, pos):
        # The shape of a transformers attention block around RoPE.
        q = x_q.view(B, T, Hq, D).transpose(1, 2)
        k = x_k.view(B, T, Hk, D).transpose(1, 2)
        q, k = apply_rope(q, k, pos, module.inv_freq, module.attention_scaling)
        return (q.float().square().sum() + k.float().sum()) * 0.5, q, k

    x_q = torch.randn(B, T, Hq * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_k = torch.randn(B, T, Hk * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = (torch.arange(T, device="cuda") % 300)[None].expand(B, T).contiguous()
    compiled = torch.compile(attention_inputs, fullgraph=True, dynamic=dynamic)
    loss_c, qc, kc = compiled(x_q, x_k, pos)
    gc = torch.autograd.grad(loss_c, (x_q, x_k))
    loss_e, qe, ke = attention_inputs(x_q, x_k, pos)
    ge = torch.autograd.grad(loss_e, (x_q, x_k))
    assert torch.equal(qc, qe) and torch.equal(kc, ke)
    assert rel_err(gc[0], ge[0]) < 1e-2 and rel_err(gc[1], ge[1]) < 1e-2

    cos_sin = torch.compile(lambda a, b, c, s: apply_rotary_pos_emb(a, b, c, s), fullgraph=True)
    cos, sin = module(qe, pos)
    got = cos_sin(qe.detach(), ke.detach(), cos, sin)
    want = apply_rotary_pos_emb(qe.detach(), ke.detach(), cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    q, k = make_qk(2, 8, 2, 512, 128, torch.bfloat16, "hf", device="cuda")
    pos = torch.arange(512, device="cuda")[None]
    inv = default_inv_freq(128, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply_rope(q, k, pos, inv)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oq, ok = apply_rope(q, k, pos, inv)
    q.copy_(torch.randn_like(q))
    pos.add_(7)
    graph.replay()
    want = apply_rope(q, k, pos, inv)
    assert torch.equal(oq, want[0]) and torch.equal(ok, want[1])
