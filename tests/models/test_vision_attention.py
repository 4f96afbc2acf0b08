"""The Qwen-VL vision towers' attention (``MultimodalWrapper.vision_attention``) in one varlen
call per layer (``surgery.attention.vision``): the tower of every Qwen-VL wrapper, patched in
bf16, gives transformers' output and gradients within bf16's budget against fp32, with one
kernel call per block over exactly the segments transformers hands the block (Qwen2.5-VL's
windows and its full-attention images), both directions. On CPU the kernel is
``tests.utils.ReferenceVarlen`` (flash attention needs CUDA); gpu-marked, the real kernel.
Where the kernel does not apply (fp32, no kernel, a flash implementation) transformers' forward
runs, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

import surgery
import surgery.attention.vision as vision_attention
from surgery.convergence.minis import mini_multimodal_config
from surgery.describe import describe
from surgery.patching.swap import ORIGINAL_ATTR
from tests.utils import ReferenceVarlen, assert_close_budget, dense_varlen

from .test_multimodal import PAIRS, WRAPPERS, image_batch, text_config

QWEN_VL = [pair for pair in WRAPPERS if PAIRS[pair][1].vision_attention is not None]


def test_the_qwen_vl_wrappers_name_their_vision_attention():
    assert sorted(PAIRS[p][1].model_type for p in QWEN_VL) == [
        "qwen2_5_vl",
        "qwen2_vl",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_vl",
        "qwen3_vl_moe",
    ]


def tiny_tower_vlm(pair: str):
    """The pair's mini wrapper with two vision blocks; Qwen2.5-VL's second attends over whole
    images (``fullatt_block_indexes``), its first over windows of one merged patch."""
    spec, wrapper = PAIRS[pair]
    config = mini_multimodal_config(wrapper).build(text_config(spec, wrapper))
    config.vision_config.depth = 2
    if wrapper.model_type == "qwen2_5_vl":
        config.vision_config.fullatt_block_indexes = [1]
    torch.manual_seed(0)
    model = wrapper.wrapper_class()._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # attention logits of order one: at init they are near zero, and a
        for block in model.model.visual.blocks:  # near-uniform softmax hides a wrong rotation
            block.attn.qkv.weight.normal_(0.0, 2.0 / block.attn.dim**0.5)
    return model.train()


def segments_seen(model, wrapper, batch) -> list[list[int]]:
    """The ``cu_seqlens`` each vision attention module is called with, in order."""
    seen = []
    hooks = [
        m.register_forward_pre_hook(
            lambda _, args, kwargs: seen.append(kwargs["cu_seqlens"].tolist()), with_kwargs=True
        )
        for m in model.modules()
        if wrapper.is_vision_attention(m)
    ]
    try:
        tower_step(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return seen


def tower_step(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's merged output and the gradients of its parameters (flattened, fp32) for a fixed
    random projection of it."""
    tower = model.model.visual
    tower.zero_grad(set_to_none=True)
    dtype = next(tower.parameters()).dtype
    out = tower(batch["pixel_values"].to(dtype), grid_thw=batch["image_grid_thw"]).pooler_output
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    (out.float() * weight).sum().backward()
    # Every parameter's (zeros where none reached it, e.g. Qwen3-VL's deepstack mergers: a
    # compiled backward may give them zeros where the eager one gives None).
    grads = [
        torch.zeros(p.numel()) if p.grad is None else p.grad.float().flatten().cpu()
        for p in tower.parameters()
    ]
    return out.detach().float(), torch.cat(grads)


def half(model):
    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.fixture
def reference_kernel(monkeypatch):
    kernel = ReferenceVarlen()
    monkeypatch.setattr(vision_attention, "varlen_kernel", lambda device: kernel)
    return kernel


