"""Multimodal RoPE (``apply_rope(..., mrope_section=...)``) against transformers' own code.

transformers' multimodal rotary modules (Qwen2.5-VL: sections contiguous; Qwen3-VL and Qwen3.5:
interleaved, Qwen3.5 with partial rotary) build cos/sin from (3, B, T) position ids, one row per
section, and the models rotate with ``apply_rotary_pos_emb``. Every test here builds those modules
from tiny configs and compares the kernel (Triton, through the interpreter on CPU) with them, with
the fp64 reference (``apply_rope_reference``) as ground truth. Error budget as in test_rope.py
(``tests.utils.TOLERANCES``): the kernel may exceed transformers' bf16 error against the fp64
reference by the TOLERANCES margin only, and must be no worse than it; in fp32 it equals
transformers' fp32 path to rounding.

Position ids come from transformers' ``get_rope_index`` on a tiny Qwen2.5-VL with several images
(non-square grids) and a video, so image tokens carry three different position rows; the test
``test_image_tokens_rotate_with_their_own_rows`` shows that a kernel reading a wrong row (height
and width swapped, or text positions) fails the same comparison.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import surgery.kernels.rope.api as rope_api
import surgery.kernels.rope.launch as rope_launch
from surgery.kernels import apply_rope, apply_rope_reference
from surgery.kernels.rope import RopeLaunch, mrope_rows, rope_bwd, rope_fwd
from tests.kernels.test_rope import (
    DTYPE_NAMES,
    assert_double_backward_matches,
    assert_no_worse_than_transformers,
    grads,
    make_qk,
)
from tests.utils import DEVICE, assert_close_budget, poisoned_empty, rel_err

# ---------------------------------------------------------------------------------------------
# transformers' multimodal rotary modules, from tiny configs with the released rotary settings.


@dataclass(frozen=True)
class Model:
    name: str
    head_dim: int
    mrope_section: tuple[int, int, int]
    interleaved: bool
    rope_theta: float
    partial_rotary_factor: float = 1.0

    @property
    def rotary_dim(self):
        return int(self.head_dim * self.partial_rotary_factor)


MODELS = {
    m.name: m
    for m in (
        Model("qwen2.5-vl", 128, (16, 24, 24), False, 1e6),  # Qwen2.5-VL-7B
        Model("qwen3-vl", 128, (24, 20, 20), True, 5e6),  # Qwen3-VL
        Model("qwen3.5", 256, (11, 11, 10), True, 1e7, 0.25),  # Qwen3.5: rotary 64 of 256
        # Small and odd: rotary_dim/2 = 20 is padded to 32 in the kernel, sections not multiples
        # of anything.
        Model("contiguous-d40", 40, (5, 8, 7), False, 1e4),
        Model("interleaved-d40", 40, (8, 7, 5), True, 1e4),
    )
}


def rotary_module(model: Model, device=DEVICE):
    """transformers' text rotary module of the model's family, built from a tiny config."""
    rope_parameters = {
        "rope_type": "default",
        "rope_theta": model.rope_theta,
        "mrope_section": list(model.mrope_section),
    }
    common = dict(
        hidden_size=4 * model.head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=model.head_dim,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=16,
        rope_parameters=rope_parameters,
    )
    if not model.interleaved:
        from transformers import Qwen2_5_VLTextConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

        module = Qwen2_5_VLRotaryEmbedding(Qwen2_5_VLTextConfig(**common))
    elif model.partial_rotary_factor == 1.0:
        from transformers import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        rope_parameters["mrope_interleaved"] = True
        module = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(**common))
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        rope_parameters.update(
            mrope_interleaved=True, partial_rotary_factor=model.partial_rotary_factor
        )
        module = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**common))
    assert tuple(module.mrope_section) == model.mrope_section
    assert module.inv_freq.shape == (model.rotary_dim // 2,)
    return module.to(device)


def transformers_rope(model: Model, module, q, k, position_ids):
    """What the model's attention does: cos/sin from the rotary module (in q's dtype), then its
    ``apply_rotary_pos_emb`` (Qwen3.5's passes the channels past rotary_dim through)."""
    if model.partial_rotary_factor != 1.0:
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb
    elif model.interleaved:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb
    cos, sin = module(q, position_ids)
    return apply_rotary_pos_emb(q, k, cos, sin)


def kernel_rope(model: Model, module, q, k, position_ids, **kwargs):
    return apply_rope(
        q, k, position_ids, module.inv_freq, module.attention_scaling, model.rotary_dim,
        mrope_section=model.mrope_section, mrope_interleaved=model.interleaved, **kwargs,
    )  # fmt: skip


def reference64(model: Model, module, q, k, position_ids):
    """fp64 ground truth, differentiable w.r.t. fp64 leaves made from q and k."""
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    out = apply_rope_reference(
        q64, k64, position_ids, module.inv_freq.double(), module.attention_scaling,
        model.rotary_dim, mrope_section=model.mrope_section,
        mrope_interleaved=model.interleaved,
    )  # fmt: skip
    return q64, k64, out


# ---------------------------------------------------------------------------------------------
# Position ids of real multimodal inputs: transformers' get_rope_index on a tiny Qwen2.5-VL.

IMAGE, VIDEO, START, END = 12, 13, 14, 15  # token ids of the tiny config


@functools.cache
def _qwen2_5_vl_model():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=1,
            intermediate_size=8,
            vocab_size=16,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            out_hidden_size=32,
            intermediate_size=16,
            num_heads=2,
            spatial_merge_size=2,
            tokens_per_second=2,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen2_5_VLModel(cfg).eval()


# Batch rows of text runs (ints) and vision items (modality 1 image / 2 video, t, h, w): the
# grid_thw of the item in patches, merged 2 x 2 into t * h * w / 4 tokens.
VISION_ROWS = (
    (3, (1, 1, 4, 6), 2, (1, 1, 2, 32), 2, (2, 3, 4, 4), 2),  # two images, a 3-patch video
    (2, (1, 1, 24, 4), 1, (2, 2, 4, 6), 3),  # a tall image and a video, then left padding
)


def _row(parts):
    """Token ids and modality types (0 text, 1 image, 2 video) of one batch row."""
    ids, types = [], []
    for part in parts:
        if isinstance(part, int):  # a run of text tokens
            ids += [1] * part
            types += [0] * part
        else:
            kind, t, h, w = part
            n = t * (h // 2) * (w // 2)
            ids += [START] + [IMAGE if kind == 1 else VIDEO] * n + [END]
            types += [0] + [kind] * n + [0]
    return ids, types


@functools.cache
def vision_positions():
    """(3, 2, T) position ids and the (2, T) mask of vision tokens of ``VISION_ROWS``, from
    transformers' own ``get_rope_index`` (videos at 2 seconds per temporal patch: temporal steps
    of 4), the shorter row left-padded."""
    made = [_row(r) for r in VISION_ROWS]
    T = max(len(ids) for ids, _ in made)
    input_ids = torch.zeros(2, T, dtype=torch.long)
    types = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, (ids, ty) in enumerate(made):
        input_ids[b, T - len(ids) :] = torch.tensor(ids)  # left padding
        types[b, T - len(ids) :] = torch.tensor(ty)
        mask[b, T - len(ids) :] = 1
    items = [p for r in VISION_ROWS for p in r if isinstance(p, tuple)]
    image_grid = torch.tensor([p[1:] for p in items if p[0] == 1])
    video_grid = torch.tensor([p[1:] for p in items if p[0] == 2])
    pos, _ = _qwen2_5_vl_model().get_rope_index(
        input_ids,
        types,
        image_grid_thw=image_grid,
        video_grid_thw=video_grid,
        second_per_grid_ts=torch.tensor([2.0, 2.0]),
        attention_mask=mask,
    )
    return pos, types != 0


def test_positions_have_three_different_rows_at_vision_tokens():
    # What makes the tests below sensitive: at vision tokens the temporal, height and width rows
    # differ from each other (by up to 15: the 1 x 16 image), in both batch rows.
    pos, vision = vision_positions()
    assert pos.shape[:2] == (3, 2) and vision.sum() >= 60
    for b in range(2):
        t, h, w = pos[:, b, vision[b]]
        for name, x, y in (("t/h", t, h), ("h/w", h, w), ("t/w", t, w)):
            assert (x != y).float().mean() > 0.25, f"row {b}: {name} rows mostly equal"
        text = pos[0, b, ~vision[b]]
        assert torch.equal(text, pos[1, b, ~vision[b]]) and torch.equal(text, pos[2, b, ~vision[b]])
    assert (pos[2] - pos[1]).abs().max() >= 15
    assert (pos[0].diff(dim=-1) >= 4).any(), "the video's temporal steps of 4 are missing"


# ---------------------------------------------------------------------------------------------
# Forward and gradients against transformers and the fp64 reference.

CASES = [  # (model, B, Hq, Hk, position offset): the offset is a KV-cache's rope delta
    ("qwen2.5-vl", 2, 4, 2, 0),
    ("qwen3-vl", 2, 4, 2, 3000),
    ("qwen3.5", 2, 2, 1, 0),
    ("contiguous-d40", 2, 3, 1, 100),
    ("interleaved-d40", 2, 3, 3, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-Hq{c[2]}-Hk{c[3]}-off{c[4]}")
def test_matches_transformers(case, dtype):
    name, B, Hq, Hk, offset = case
    model = MODELS[name]
    module = rotary_module(model)
    pos = vision_positions()[0].to(DEVICE) + offset
    T = pos.shape[-1]
    # transformers' layout: projections viewed (B, T, H, D) and transposed to (B, H, T, D).
    q, k = make_qk(B, Hq, Hk, T, model.head_dim, dtype, "hf", requires_grad=True)

    aq, ak = kernel_rope(model, module, q, k, pos)
    hq, hk = transformers_rope(model, module, q, k, pos)
    assert aq.dtype == hq.dtype == dtype and aq.stride() == torch.empty_like(q).stride()
    if model.rotary_dim < model.head_dim:  # pass-through channels copied bit for bit
        rd = model.rotary_dim
        assert torch.equal(aq[..., rd:], q[..., rd:]) and torch.equal(ak[..., rd:], k[..., rd:])
    up = (torch.randn_like(aq, dtype=torch.float32), torch.randn_like(ak, dtype=torch.float32))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    hf = (hq, hk, *grads((hq, hk), (q, k), up))
    if dtype == torch.float32:
        # Same fp32 angles, cos/sin and formula: transformers' result to rounding.
        for what, x, h in zip(("q", "k", "grad q", "grad k"), got, hf):
            assert rel_err(x, h) < 2e-6, f"{name} {what}: {rel_err(x, h):.2e}"
        return
    q64, k64, (rq, rk) = reference64(model, module, q, k, pos)
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    for what, x, r, h in zip(("q", "k", "grad q", "grad k"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{name} {what}")
        assert_no_worse_than_transformers(x, r, h, f"{name} {what}")


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_matches_transformers(name):
    # The reference (the fp64 ground truth above, here computed in fp32 to compare like with
    # like) is transformers' map: the budget measures against it, not against the kernel's rule.
    model = MODELS[name]
    module = rotary_module(model)
    pos = vision_positions()[0].to(DEVICE) + 500
    q, k = make_qk(2, 2, 1, pos.shape[-1], model.head_dim, torch.float32, "hf")
    rq, rk = apply_rope_reference(
        q, k, pos, module.inv_freq, module.attention_scaling, model.rotary_dim,
        mrope_section=model.mrope_section, mrope_interleaved=model.interleaved,
    )  # fmt: skip
    hq, hk = transformers_rope(model, module, q, k, pos)
    assert rel_err(rq, hq) < 2e-6 and rel_err(rk, hk) < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl", "qwen3.5"])
def test_image_tokens_rotate_with_their_own_rows(name, dtype):
    """A kernel that took a wrong position row at vision tokens fails the comparison with
    transformers that the right one passes: shown by feeding the kernel the rows such a kernel
    would read (height and width swapped, temporal and height swapped, the text row everywhere,
    plain sequence indices). The comparison is test_matches_transformers', at vision tokens."""
    model = MODELS[name]
    module = rotary_module(model)
    pos, vision = vision_positions()
    pos, vision = pos.to(DEVICE), vision.to(DEVICE)
    B, T = 2, pos.shape[-1]
    q, k = make_qk(B, 4, 2, T, model.head_dim, dtype, "hf")
    _, _, (rq, rk) = reference64(model, module, q, k, pos)
    hq, hk = transformers_rope(model, module, q, k, pos)

    def at_vision(x):  # (B, H, T, D) -> the vision tokens' rows
        return x.transpose(1, 2)[vision]

    def check(pos_used):
        oq, ok = kernel_rope(model, module, q, k, pos_used)
        for x, r, h, what in ((oq, rq, hq, "q"), (ok, rk, hk, "k")):
            x, r, h, what = at_vision(x), at_vision(r), at_vision(h), f"{name} {what}"
            if dtype == torch.float32:
                assert rel_err(x, h) < 2e-6, f"{what}: rel err {rel_err(x, h):.2e}"
            else:
                assert_close_budget(x, r, h, dtype, what)
                assert_no_worse_than_transformers(x, r, h, what)

    check(pos)  # the right rows pass
    arange = torch.arange(T, device=DEVICE).expand(3, B, T)
    wrong = {
        "height/width swapped": pos[[0, 2, 1]],
        "temporal/height swapped": pos[[1, 0, 2]],
        "text row everywhere": pos[[0, 0, 0]],
        "sequence index": arange,
    }
    text_q = kernel_rope(model, module, q, k, pos)[0].transpose(1, 2)[~vision]
    for what, pos_used in wrong.items():
        with pytest.raises(AssertionError, match="rel err"):
            check(pos_used)
        if what != "sequence index":  # text tokens have one position in all three rows
            oq = kernel_rope(model, module, q, k, pos_used)[0]
            assert torch.equal(oq.transpose(1, 2)[~vision], text_q), what


# ---------------------------------------------------------------------------------------------
# The kernel alone: launchers into poisoned outputs, strides, launch configurations.

STRIDE_CASES = [  # (model, B, Hq, Hk, q/k layout, position ids layout, dtype)
    ("contiguous-d40", 2, 3, 1, "qkv", "contiguous", torch.bfloat16),
    ("interleaved-d40", 2, 2, 2, "strided_d", "btk", torch.float32),  # stored (B, T, 3)
    ("qwen3.5", 2, 2, 1, "contiguous", "shared-batch", torch.float16),  # (3, 1, T)
    ("qwen2.5-vl", 3, 2, 1, "hf", "2d", torch.bfloat16),  # (B, T): one row for all three
]


def _positions_in_layout(pos, layout, B):
    if layout == "contiguous":
        return pos
    if layout == "btk":  # (B, T, 3) storage viewed as (3, B, T)
        return pos.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    if layout == "shared-batch":
        return pos[:, :1]
    assert layout == "2d"
    return pos[0, :1].expand(B, -1)


@pytest.mark.parametrize("case", STRIDE_CASES, ids=lambda c: f"{c[0]}-{c[4]}-pos_{c[5]}-"
                         f"{DTYPE_NAMES[c[6]]}")  # fmt: skip
def test_launchers_any_strides_match_reference(case):
    name, B, Hq, Hk, qk_layout, pos_layout, dtype = case
    model = MODELS[name]
    module = rotary_module(model)
    base = vision_positions()[0].to(DEVICE)[:, :1].expand(3, B, -1) + 7
    pos = _positions_in_layout(base, pos_layout, B)
    T = base.shape[-1]
    q, k = make_qk(B, Hq, Hk, T, model.head_dim, dtype, qk_layout, requires_grad=True)
    args = (module.inv_freq, module.attention_scaling, model.rotary_dim, "half")
    mrope = dict(mrope_section=model.mrope_section, mrope_interleaved=model.interleaved)
    pos_kernel = pos if pos.dim() == 3 else pos.expand(3, *pos.shape)

    out = (poisoned_empty(*q.shape, dtype=dtype), poisoned_empty(*k.shape, dtype=dtype))
    oq, ok = rope_fwd(q.detach(), k.detach(), pos_kernel, *args, out=out, **mrope)
    aq, ak = kernel_rope(model, module, q, k, pos)
    assert torch.equal(aq, oq) and torch.equal(ak, ok), "apply_rope differs from rope_fwd"

    q64, k64, (rq, rk) = reference64(model, module, q, k, pos_kernel)
    hq, hk = transformers_rope(model, module, q, k, pos_kernel)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    hf = (hq, hk, *grads((hq, hk), (q, k), up))
    for what, x, r, h in zip(("q", "k", "grad q", "grad k"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{name} {what}")

    gout = (poisoned_empty(*q.shape, dtype=dtype), poisoned_empty(*k.shape, dtype=dtype))
    bq, bk = rope_bwd(up[0].to(dtype), up[1].to(dtype), pos_kernel, *args, out=gout, **mrope)
    assert torch.equal(bq, got[2]) and torch.equal(bk, got[3])


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_launch_configs_agree(interleaved):
    model = MODELS["interleaved-d40" if interleaved else "contiguous-d40"]
    pos = vision_positions()[0].to(DEVICE)
    q, k = make_qk(2, 5, 1, pos.shape[-1], model.head_dim, torch.bfloat16, "hf")
    inv = rotary_module(model).inv_freq
    mrope = dict(mrope_section=model.mrope_section, mrope_interleaved=interleaved)
    want = rope_fwd(q, k, pos, inv, 1.0, model.rotary_dim, **mrope)
    for launch in (RopeLaunch(), RopeLaunch(block_t=16, tile_elems=64, head_groups=3)):
        out = (poisoned_empty(*q.shape, dtype=q.dtype), poisoned_empty(*k.shape, dtype=k.dtype))
        got = rope_fwd(q, k, pos, inv, 1.0, model.rotary_dim, launch=launch, out=out, **mrope)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_equal_rows_are_text_rope_bit_for_bit(interleaved):
    # Text-only input (transformers expands (B, T) positions to three equal rows): the same
    # angles, so the text kernel's result exactly, forward and backward, in every pair layout.
    model = MODELS["interleaved-d40" if interleaved else "contiguous-d40"]
    inv = rotary_module(model).inv_freq
    q, k = make_qk(2, 3, 1, 9, 40, torch.bfloat16, "hf", requires_grad=True)
    pos = torch.randint(0, 4000, (2, 9), device=DEVICE)
    up = (torch.randn(q.shape, device=DEVICE), torch.randn(k.shape, device=DEVICE))
    mrope = dict(mrope_section=model.mrope_section, mrope_interleaved=interleaved)
    for layout in ("half", "interleaved"):
        text = apply_rope(q, k, pos, inv, 0.9, 40, layout=layout)
        want = (*text, *grads(text, (q, k), up))
        for p in (pos, pos.expand(3, 2, 9)):
            multi = apply_rope(q, k, p, inv, 0.9, 40, layout=layout, **mrope)
            for a, b in zip((*multi, *grads(multi, (q, k), up)), want):
                assert torch.equal(a, b), layout


def test_section_rows_match_transformers_recomposition():
    # mrope_rows (the PyTorch path's copy of the kernel's section rule) against transformers'
    # recomposition of per-row angles: angles that encode their row must come out as the rows.
    for model in MODELS.values():
        module = rotary_module(model, device="cpu")
        half = model.rotary_dim // 2
        row_angles = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, half)
        # recomposition_frequencies returns [f, f]: its first half is one angle per frequency.
        got = module.recomposition_frequencies(row_angles.clone())[0, 0, :half]
        want = mrope_rows(half, model.mrope_section, model.interleaved)
        assert got.long().tolist() == list(want), model.name


# ---------------------------------------------------------------------------------------------
# The PyTorch path, double backward, torch.library registration and bad input.


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3.5"])
def test_pytorch_fallback_without_interpreter(monkeypatch, name):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def launched(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched without the interpreter")

    monkeypatch.setattr(rope_launch, "_launch_rope", launched)
    model = MODELS[name]
    module = rotary_module(model, device="cpu")
    pos = vision_positions()[0]
    dtype = torch.bfloat16
    q, k = make_qk(2, 2, 1, pos.shape[-1], model.head_dim, dtype, "hf", device="cpu",
                   requires_grad=True)  # fmt: skip
    aq, ak = kernel_rope(model, module, q, k, pos)
    q64, k64, (rq, rk) = reference64(model, module, q, k, pos)
    hq, hk = transformers_rope(model, module, q, k, pos)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    hf = (hq, hk, *grads((hq, hk), (q, k), up))
    for what, x, r, h in zip(("q", "k", "grad q", "grad k"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"fallback {what}")
        assert_no_worse_than_transformers(x, r, h, f"fallback {what}")


def test_double_backward_matches_reference():
    model = MODELS["interleaved-d40"]
    module = rotary_module(model)
    pos = vision_positions()[0].to(DEVICE)[..., :8]
    q, k = make_qk(2, 2, 1, 8, 40, torch.float32, "hf")

    def sections(apply):
        return lambda qq, kk, dtype: apply(qq, kk, pos, module.inv_freq.to(dtype), 0.9, 40,
                                           mrope_section=model.mrope_section,
                                           mrope_interleaved=True)  # fmt: skip

    assert_double_backward_matches(q, k, sections(apply_rope), sections(apply_rope_reference))


def test_op_passes_opcheck():
    q, k = make_qk(1, 2, 1, 3, 16, torch.float32, "hf", requires_grad=True)
    pos = torch.tensor([[[0, 1, 1]], [[0, 1, 2]], [[0, 2, 1]]], device=DEVICE)
    inv = rotary_module(MODELS["contiguous-d40"]).inv_freq[:8]
    ops = torch.ops.surgery
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    for interleaved in (False, True):
        args = (q, k, pos, inv, 0.5, 16, "half", [2, 3, 3], interleaved)
        torch.library.opcheck(ops.rope_fwd.default, args, test_utils=quick)
        torch.library.opcheck(ops.rope_bwd.default, args, test_utils=quick)
    torch.library.opcheck(ops.rope_fwd.default, (q, k, pos, inv, 0.5, 16, "half", [2, 3, 3], True))


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_traces_with_fullgraph_on_cpu(interleaved):
    torch._dynamo.reset()
    model = MODELS["interleaved-d40" if interleaved else "contiguous-d40"]
    module = rotary_module(model)
    pos = vision_positions()[0].to(DEVICE)
    q, k = make_qk(2, 2, 1, pos.shape[-1], 40, torch.bfloat16, "hf", requires_grad=True)
    fn = lambda a, b, p: kernel_rope(model, module, a, b, p)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, pos), fn(q, k, pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    up = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for a, b in zip(grads(got, (q, k), up), grads(want, (q, k), up)):
        assert torch.equal(a, b)


def _bad(**over):
    args = {
        "q": torch.randn(2, 4, 5, 16),
        "k": torch.randn(2, 2, 5, 16),
        "position_ids": torch.zeros(3, 2, 5, dtype=torch.long),
        "inv_freq": torch.ones(8),
        "mrope_section": [2, 3, 3],
    }
    args.update(over)
    return args


BAD_INPUTS = {
    "section-sum": (_bad(mrope_section=[2, 3, 4]), ValueError, r"\[2, 3, 4\] must sum to .* 8"),
    "section-len": (_bad(mrope_section=[4, 4]), ValueError, r"three non-negative ints.*\[4, 4\]"),
    "section-negative": (_bad(mrope_section=[4, 5, -1]), ValueError, "non-negative"),
    "section-partial": (
        _bad(rotary_dim=8, inv_freq=torch.ones(4)),
        ValueError,
        r"must sum to rotary_dim/2 = 4",
    ),
    "pos-rows": (
        _bad(position_ids=torch.zeros(2, 2, 5, dtype=torch.long)),
        ValueError,
        r"\(3, 2, 5\) or \(3, 1, 5\).*got \(2, 2, 5\)",
    ),
    "pos-seq": (_bad(position_ids=torch.zeros(3, 2, 6).long()), ValueError, r"\(3, 2, 6\)"),
    "pos-batch": (_bad(position_ids=torch.zeros(3, 3, 5).long()), ValueError, r"\(3, 3, 5\)"),
    "pos-3d-no-section": (_bad(mrope_section=None), ValueError, "pass mrope_section"),
    "interleaved-no-section": (
        _bad(mrope_section=None, position_ids=torch.zeros(2, 5).long(), mrope_interleaved=True),
        ValueError,
        "needs mrope_section",
    ),
    "interleaved-not-bool": (_bad(mrope_interleaved=1), TypeError, "must be a bool"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise_before_launch(name, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("launched before validating")

    monkeypatch.setattr(rope_api, "_rope", launched)
    args, exc, match = BAD_INPUTS[name]
    with pytest.raises(exc, match=match):
        apply_rope(**args)


# ---------------------------------------------------------------------------------------------
# GPU: Qwen2.5-VL-7B's heads at a real length, torch.compile with the inductor.


def _long_vision_positions(B, T, device):
    """(3, B, T): the tiny input's rows repeated with growing offsets up to T tokens (a long
    multimodal sequence: image and video tokens throughout), then a large common offset."""
    pos, _ = vision_positions()
    reps = -(-T // pos.shape[-1])
    step = int(pos.max()) + 1
    tiled = torch.cat([pos[:, :1] + i * step for i in range(reps)], dim=-1)[..., :T]
    return (tiled.expand(3, B, T) + 5000).contiguous().to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl", "qwen3.5"])
def test_gpu_real_sizes_match_transformers(name):
    model = MODELS[name]
    B, T, dtype = 2, 4096, torch.bfloat16
    Hq, Hk = (28, 4) if name == "qwen2.5-vl" else (16, 2)
    module = rotary_module(model, device="cuda")
    pos = _long_vision_positions(B, T, "cuda")
    q, k = make_qk(B, Hq, Hk, T, model.head_dim, dtype, "hf", device="cuda", requires_grad=True)
    aq, ak = kernel_rope(model, module, q, k, pos)
    hq, hk = transformers_rope(model, module, q, k, pos)
    q64, k64, (rq, rk) = reference64(model, module, q, k, pos)
    up = (torch.randn_like(rq), torch.randn_like(rk))
    got = (aq, ak, *grads((aq, ak), (q, k), up))
    ref = (rq, rk, *grads((rq, rk), (q64, k64), up))
    hf = (hq, hk, *grads((hq, hk), (q, k), up))
    for what, x, r, h in zip(("q", "k", "grad q", "grad k"), got, ref, hf):
        assert_close_budget(x, r, h, dtype, f"{name} {what}")
        assert_no_worse_than_transformers(x, r, h, f"{name} {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3.5"])
def test_gpu_torch_compile_fullgraph(name):
    torch._dynamo.reset()
    model = MODELS[name]
    module = rotary_module(model, device="cuda")
    pos = _long_vision_positions(2, 512, "cuda")
    q, k = make_qk(2, 8, 2, 512, model.head_dim, torch.bfloat16, "hf", device="cuda",
                   requires_grad=True)  # fmt: skip
    fn = lambda a, b: kernel_rope(model, module, a, b, pos)
    got, want = torch.compile(fn, fullgraph=True)(q, k), fn(q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    up = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for a, b in zip(grads(got, (q, k), up), grads(want, (q, k), up)):
        assert torch.equal(a, b)
