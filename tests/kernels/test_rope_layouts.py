"""``apply_rope``'s interleaved layouts against the fp64 reference and transformers' own code.

- ``"interleaved"``: pairs (2j, 2j + 1) in and out, Llama 4's ``apply_rotary_emb`` (complex
  multiplication of ``view_as_complex`` pairs by the rotary module's ``freqs_cis``, in fp32).
- ``"interleaved_to_half"``: pairs read at (2j, 2j + 1) and written at (j, j + r/2), Mistral 4's
  (and DeepSeek's) ``apply_rotary_pos_emb_interleave`` on MLA's rotary slice, with the one key
  head ``k_rot`` (B, 1, T, r) shared by every query head.

Error budget as in test_rope.py (``tests.utils.TOLERANCES``): against the fp64 reference the kernel
may exceed an eager computation in the same dtype by the TOLERANCES margin. Mistral 4's bf16 path
rounds cos, sin and every product to bf16, so the kernel must also be no worse than it; Llama 4's
computes in fp32 and rounds once, as the kernel does, so there the budget alone applies (which of
two one-rounding results lands nearer is a coin toss).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import surgery.kernels.rope.api as rope_api
import surgery.kernels.rope.launch as rope_launch
from surgery.kernels import apply_rope, apply_rope_reference
from surgery.kernels.rope import RopeLaunch, rope_bwd, rope_fwd
from tests.kernels.test_rope import (
    DTYPE_NAMES,
    assert_double_backward_matches,
    assert_no_worse_than_transformers,
    default_inv_freq,
    grads,
    make_qk,
)
from tests.utils import DEVICE, assert_close_budget, poisoned_empty, rel_err

LAYOUTS = ["interleaved", "interleaved_to_half"]


def reference64(q, k, position_ids, inv_freq, scaling, rotary_dim, layout):
    """fp64 ground truth, differentiable w.r.t. fp64 leaves made from q and k."""
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    out = apply_rope_reference(
        q64, k64, position_ids, inv_freq.double(), scaling, rotary_dim, layout
    )
    return q64, k64, out


def eager_pairs(q, k, position_ids, inv_freq, scaling, rotary_dim, layout):
    """The pair rotation in the inputs' dtype, cos/sin rounded to it first: Mistral 4's formula
    (transformers' bf16 path), for any layout and partial rotary."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    cos = (freqs.cos() * scaling).to(q.dtype)[:, None]
    sin = (freqs.sin() * scaling).to(q.dtype)[:, None]

    def rot(x):
        xr = x[..., :rotary_dim]
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if layout == "interleaved":
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        else:
            out = torch.cat((o1, o2), dim=-1)
        return torch.cat((out, x[..., rotary_dim:]), dim=-1)

    return rot(q), rot(k)


# ---------------------------------------------------------------------------------------------
# Forward and gradients against the fp64 reference, across shapes, strides and dtypes.


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hk: int
    T: int
    D: int
    dtype: torch.dtype
    rotary_dim: int | None = None
    layout: str = "hf"
    scaling: float = 1.0

    @property
    def id(self):
        rd = f"-rd{self.rotary_dim}" if self.rotary_dim else ""
        sc = f"-s{self.scaling}" if self.scaling != 1.0 else ""
        return (
            f"B{self.B}-Hq{self.Hq}-Hk{self.Hk}-T{self.T}-D{self.D}{rd}-{DTYPE_NAMES[self.dtype]}"
            f"-{self.layout}{sc}"
        )


CASES = [
    Case(2, 4, 2, 37, 64, torch.bfloat16),
    Case(2, 4, 1, 9, 32, torch.float32, layout="contiguous", scaling=1.25),  # MLA: one key head
    Case(1, 3, 3, 11, 48, torch.float16, rotary_dim=16, layout="qkv"),
    Case(2, 2, 1, 7, 80, torch.float32, rotary_dim=32, layout="strided_d"),
    Case(1, 5, 1, 6, 96, torch.bfloat16, scaling=0.8),  # rotary_dim/2 = 48: padded
]


def positions(B, T, device=DEVICE):
    # Offsets up to 4096 (large fp32 angles) and a restart at 0 inside every row.
    pos = torch.randint(0, 4096, (B, 1), device=device) + torch.arange(T, device=device)
    pos[:, T // 2 :] -= pos[:, T // 2 : T // 2 + 1].clone()
    return pos


@pytest.mark.parametrize("rope_layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_and_grads_match_reference(case, rope_layout):
    c = case
    q, k = make_qk(c.B, c.Hq, c.Hk, c.T, c.D, c.dtype, c.layout, requires_grad=True)
    pos = positions(c.B, c.T)
    rd = c.rotary_dim or c.D
    inv = default_inv_freq(rd)
    args = (pos, inv, c.scaling, rd, rope_layout)

    # Launchers into poisoned outputs: every element must be written.
    out = (poisoned_empty(*q.shape, dtype=c.dtype), poisoned_empty(*k.shape, dtype=c.dtype))
    oq, ok = rope_fwd(q.detach(), k.detach(), *args, out=out)
    aq, ak = apply_rope(q, k, pos, inv, c.scaling, c.rotary_dim, layout=rope_layout)
    assert torch.equal(aq, oq) and torch.equal(ak, ok), "apply_rope differs from rope_fwd"

    q64, k64, (rq, rk) = reference64(q, k, *args)
    eq, ek = eager_pairs(q, k, *args)
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

    gout = (poisoned_empty(*q.shape, dtype=c.dtype), poisoned_empty(*k.shape, dtype=c.dtype))
    bq, bk = rope_bwd(up[0].to(c.dtype), up[1].to(c.dtype), *args, out=gout)
    assert torch.equal(bq, gq) and torch.equal(bk, gk)


def deinterleave(x, r):
    """Channels (0, 2, 4, .., 1, 3, 5, ..) of the first r, then the rest."""
    return torch.cat((x[..., 0:r:2], x[..., 1:r:2], x[..., r:]), dim=-1)


def interleave(x, r):
    """The inverse of ``deinterleave``."""
    pairs = torch.stack((x[..., : r // 2], x[..., r // 2 : r]), dim=-1).flatten(-2)
    return torch.cat((pairs, x[..., r:]), dim=-1)


@pytest.mark.parametrize("rd", [16, 12], ids=["full", "partial"])
def test_pairs_are_interleaved_not_rotate_half(rd):
    # Each layout is the rotate-half kernel conjugated by the channel permutation it names, and
    # not the rotate-half kernel itself: a kernel pairing (j, j + r/2) fails here.
    q, k = make_qk(2, 3, 1, 9, 16, torch.float32, "hf")
    pos, inv = positions(2, 9), default_inv_freq(rd)
    half = apply_rope(deinterleave(q, rd), deinterleave(k, rd), pos, inv, 1.0, rd)
    inter = apply_rope(q, k, pos, inv, 1.0, rd, layout="interleaved")
    to_half = apply_rope(q, k, pos, inv, 1.0, rd, layout="interleaved_to_half")
    plain = apply_rope(q, k, pos, inv, 1.0, rd)
    for h, i, t, p in zip(half, inter, to_half, plain):
        # (interleaved_to_half takes the PyTorch path everywhere for now: equal within rounding)
        assert torch.equal(i, interleave(h, rd)) and rel_err(t, h) < 1e-6
        assert rel_err(i, p) > 0.1 and rel_err(t, p) > 0.1
    # Attention scores are the same in both interleaved layouts (q and k permuted alike).
    scores = [qq @ kk.transpose(-1, -2) for qq, kk in (inter, to_half)]
    assert rel_err(scores[0], scores[1]) < 1e-6


@pytest.mark.parametrize("rope_layout", LAYOUTS)
@pytest.mark.parametrize(
    "launch",
    [
        RopeLaunch(),  # the GPU's default configuration
        RopeLaunch(block_t=16, tile_elems=64, head_groups=3),  # BLOCK_H 1, heads over 3 programs
    ],
    ids=["gpu-default", "T16-H1-G3"],
)
def test_launch_configs_agree(launch, rope_layout):
    q, k = make_qk(2, 5, 1, 13, 32, torch.bfloat16, "hf")
    args = (positions(2, 13), default_inv_freq(24), 1.0, 24, rope_layout)
    want = rope_fwd(q, k, *args)
    out = (poisoned_empty(*q.shape, dtype=q.dtype), poisoned_empty(*k.shape, dtype=k.dtype))
    got = rope_fwd(q, k, *args, launch=launch, out=out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rope_layout", LAYOUTS)
def test_packed_rows_equal_sequences_rotated_alone(rope_layout):
    Hq, Hk, D, lens = 4, 1, 32, (13, 8)
    T = sum(lens)
    q, k = make_qk(1, Hq, Hk, T, D, torch.bfloat16, "hf", requires_grad=True)
    pos = torch.cat([torch.arange(n, device=DEVICE) for n in lens])[None]
    inv = default_inv_freq(D)
    up = (torch.randn(1, Hq, T, D, device=DEVICE), torch.randn(1, Hk, T, D, device=DEVICE))

    pq, pk = apply_rope(q, k, pos, inv, layout=rope_layout)
    packed_grads = grads((pq, pk), (q, k), up)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        qa = q.detach()[:, :, sl].clone().requires_grad_()
        ka = k.detach()[:, :, sl].clone().requires_grad_()
        aq, ak = apply_rope(qa, ka, torch.arange(n, device=DEVICE)[None], inv, layout=rope_layout)
        assert torch.equal(pq[:, :, sl], aq) and torch.equal(pk[:, :, sl], ak)
        ga = grads((aq, ak), (qa, ka), (up[0][:, :, sl], up[1][:, :, sl]))
        assert torch.equal(packed_grads[0][:, :, sl], ga[0])
        assert torch.equal(packed_grads[1][:, :, sl], ga[1])
        start += n


# ---------------------------------------------------------------------------------------------
# transformers' own rotary code: Llama 4 (interleaved) and Mistral 4 (interleaved_to_half).


def llama4_rotary(rope_type, head_dim, device=DEVICE):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    if rope_type == "llama3":  # Llama 4 Scout's scaling
        rope_parameters.update(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
    cfg = Llama4TextConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_hidden_layers=1,
        intermediate_size=8,
        intermediate_size_mlp=8,
        vocab_size=8,
        max_position_embeddings=128,
        rope_parameters=rope_parameters,
    )
    return Llama4TextRotaryEmbedding(cfg).to(device)


def mistral4_rotary(qk_rope_head_dim, qk_nope_head_dim, mscale_all_dim, device=DEVICE):
    from transformers import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4RotaryEmbedding

    # The config's own yarn defaults (as the released checkpoints), its max positions small;
    # mscale_all_dim=0 gives yarn an attention_scaling != 1.
    cfg = Mistral4Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=16,
        kv_lora_rank=32,
        q_lora_rank=None,
        num_hidden_layers=1,
        intermediate_size=8,
        moe_intermediate_size=8,
        vocab_size=16,
        pad_token_id=None,
        max_position_embeddings=256,
    )
    cfg.rope_parameters["mscale_all_dim"] = mscale_all_dim
    return Mistral4RotaryEmbedding(cfg).to(device)


def check_against_transformers(got, ref, hf, dtype, tag, no_worse):
    for what, x, r, h in zip(("q", "k", "grad q", "grad k"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{tag} {what}")
        if no_worse:
            assert_no_worse_than_transformers(x, r, h, f"{tag} {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_llama4_matches_transformers(rope_type, dtype):
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    B, Hq, Hk, T, D = 2, 4, 2, 24, 32
    module = llama4_rotary(rope_type, D)
    # Llama 4 rotates q and k as the projections give them, (B, T, H, D), before the transpose.
    q = torch.randn(B, T, Hq, D, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(B, T, Hk, D, device=DEVICE).to(dtype).requires_grad_()
    pos = torch.tensor([[0], [90]], device=DEVICE) + torch.arange(T, device=DEVICE)
    pos[1, 12:] -= 102  # a packed row: positions restart at 0
    freqs_cis = module(q, pos)
    assert freqs_cis.dtype == torch.complex64
    inv, scaling = module.inv_freq, module.attention_scaling

    hq, hk = apply_rotary_emb(q, k, freqs_cis)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D) views, as apply_rope takes
    aq, ak = apply_rope(qh, kh, pos, inv, scaling, layout="interleaved")
    aq, ak = aq.transpose(1, 2), ak.transpose(1, 2)
    assert aq.shape == hq.shape and aq.dtype == hq.dtype == dtype
    up = (torch.randn_like(hq, dtype=torch.float32), torch.randn_like(hk, dtype=torch.float32))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    hf = (hq, hk, *grads((hq, hk), (q, k), up))
    if dtype == torch.float32:
        # Both compute in fp32 from the same fp32 angles: equal to rounding.
        for x, h in zip(got, hf):
            assert rel_err(x, h) < 2e-6
        return
    q64, k64, (rq, rk) = reference64(qh, kh, pos, inv, scaling, D, "interleaved")
    rq, rk = rq.transpose(1, 2), rk.transpose(1, 2)
    ref = (rq, rk, *(g.transpose(1, 2) for g in grads((rq, rk), (q64, k64), up)))
    check_against_transformers(got, ref, hf, dtype, f"llama4 {rope_type}", no_worse=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.0], ids=["scaling1", "yarn-scaling"])
def test_mistral4_mla_matches_transformers(mscale_all_dim, dtype):
    from transformers.models.mistral4.modeling_mistral4 import apply_rotary_pos_emb_interleave

    B, H, T, nope, r, lora = 2, 4, 19, 24, 16, 32
    module = mistral4_rotary(r, nope, mscale_all_dim)
    assert module.inv_freq.shape == (r // 2,)
    assert (module.attention_scaling != 1.0) == (mscale_all_dim == 0.0)
    # MLA's tensors as Mistral4Attention makes them: q_rot the last r channels of every query
    # head, k_rot the last r channels of the compressed projection, seen as one head.
    q_states = torch.randn(B, T, H * (nope + r), device=DEVICE).to(dtype).requires_grad_()
    compressed = torch.randn(B, T, lora + r, device=DEVICE).to(dtype).requires_grad_()
    q_rot = q_states.view(B, T, H, nope + r).transpose(1, 2)[..., nope:]
    k_rot = compressed[..., lora:].view(B, 1, T, r)
    pos = torch.tensor([[0], [300]], device=DEVICE) + torch.arange(T, device=DEVICE)
    pos[0, 7:] -= 7  # a packed row: positions restart at 0
    cos, sin = module(q_rot, pos)
    inv, scaling = module.inv_freq, module.attention_scaling

    hq, hk = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    aq, ak = apply_rope(q_rot, k_rot, pos, inv, scaling, layout="interleaved_to_half")
    assert ak.shape == (B, 1, T, r) and aq.dtype == hq.dtype == dtype
    up = (torch.randn_like(hq, dtype=torch.float32), torch.randn_like(hk, dtype=torch.float32))
    got = (aq, ak, *grads((aq, ak), (q_rot, k_rot), up))
    hf = (hq, hk, *grads((hq, hk), (q_rot, k_rot), up))
    if dtype == torch.float32:
        for x, h in zip(got, hf):
            assert rel_err(x, h) < 2e-6
        return
    q64, k64, (rq, rk) = reference64(q_rot, k_rot, pos, inv, scaling, r, "interleaved_to_half")
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    check_against_transformers(got, ref, hf, dtype, "mistral4", no_worse=True)


# ---------------------------------------------------------------------------------------------
# The PyTorch path, double backward, torch.library registration and bad input.


@pytest.mark.parametrize("rope_layout", LAYOUTS)
def test_pytorch_fallback_without_interpreter(monkeypatch, rope_layout):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def launched(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched without the interpreter")

    monkeypatch.setattr(rope_launch, "_launch_rope", launched)
    q, k = make_qk(3, 2, 1, 7, 48, torch.bfloat16, "qkv", device="cpu", requires_grad=True)
    pos = positions(3, 7, device="cpu")
    args = (pos, default_inv_freq(16, device="cpu"), 1.1, 16, rope_layout)
    aq, ak = apply_rope(q, k, *args)
    q64, k64, (rq, rk) = reference64(q, k, *args)
    eq, ek = eager_pairs(q, k, *args)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    eager = (eq, ek, *grads((eq, ek), (q, k), up))
    for what, x, r, e in zip(("q", "k", "grad q", "grad k"), got, ref, eager):
        assert_close_budget(x, r, e, torch.bfloat16, f"fallback {what}")


@pytest.mark.parametrize("rope_layout", LAYOUTS)
def test_double_backward_matches_reference(rope_layout):
    q, k = make_qk(2, 4, 1, 6, 16, torch.float32, "hf", requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [3, 4, 5, 6, 7, 8]], device=DEVICE)
    inv_freq = default_inv_freq(12)

    def with_layout(apply):
        return lambda qq, kk, dtype: apply(qq, kk, pos, inv_freq.to(dtype), 0.9, 12, rope_layout)

    assert_double_backward_matches(q, k, with_layout(apply_rope),
                                   with_layout(apply_rope_reference), rope_layout)  # fmt: skip


def test_ops_pass_opcheck():
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32, "hf", requires_grad=True)
    pos, inv = torch.arange(3, device=DEVICE)[None], default_inv_freq(8)
    ops = torch.ops.surgery
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    for layout in LAYOUTS:
        torch.library.opcheck(ops.rope_fwd.default, (q, k, pos, inv, 0.5, 8, layout))
        torch.library.opcheck(
            ops.rope_bwd.default, (q, k, pos, inv, 0.5, 8, layout), test_utils=quick
        )
    # Calls written before ``layout`` existed keep the rotate-half meaning.
    want = apply_rope(q.detach(), k.detach(), pos, inv, 0.5)
    got = ops.rope_fwd(q.detach(), k.detach(), pos, inv, 0.5, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rope_layout", LAYOUTS)
def test_traces_with_fullgraph_on_cpu(rope_layout):
    torch._dynamo.reset()
    q, k = make_qk(2, 2, 1, 5, 16, torch.bfloat16, "hf", requires_grad=True)
    pos, inv = torch.arange(5, device=DEVICE)[None], default_inv_freq(16)
    fn = torch.compile(
        lambda a, b: apply_rope(a, b, pos, inv, 1.0, layout=rope_layout),
        fullgraph=True,
        backend="aot_eager",
    )
    got, want = fn(q, k), apply_rope(q, k, pos, inv, 1.0, layout=rope_layout)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    up = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for a, b in zip(grads(got, (q, k), up), grads(want, (q, k), up)):
        assert torch.equal(a, b)


def test_unknown_layout_raises_before_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("launched before validating")

    monkeypatch.setattr(rope_api, "_rope", launched)
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    with pytest.raises(ValueError, match=r"layout must be one of half, interleaved.*'pairs'"):
        apply_rope(q, k, torch.arange(5)[None], default_inv_freq(16, device="cpu"), layout="pairs")


# ---------------------------------------------------------------------------------------------
# GPU: real sizes against transformers, and torch.compile with the inductor.


@pytest.mark.gpu
@pytest.mark.parametrize("rope_layout", LAYOUTS)
def test_gpu_real_sizes_match_transformers(rope_layout):
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb
    from transformers.models.mistral4.modeling_mistral4 import apply_rotary_pos_emb_interleave

    dtype = torch.bfloat16
    if rope_layout == "interleaved":  # Llama 4 Scout: 40 query heads, 8 key heads, D 128
        B, Hq, Hk, T, D = 2, 40, 8, 4096, 128
        module = llama4_rotary("llama3", D)
    else:  # Mistral 4 MLA: 32 query heads, one rotary key head, r 64
        B, Hq, Hk, T, D = 2, 32, 1, 4096, 64
        module = mistral4_rotary(D, 64, 1.0)
    q, k = make_qk(B, Hq, Hk, T, D, dtype, "hf", requires_grad=True)
    pos = (torch.arange(T, device="cuda") % 1000)[None] + torch.randint(
        0, 120000, (B, 1), device="cuda"
    )
    inv, scaling = module.inv_freq, module.attention_scaling
    if rope_layout == "interleaved":
        hq, hk = apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), module(q, pos))
        hq, hk = hq.transpose(1, 2), hk.transpose(1, 2)
    else:
        hq, hk = apply_rotary_pos_emb_interleave(q, k, *module(q, pos))
    aq, ak = apply_rope(q, k, pos, inv, scaling, layout=rope_layout)
    q64, k64, (rq, rk) = reference64(q, k, pos, inv, scaling, D, rope_layout)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    hf = (hq, hk, *grads((hq, hk), (q, k), up))
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    check_against_transformers(got, ref, hf, dtype, rope_layout, rope_layout != "interleaved")


@pytest.mark.gpu
@pytest.mark.parametrize("rope_layout", LAYOUTS)
def test_gpu_torch_compile_fullgraph(rope_layout):
    torch._dynamo.reset()
    q, k = make_qk(2, 8, 1, 512, 64, torch.bfloat16, "hf", requires_grad=True)
    pos = (torch.arange(512, device="cuda") % 300)[None]
    inv = default_inv_freq(64, device="cuda")
    fn = lambda a, b: apply_rope(a, b, pos, inv, 1.0, layout=rope_layout)
    got, want = torch.compile(fn, fullgraph=True)(q, k), fn(q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    up = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for a, b in zip(grads(got, (q, k), up), grads(want, (q, k), up)):
        assert torch.equal(a, b)