@pytest.mark.parametrize("pair", QWEN_VL)
def test_vision_attention_is_one_varlen_call_per_block(pair, reference_kernel):
    fp32 = tiny_tower_vlm(pair)
    batch = image_batch(fp32, PAIRS[pair][1])
    eager = half(fp32)
    patched = surgery.patch(half(fp32))
    want = segments_seen(eager, PAIRS[pair][1], batch)
    assert len(want) == 2 and not reference_kernel.calls
    (ref, ref_grads), (base, base_grads) = tower_step(fp32, batch), tower_step(eager, batch)
    got, grads = tower_step(patched, batch)
    assert [c["cu"] for c in reference_kernel.calls] == want
    scale = patched.model.visual.blocks[0].attn.scaling
    assert {(c["window"], c["scale"]) for c in reference_kernel.calls} == {((-1, -1), scale)}
    assert_close_budget(got, ref, base, torch.bfloat16, what=f"{pair} tower output")
    assert_close_budget(grads, ref_grads, base_grads, torch.bfloat16, what=f"{pair} tower grads")
    if PAIRS[pair][1].model_type == "qwen2_5_vl":  # windows, then whole images
        assert want[0] != want[1] and want[1] == [0, 16, 32]


@pytest.mark.parametrize("pair", ["qwen2_5_vl_text-qwen2_5_vl", "qwen3_vl_text-qwen3_vl"])
def test_fp32_weights_under_bf16_autocast_take_the_kernel(pair, reference_kernel):
    """Mixed precision as the Trainer's ``bf16=True`` runs it (fp32 weights, bf16 autocast): the
    projections come out in bf16, so the blocks take the kernel, within bf16's budget."""
    fp32 = tiny_tower_vlm(pair)
    batch = image_batch(fp32, PAIRS[pair][1])
    eager, patched = copy.deepcopy(fp32), surgery.patch(copy.deepcopy(fp32))
    ref = tower_step(fp32, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base, got = tower_step(eager, batch), tower_step(patched, batch)
    assert len(reference_kernel.calls) == 2
    for what, g, r, b in zip(("output", "grads"), got, ref, base):
        assert_close_budget(g, r, b, torch.bfloat16, what=f"{pair} tower {what}")


@pytest.mark.parametrize("pair", QWEN_VL)
def test_wrapper_step_reaches_the_kernel_and_unpatch_restores(pair, reference_kernel):
    """Through the wrapper's forward: a patched bf16 training step calls the kernel once per
    block; the swap is described and ``unpatch`` puts transformers' forward back."""
    wrapper = PAIRS[pair][1]
    fp32 = tiny_tower_vlm(pair)
    batch = image_batch(fp32, wrapper)
    patched = surgery.patch(half(fp32))
    attn = patched.model.visual.blocks[0].attn
    assert ORIGINAL_ATTR in attn.__dict__
    assert "varlen" in str(describe(patched))
    batch16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    patched(**batch16).loss.backward()
    assert len(reference_kernel.calls) == 2
    surgery.unpatch(patched)
    assert ORIGINAL_ATTR not in attn.__dict__ and "forward" not in attn.__dict__


@pytest.mark.parametrize("pair", ["qwen2_5_vl_text-qwen2_5_vl", "qwen3_vl_text-qwen3_vl"])
def test_where_the_kernel_does_not_apply_transformers_runs(pair, reference_kernel, monkeypatch):
    """fp32, a vision tower asked for flash attention (transformers' own varlen then), or no
    kernel on the device: the kernel is not called and the output is transformers' bit for bit;
    ``varlen_attention=False`` leaves the tower unpatched."""
    fp32 = tiny_tower_vlm(pair)
    batch = image_batch(fp32, PAIRS[pair][1])
    want = tower_step(fp32, batch)
    got = tower_step(surgery.patch(copy.deepcopy(fp32)), batch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not reference_kernel.calls
    off = surgery.patch(half(fp32), varlen_attention=False)
    assert ORIGINAL_ATTR not in off.model.visual.blocks[0].attn.__dict__
    flash = surgery.patch(half(fp32))
    flash.config.vision_config._attn_implementation = "flash_attention_2"
    attn = flash.model.visual.blocks[0].attn
    assert attn.config._attn_implementation == "flash_attention_2"
    hidden = torch.randn(32, attn.dim, dtype=torch.bfloat16)
    cos = sin = torch.zeros(32, attn.head_dim, dtype=torch.bfloat16)
    monkeypatch.setattr(type(attn), "forward", lambda self, *a, **k: "transformers")
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    assert attn(hidden, cu_seqlens=cu, position_embeddings=(cos, sin)) == "transformers"
    monkeypatch.setattr(vision_attention, "varlen_kernel", lambda device: None)
    flash.config.vision_config._attn_implementation = "sdpa"
    assert attn(hidden, cu_seqlens=cu, position_embeddings=(cos, sin)) == "transformers"
    assert not reference_kernel.calls


@pytest.mark.gpu
@pytest.mark.parametrize("pair", QWEN_VL)
def test_vision_attention_on_the_gpu(pair):
    """The real kernel (flash attention's varlen) against transformers' per-segment sdpa, bf16 on
    CUDA, within bf16's budget against fp32; one kernel call per block."""
    fp32 = tiny_tower_vlm(pair).cuda()
    batch = {k: v.cuda() for k, v in image_batch(fp32, PAIRS[pair][1]).items()}
    calls = []
    real = vision_attention.varlen_kernel

    def counting(device):
        kernel = real(device)
        return None if kernel is None else lambda *a, **k: calls.append(1) or kernel(*a, **k)

    eager = half(fp32)
    patched = surgery.patch(half(fp32))
    (ref, ref_grads), (base, base_grads) = tower_step(fp32, batch), tower_step(eager, batch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vision_attention, "varlen_kernel", counting)
        got, grads = tower_step(patched, batch)
    assert len(calls) == 2
    assert_close_budget(got, ref, base, torch.bfloat16, what=f"{pair} tower output")
    assert_close_budget(grads, ref_grads, base_grads, torch.bfloat16, what=f"{pair} tower grads")


@pytest.mark.parametrize("pair", ["qwen2_5_vl_text-qwen2_5_vl", "qwen3_vl_text-qwen3_vl"])
def test_compiled_tower_matches_and_reads_nothing_on_the_host(pair, monkeypatch):
    """``torch.compile`` of the patched tower (graph breaks allowed: transformers' own window
    index is read on the host), with a traceable reference kernel: output and gradients bit for
    bit the uncompiled patched tower's, and under compile the kernel's grid is sized from the
    token count (an upper bound), not from a host read of ``cu_seqlens``."""
    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        seen.append((max_q, q.shape[0], torch.compiler.is_compiling()))
        return dense_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(vision_attention, "varlen_kernel", lambda device: kernel)
    fp32 = tiny_tower_vlm(pair)
    batch = image_batch(fp32, PAIRS[pair][1])
    patched = surgery.patch(half(fp32))
    want = tower_step(patched, batch)
    assert all(m < n and not compiling for m, n, compiling in seen)
    seen.clear()
    patched.model.visual.compile(backend="aot_eager")
    got = tower_step(patched, batch)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert seen and all(m == n and compiling for m, n, compiling in seen)


def test_lora_on_the_vision_attention_trains_through_the_kernel(reference_kernel):
    """PEFT LoRA on the tower's ``qkv`` and ``proj`` (and the text attention), patched after
    wrapping: the blocks take the kernel through the LoRA layers, and every LoRA gradient is
    transformers' within bf16's budget against fp32."""
    peft = pytest.importorskip("peft")
    pair = "qwen2_5_vl_text-qwen2_5_vl"
    fp32 = tiny_tower_vlm(pair)
    batch = image_batch(fp32, PAIRS[pair][1])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj", "q_proj"])

    def lora(model):
        torch.manual_seed(1)
        wrapped = peft.get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return wrapped

    def lora_grads(wrapped):
        dtype = next(wrapped.parameters()).dtype
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        wrapped.zero_grad(set_to_none=True)
        wrapped(**inputs).loss.backward()
        grads = [p.grad.float().flatten() for n, p in wrapped.named_parameters() if "lora" in n]
        return torch.cat(grads)

    ref, base = lora_grads(lora(fp32)), lora_grads(lora(half(fp32)))
    patched = surgery.patch(lora(half(fp32)))
    got = lora_grads(patched)
    assert len(reference_kernel.calls) == 2
    assert_close_budget(got, ref, base, torch.bfloat16, what="LoRA gradients")
