"""How the patched attention treats masks.

``share_attention_mask``: sdpa gets one additive mask per forward, shared by every layer: the same
loss and gradients, bit for bit, as handing it the boolean mask (masked weights underflow to
exactly 0 either way, and a query row that attends to no key, as every left-pad position, gets
sdpa's zeros); the shared tensor is freed with the forward's graph. (The memory it saves, one mask
per layer kept by sdpa's masked backends, is measured on the GPU: tests/surgery/test_gpu.py.)
Left padding is also checked against unpatched transformers for every architecture, on sdpa and
on eager attention (which spreads a fully masked row evenly over every key instead).

``causal_right_padding``: a right-padded training batch with ignored padding labels runs as plain
causal attention (no mask) with the same loss and gradients as the masked run; every other batch
keeps its mask. ``padding_free``: where the model allows it, such a batch runs its real tokens only
(the attention pads them again): the same loss and gradients as unpatched transformers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

import surgery
from surgery.attention.forward import lean_eager_attention, shared_sdpa_mask
from surgery.forwards.causal_lm import STATE_ATTR
from tests.models.tiny import (
    ARCHS,
    SPECS,
    attn_for,
    causal_lm_from_config,
    left_padded_batch,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
)
from tests.surgery.test_recompute import kept_bytes
from tests.surgery.unpatched import (
    VARIANTS,
    patch_options,
    patched_step,
    unpatched_step,
    variant_batch,
)
from tests.utils import FP32_CLOSE, TOLERANCES, OpCount, assert_close_budget, rel_err

LENGTHS = [9, 6, 3]
OFF = {"share_attention_mask": False}
# The masked path, for the shared-mask tests (a right-padded batch would otherwise run unmasked).
MASKED = {"causal_right_padding": False}


@pytest.fixture
def sdpa_masks(monkeypatch):
    """Every attn_mask that reaches F.scaled_dot_product_attention, in call order."""
    seen: list[torch.Tensor | None] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        assert mask is not None or kwargs.get("is_causal"), "neither a mask nor is_causal"
        seen.append(mask)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def batch_of(kind):
    if kind == "left":
        return left_padded()
    seqs = sequences(LENGTHS)
    return (packed_batch(seqs) if kind == "packed" else padded_batch(seqs)).kwargs()


CASES = [
    (arch, dtype, kind)
    for arch in ("llama", "qwen3", "gemma3_text")
    for dtype in (torch.float32, torch.bfloat16)
    for kind in ("padded", "packed", "left")
]


@pytest.mark.parametrize(
    ("arch", "dtype", "kind"),
    CASES,
    ids=[f"{a}-{str(d).removeprefix('torch.')}-{k}" for a, d, k in CASES],
)
def test_same_loss_and_grads_as_boolean_mask(arch, dtype, kind, sdpa_masks):
    model = tiny_model(arch, dtype=dtype).train()
    reference = twin(model)
    surgery.patch(model, **MASKED)
    surgery.patch(reference, **OFF, **MASKED)
    batch = batch_of(kind)
    loss, grads = loss_and_grads(model, **batch)
    shared = list(sdpa_masks)
    sdpa_masks.clear()
    want_loss, want_grads = loss_and_grads(reference, **batch)
    assert torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name
    # The patched model really ran on the additive mask, the reference on transformers' boolean.
    layers = tiny_config(arch).num_hidden_layers
    assert len(shared) == len(sdpa_masks) == layers
    assert all(m is not None and m.dtype == dtype for m in shared)
    assert all(m is not None and m.dtype == torch.bool for m in sdpa_masks)


def test_one_tensor_for_all_layers_and_freed_with_the_graph(sdpa_masks):
    model = surgery.patch(tiny_model("llama").train(), **MASKED)
    out = model(**batch_of("padded"))
    storages = {m.untyped_storage().data_ptr() for m in sdpa_masks}
    assert len(sdpa_masks) == tiny_config("llama").num_hidden_layers and len(storages) == 1
    ref = weakref.ref(sdpa_masks[0])
    sdpa_masks.clear()
    out.loss.backward()
    del out
    gc.collect()
    assert ref() is None, "the shared mask outlived the forward's graph"


def test_alternating_masks_each_converted_once(sdpa_masks):
    # Gemma 3 alternates sliding-window and full-attention layers: two boolean masks per forward,
    # so two additive ones, each shared by the layers of its kind.
    config = tiny_config("gemma3_text")
    config.num_hidden_layers = 4
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    surgery.patch(model, **MASKED)
    model.train()(**batch_of("padded")).loss.backward()
    ptrs = [m.untyped_storage().data_ptr() for m in sdpa_masks]
    assert len(ptrs) == 4 and ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]


def test_helper_values_and_pass_through():
    # Row 0 attends to key 0 only, row 1 to both keys, row 2 to none.
    mask = torch.tensor([[True, False], [True, True], [False, False]])[None, None]
    shared = shared_sdpa_mask(mask, torch.bfloat16)
    assert shared.additive.dtype == torch.bfloat16
    low = torch.finfo(torch.bfloat16).min
    want = torch.tensor([[0.0, low], [0.0, 0.0], [low, low]]).bfloat16()
    assert torch.equal(shared.additive[0, 0], want)
    assert torch.equal(shared.unattended, torch.tensor([[[False], [False], [True]]]))
    assert shared_sdpa_mask(mask, torch.bfloat16) is shared  # cached on the mask
    assert shared_sdpa_mask(mask, torch.float32).additive.dtype == torch.float32  # dtype change
    refilled = shared_sdpa_mask(mask, torch.float32)
    mask[0, 0, 2, 1] = True  # refilled in place: built anew
    again = shared_sdpa_mask(mask, torch.float32)
    assert again is not refilled and again.additive[0, 0, 2, 1] == 0 and not again.unattended.any()
    per_head = torch.ones(1, 2, 2, 2, dtype=torch.bool)
    for other in (None, torch.zeros(1, 1, 2, 2), torch.ones(2, 2, dtype=torch.bool), per_head):
        assert shared_sdpa_mask(other, torch.float32) is None


def test_option_is_validated():
    with pytest.raises(TypeError, match="share_attention_mask"):
        surgery.patch(tiny_model("llama"), share_attention_mask="yes")


# ---------------------------------------------------------------------------------------------
# causal_right_padding


def test_right_padding_verdict_and_layout():
    from surgery.attention.unpadding import Rolled, padded_layout

    def verdict(mask, labels, ignore_index=-100):
        return padded_layout(mask, labels, ignore_index, unpad=False)[0]

    labels = torch.tensor([[5, 6, 7, -100], [5, 6, -100, -100]])
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert verdict(right, labels)
    assert verdict(right.bool(), labels)
    assert verdict(torch.ones(2, 4), labels)  # no padding at all
    assert not verdict(right, labels.masked_fill(labels == -100, 0))
    assert not verdict(right, labels, 0)  # another ignore_index
    assert not verdict(right.flip(1), labels.flip(1))  # left padding
    holes = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    assert not verdict(holes, labels.masked_fill(holes == 0, -100))
    assert not verdict(right[:, :3], labels)  # shapes differ
    assert not verdict(torch.ones(2, 1, 4, 4), labels)  # a 4-D mask

    ok, layout, padding = padded_layout(right, labels, -100, unpad=True)
    assert ok and padding and layout.batch == 2 and layout.seq == 4
    assert layout.index.tolist() == [0, 1, 2, 4, 5]
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert layout.take(labels).tolist() == [[5, 6, 7, 5, 6]]
    assert padded_layout(torch.ones(2, 4), labels, -100, unpad=True) == (True, None, False)
    assert padded_layout(torch.ones(2, 4), labels, -100, unpad=False) == (True, None, False)
    ok, rolled, padding = padded_layout(right.flip(1), labels.flip(1), -100, unpad=True)
    assert not ok and padding and isinstance(rolled, Rolled)  # left padding runs rolled
    assert padded_layout(right.flip(1), labels.flip(1), -100, unpad=False) == (False, None, True)
    assert padded_layout(holes, labels, -100, unpad=True) == (False, None, True)
    assert padded_layout(right, labels, -100, unpad=False) == (True, None, True)
    # pad puts (1, H, T, D) rows back at their places, zeros elsewhere; take takes them again
    rows = torch.arange(1.0, 6.0).view(1, 1, 5, 1)
    padded = layout.pad(rows)
    assert padded.shape == (2, 1, 4, 1)
    assert padded[:, 0, :, 0].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert torch.equal(layout.take(padded.transpose(1, 2)), rows.transpose(1, 2))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_right_padding_runs_causal_with_the_same_loss_and_grads(arch, sdpa_masks):
    model = surgery.patch(tiny_model(arch).train())
    masked = surgery.patch(twin(model), **MASKED)
    batch = batch_of("padded")
    loss, grads = loss_and_grads(model, **batch)
    unmasked_calls = sum(m is None for m in sdpa_masks)
    sdpa_masks.clear()
    want_loss, want_grads = loss_and_grads(masked, **batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    # Full-attention layers ran without a mask (sliding-window layers keep their window mask).
    full_layers = sum(
        t == "full_attention"
        for t in getattr(model.config, "layer_types", None)
        or ["full_attention"] * model.config.num_hidden_layers
    )
    assert unmasked_calls >= min(1, full_layers) and not any(m is None for m in sdpa_masks)


def _base_model_host_reads(model, **batch) -> int:
    """How many times the base model (``model.model``) read a tensor on the host in one training
    forward (``aten._local_scalar_dense``: ``bool``, ``item``; transformers' mask builder)."""
    reads = OpCount({"_local_scalar_dense"})
    reads.active = False
    pre = model.model.register_forward_pre_hook(lambda *_: setattr(reads, "active", True))
    post = model.model.register_forward_hook(lambda *_: setattr(reads, "active", False))
    try:
        with reads:
            model(**batch)
    finally:
        pre.remove()
        post.remove()
    return reads.count


ONES_ARCHS = [a for a in ARCHS if attn_for(a) == "sdpa"]


@pytest.mark.parametrize("use_cache", [None, False])
@pytest.mark.parametrize("arch", ONES_ARCHS)
def test_mask_of_ones_costs_the_base_model_no_more_host_reads(arch, use_cache):
    """A training batch (sdpa) whose attention mask is all ones: surgery has read it once (its
    verdict: no padding) before the base model runs; inside, transformers reads no more than it
    does for the unpatched model, and nothing where the step makes a KV cache (the mask of ones
    then goes as no mask: transformers checks a missing mask's positions for packing only
    without a cache). The loss and every gradient equal the masked run's bit for bit."""
    model = tiny_model(arch).train()
    reference = twin(model)
    surgery.patch(model)
    masked = surgery.patch(twin(reference), **MASKED)  # the mask handed on as it is
    batch = batch_of("padded")
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["labels"] = batch["input_ids"].clone()
    batch["use_cache"] = use_cache
    reads = _base_model_host_reads(model, **batch)
    assert reads <= _base_model_host_reads(reference, **batch)
    makes_cache = use_cache is not False and model.config.use_cache
    if makes_cache:
        assert reads == 0
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(masked, **batch)
    assert torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


def _left_padded():
    batch = batch_of("padded")
    return {k: v.flip(1) for k, v in batch.items()}


def _labelled_padding():
    batch = batch_of("padded")
    batch["labels"] = batch["input_ids"].clone()
    return batch


def _with_position_ids():
    batch = batch_of("padded")
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None].expand(3, -1)
    return batch


KEEPS_MASK = {
    # Left padding runs rolled and unmasked where the padding-free layout may run (below).
    "left-padding-option-off": (_left_padded, {"padding_free": False}, {}, True),
    "labels-on-padding": (_labelled_padding, {}, {}, True),
    "position-ids": (_with_position_ids, {}, {}, True),
    "eval": (lambda: batch_of("padded"), {}, {}, False),
    "return-logits": (lambda: batch_of("padded"), {"return_logits": True}, {}, True),
    "hidden-states": (lambda: batch_of("padded"), {}, {"output_hidden_states": True}, True),
    "option-off": (lambda: batch_of("padded"), MASKED, {}, True),
}


@pytest.mark.parametrize("case", list(KEEPS_MASK))
def test_mask_kept_unless_dropping_is_exact(case, sdpa_masks):
    make_batch, options, call_kwargs, training = KEEPS_MASK[case]
    model = surgery.patch(tiny_model("llama").train(training), **options)
    out = model(**make_batch(), **call_kwargs)
    assert torch.isfinite(out.loss)
    assert sdpa_masks and all(m is not None for m in sdpa_masks), case


# ---------------------------------------------------------------------------------------------
# Left padding: query rows that attend to no key


LEFT_LENGTHS = [9, 5, 2]  # 0, 4 and 7 pad positions


def left_padded(lengths=LEFT_LENGTHS) -> dict:
    return left_padded_batch(sequences(lengths)).kwargs()


LEFT_CASES = [(arch, "sdpa") for arch in ARCHS] + [("llama", "eager"), ("qwen3", "eager")]


@pytest.mark.parametrize(
    ("arch", "attn"), LEFT_CASES, ids=[f"{a}-{attn_for(a, i)}" for a, i in LEFT_CASES]
)
def test_left_padding_same_loss_and_grads_as_transformers(arch, attn):
    """Patched (every option at its default) against unpatched transformers, fp32: sdpa gives a
    row that attends to nothing zeros and eager spreads it evenly over every key, and the patched
    model does what the model's own attention does, including the trained prediction of each
    row's first real token from its last pad position."""
    model = tiny_model(arch, attn=attn).train()
    reference = twin(model)
    surgery.patch(model)
    batch = left_padded()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(loss, want_loss, rtol=tol["rtol"], atol=0.0)
    # Each gradient within rtol of its own size, or, where cancellation leaves a gradient far
    # smaller than the model's largest (Qwen3.5's dt_bias: 1e-5; fp32 rounding upstream moves it
    # by 2e-10, 1.6e-5 of itself), every element within rtol of that largest gradient element.
    largest = max(g.abs().max() for g in want_grads.values())
    for name, g in want_grads.items():
        close = rel_err(grads[name], g) < tol["rtol"]
        assert close or (grads[name] - g).abs().max() <= tol["rtol"] * largest, name


def test_left_padding_keeps_one_mask_and_nothing_per_layer():
    """The unattended rows cost one (batch, seq) bool tensor per forward, nothing per layer: the
    shared mask keeps one additive mask where sdpa keeps its own copy in every layer (the masked
    path: with ``padding_free`` the batch runs rolled, without a mask)."""
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    batch = left_padded()
    B, T = batch["input_ids"].shape
    kept = {}
    for share in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
        patched = surgery.patch(model, share_attention_mask=share, padding_free=False)
        kept[share] = kept_bytes(patched, batch)
    mask_bytes = B * T * T * 4  # (B, 1, T, T) fp32
    assert kept[False] - kept[True] == (config.num_hidden_layers - 1) * mask_bytes - B * T


def test_left_padding_layout_rolls_each_row_real_tokens_first():
    from surgery.attention.unpadding import padded_layout

    def left_padding(mask):
        labels = torch.zeros(mask.shape[0], mask.shape[-1], dtype=torch.long)  # every one trained
        ok, layout, _ = padded_layout(mask, labels, -100, unpad=True)
        assert not ok
        return layout

    left = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    rolled = left_padding(left)
    assert rolled.order.tolist() == [[2, 3, 0, 1], [1, 2, 3, 0], [0, 1, 2, 3]]
    assert rolled.positions is rolled.order  # the columns: transformers' positions
    assert rolled.unattended[..., 0].tolist() == [
        [False, False, True, True],
        [False, False, False, True],
        [False, False, False, False],
    ]
    x = torch.arange(12).view(3, 4)
    assert rolled.take(x).tolist() == [[2, 3, 0, 1], [5, 6, 7, 4], [8, 9, 10, 11]]
    assert torch.equal(rolled.restore((rolled.take(x),))[0], x)
    assert torch.equal(rolled.restore((rolled.take(x).reshape(12, 1),))[0], x.reshape(12, 1))
    assert left_padding(left.flip(1)) is None  # right padding (its padding trained)
    no_padding = padded_layout(torch.ones(2, 4), torch.zeros(2, 4), -100, unpad=True)
    assert no_padding == (True, None, False)
    assert left_padding(torch.tensor([[0, 1, 0, 1]])) is None  # a hole
    assert left_padding(torch.ones(2, 1, 4, 4)) is None  # a 4-D mask


def test_batch_layouts_move_with_accelerates_hooks():
    """accelerate's device-map hooks move a layer's inputs with ``send_to_device``, which calls
    ``to`` on any object that has one: every layout the attention layers take moves with them
    (nested ones too), but for the tensors kept on the host on purpose; where nothing moves, the
    same object comes back. (End to end on two GPUs: tests/surgery/test_device_map_gpu.py.)"""
    from accelerate.utils import send_to_device

    from surgery.attention.linear import Documents
    from surgery.attention.unpadding import padded_layout
    from surgery.attention.varlen import PackedSequences

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    labels = mask.masked_fill(mask == 0, -100)
    unpadded = padded_layout(mask, labels, -100, unpad=True).layout
    rolled = padded_layout(mask.flip(1), labels.flip(1), -100, unpad=True).layout
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    packed = PackedSequences(cu, 3, print, PackedSequences(cu.clone(), 2, print))
    documents = Documents(cu.long(), cu.long(), torch.arange(5))
    for layout in (unpadded, rolled, packed, documents):
        moved = send_to_device(layout, "meta")
        assert type(moved) is type(layout) and layout.to("cpu") is layout
        for field in dataclasses.fields(layout):
            value, got = getattr(layout, field.name), getattr(moved, field.name)
            if isinstance(value, torch.Tensor):
                host = field.name == "cu_seqlens_cpu"
                assert got.device.type == ("cpu" if host else "meta"), field.name
            elif field.name != "chunks":
                assert got == value, field.name
    assert send_to_device(packed, "meta").chunks.cu_seqlens.device.type == "meta"


@pytest.mark.gpu
def test_gpu_padded_layout_reads_the_host_once():
    """A right-padded (padding untrained) or left-padded batch's layout costs one device-to-host
    read on the GPU (CUDA's sync debug mode counts them): the verdicts and the row counts
    together, not a read per verdict."""
    from surgery.attention.unpadding import Rolled, Unpadded, padded_layout

    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], device="cuda")
    labels = torch.tensor([[5, 6, 7, -100], [5, 6, -100, -100]], device="cuda")
    for mask, targets, kind in ((right, labels, Unpadded), (right.flip(1), labels, Rolled)):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning, match="synchroniz") as caught:
                layout = padded_layout(mask, targets, -100, unpad=True).layout
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(layout, kind)
        assert sum("synchroniz" in str(w.message) for w in caught) == 1


# The tiny Qwen3s have sliding-window layers, which keep the padded layout: here without them.
FULL_ATTENTION = {"use_sliding_window": False, "sliding_window": None, "layer_types": None}
ROLLED_CASES = {"llama": {}, "gemma": {}, "qwen3": FULL_ATTENTION, "qwen3_moe": FULL_ATTENTION}


@pytest.mark.parametrize("arch", list(ROLLED_CASES))
def test_left_padding_runs_rolled_unmasked_as_transformers_trains_it(arch, sdpa_masks):
    """A left-padded training step (every option at its default) runs each row rolled, its real
    tokens first, through sdpa without a mask in every layer, and gives transformers' loss, every
    gradient (fp32) and, for a MoE, its router logits in the caller's order: the padding's
    queries, which see no key under the caller's mask, and the last padding position's trained
    prediction of its row's first real token included."""
    model = tiny_model(arch, **ROLLED_CASES[arch]).train()
    reference = twin(model)
    surgery.patch(model)
    batch = left_padded()
    router = {"output_router_logits": True} if SPECS[arch].router_aux_loss else {}
    out = model(**batch, **router)
    out.loss.backward()
    assert sdpa_masks and all(m is None for m in sdpa_masks)
    want = reference(**batch, **router)
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, **FP32_CLOSE)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **FP32_CLOSE, msg=name)
    if router:
        for got, ref in zip(out.router_logits, want.router_logits, strict=True):
            torch.testing.assert_close(got, ref, **FP32_CLOSE)


def _rolled_variant(kind: str, batch: dict, model) -> dict:
    if kind == "inputs_embeds":
        ids = batch.pop("input_ids")
        batch = {**batch, "inputs_embeds": model.get_input_embeddings()(ids)}
    elif kind == "shift_labels":  # pre-shifted, as TRL passes them under context parallelism
        labels = batch.pop("labels")
        shift = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], -100)), dim=1)
        batch = {**batch, "labels": labels, "shift_labels": shift}
    return batch


ROLLED_VARIANTS = {
    "inputs_embeds": {},
    "shift_labels": {},
    "sequence_mean_and_z_loss": {"loss_reduction": "sequence", "z_loss_scale": 1e-3},
}


@pytest.mark.parametrize("kind", list(ROLLED_VARIANTS))
def test_left_padding_rolled_equals_the_masked_path(kind, sdpa_masks):
    """The rolled step against the same model on the masked path (``padding_free=False``, itself
    held to transformers above): embeddings given instead of ids, pre-shifted labels, and
    surgery's own loss options (a per-sequence mean, z-loss trained and returned)."""
    options = ROLLED_VARIANTS[kind]
    model = surgery.patch(tiny_model("llama").train(), **options)
    masked = surgery.patch(twin(model), padding_free=False, **options)
    batch = _rolled_variant(kind, left_padded(), model)
    out = model(**batch)
    out.loss.backward()
    assert sdpa_masks and all(m is None for m in sdpa_masks)
    want = masked(**_rolled_variant(kind, left_padded(), masked))
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, **FP32_CLOSE)
    if options.get("z_loss_scale"):
        torch.testing.assert_close(out.z_loss, want.z_loss, **FP32_CLOSE)
    for (name, p), q in zip(model.named_parameters(), masked.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **FP32_CLOSE, msg=name)


def _attention_layer(bias: bool, share: bool, device="cpu", dtype=torch.float32):
    config = tiny_config("llama")
    config.attention_bias = bias  # q, k, v and o_proj biases
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    surgery.patch(model.to(device, dtype), share_attention_mask=share)
    return model.model.layers[0].self_attn


def _left_padded_4d(T: int, pads: list[int]) -> torch.Tensor:
    real = torch.arange(T)[None, :] >= torch.tensor(pads)[:, None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return causal[None, None] & real[:, None, None, :]  # what transformers builds for sdpa


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "o_proj-bias"])
def test_unattended_rows_as_sdpa_boolean_mask(bias):
    """One attention layer on a boolean mask with fully masked query rows: with the shared
    additive mask, the output and every gradient are sdpa's on the boolean mask, bit for bit
    (o_proj's bias gradient: the same terms summed in another order). The fully masked rows give
    what o_proj gives a zero row, and the query, key and value of a pad position get no
    gradient."""
    pads = [0, 4, 7]
    B, T = len(pads), 9
    mask = _left_padded_4d(T, pads)
    assert not mask[1, 0, :4].any() and mask[1, 0, 4:].any(-1).all()
    hidden = torch.randn(B, T, tiny_config("llama").hidden_size)
    grad_out = torch.randn_like(hidden)
    position_ids = torch.arange(T)[None].expand(B, -1)
    results = {}
    for share in (False, True):
        attn = _attention_layer(bias, share)
        x = hidden.clone().requires_grad_()
        out, _ = attn(x, attention_mask=mask.clone(), position_ids=position_ids)
        out.backward(grad_out)
        grads = {n: p.grad for n, p in attn.named_parameters()}
        results[share] = (out.detach(), x.grad, grads, attn.o_proj.bias)
    (out, dx, grads, o_bias), (want_out, want_dx, want_grads, _) = results[True], results[False]
    assert torch.equal(out, want_out)
    assert torch.equal(dx, want_dx)
    for name, g in want_grads.items():
        if name == "o_proj.bias":
            # The same B*T terms summed in another order: any two orders of an fp32 sum are
            # within (terms - 1) roundings of the sum of their magnitudes (an element whose
            # terms cancel can differ by far more than its own size times fp32's eps).
            terms = grad_out.reshape(-1, grad_out.shape[-1])
            bound = terms.shape[0] * torch.finfo(torch.float32).eps * terms.abs().sum(0)
            assert ((grads[name] - g).abs() <= bound).all(), name
        else:
            assert torch.equal(grads[name], g), name
    for row, pad in enumerate(pads):
        zero_row = torch.zeros(pad, out.shape[-1]) if o_bias is None else o_bias.expand(pad, -1)
        assert torch.equal(out[row, :pad], zero_row.detach())
        assert not dx[row, :pad].any()  # no gradient through q, k or v of a pad position


def test_lean_eager_matches_transformers_eager_on_unattended_rows():
    """transformers' eager attention gives a fully masked row (the lowest finite value on every
    key) an even spread over every key: the mean of the values. ``lean_eager_attention`` gives
    the same, bit for bit, forward and backward, with and without a softcap."""
    module = surgery.patch(tiny_model("llama", attn="eager")).model.layers[0].self_attn
    pads = [0, 4, 7]
    B, T, D = len(pads), 9, module.head_dim
    mask = _left_padded_4d(T, pads)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 4, T, D, generator=g)
    k, v = (torch.randn(B, 2, T, D, generator=g) for _ in range(2))
    grad_out = torch.randn(B, T, 4, D, generator=g)
    # Llama's eager function has no softcap; Gemma 2's applies one.
    for transformers_eager, softcap in ((llama_eager, None), (gemma2_eager, 5.0)):
        results = []
        lean = functools.partial(lean_eager_attention, eager=transformers_eager)
        for fn in (transformers_eager, lean):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            extra = {} if softcap is None else {"softcap": softcap}
            out, _ = fn(module, *leaves, additive, scaling=D**-0.5, **extra)
            out.backward(grad_out)
            results.append((out.detach(), *(t.grad for t in leaves)))
        for got, want in zip(results[1], results[0], strict=True):
            assert torch.equal(got, want), softcap
        values_mean = v[2].mean(dim=1).repeat_interleave(2, dim=0)  # (heads, D), GQA groups of 2
        torch.testing.assert_close(results[1][0][2, :7], values_mean.expand(7, -1, -1))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_left_padding_lean_eager_bitwise(arch):
    model = tiny_model(arch, attn="eager").train()
    reference = surgery.patch(twin(model), eager_attention_recompute=False)
    surgery.patch(model)
    batch = left_padded()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    assert torch.equal(loss, want_loss)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


# sdpa's backends, forced one at a time on the GPU. The fp32 references run on the default choice
# (memory-efficient for fp32), which gives a fully masked row zeros.
BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def _on_backend(name: str):
    return contextlib.nullcontext() if BACKENDS[name] is None else sdpa_kernel(BACKENDS[name])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "efficient", "math"])
def test_unattended_rows_on_every_sdpa_backend(backend):
    """On the GPU, in bf16, each masked sdpa backend forced: the shared mask's fully masked rows
    give exactly o_proj's zero row and no gradient to any pad position, and every other row is
    the boolean mask's, bit for bit. (torch <= 2.11 hands cuDNN a boolean mask with -65504 for
    False, so that on the boolean mask a fully masked row attends to every key there: only the
    other rows are compared on cuDNN.)"""
    pads = [0, 100, 300]
    B, T = len(pads), 512
    mask = _left_padded_4d(T, pads).cuda()
    hidden = torch.randn(B, T, tiny_config("llama").hidden_size, device="cuda").bfloat16()
    position_ids = torch.arange(T, device="cuda")[None].expand(B, -1)
    results = {}
    with _on_backend(backend):
        for share in (False, True):
            attn = _attention_layer(False, share, "cuda", torch.bfloat16)
            x = hidden.clone().requires_grad_()
            out, _ = attn(x, attention_mask=mask.clone(), position_ids=position_ids)
            out.backward(torch.ones_like(out))
            results[share] = (out.detach(), x.grad)
    (out, dx), (want_out, want_dx) = results[True], results[False]
    attends = mask.any(-1).transpose(1, 2).expand_as(out)
    assert torch.equal(out[attends], want_out[attends])
    assert not out[~attends].any()
    assert not dx[~attends].any()  # pad positions: every query row there is fully masked
    if backend != "cudnn":
        assert torch.equal(dx, want_dx)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "efficient", "math"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_left_padding_bf16_within_the_boolean_mask_budget(arch, backend):
    """On the GPU: a left-padded bf16 step on the shared mask against unpatched fp32 transformers.
    Its error (loss, and the concatenated gradient of every parameter) may exceed the error of the
    same patched step on the boolean mask (``share_attention_mask=False``, same backend) by the
    bf16 budget's factor, and by none of its floor: the floor (2e-3) is larger than what a wrong
    value in the fully masked rows costs the loss, and the two steps differ only in the mask's
    form. (On sm90 the default masked backend is cuDNN, where the boolean mask's error is the
    larger: see ``test_unattended_rows_on_every_sdpa_backend``.)"""
    config = tiny_config(arch)
    config.update(dict(vocab_size=32_000, hidden_size=128, intermediate_size=256,
                       sliding_window=64, max_position_embeddings=1024))  # fmt: skip
    torch.manual_seed(0)
    fp32 = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().train()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    batch = {k: v.cuda() for k, v in left_padded([512, 401, 150]).items()}

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        return out.loss.detach().float(), grads

    reference = step(fp32)
    with _on_backend(backend):
        # padding_free=False: the mask's two forms (left padding runs rolled, unmasked, otherwise)
        boolean = step(
            surgery.patch(copy.deepcopy(bf16), share_attention_mask=False, padding_free=False)
        )
        shared = step(surgery.patch(bf16, padding_free=False))
    factor = TOLERANCES[torch.bfloat16]["factor"]
    for what, got, on_boolean, want in zip(("loss", "grads"), shared, boolean, reference):
        err, budget = rel_err(got, want), factor * rel_err(on_boolean, want)
        assert err <= budget, f"{arch} {what}: rel err {err:.3e} > {budget:.3e}"


# ---------------------------------------------------------------------------------------------
# padding_free


def base_model_rows(model) -> list[tuple[int, ...]]:
    """The (batch, seq) shape of every base-model call of ``model``, in order, also compiled (a
    closure: torch 2.11's dynamo dropped appends to a list bound as a hook's default argument)."""
    seen: list[tuple[int, ...]] = []

    def hook(module, args, kwargs):
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        seen.append(tuple(tokens.shape[:2]))

    model.model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


# The tiny configs give most architectures sliding-window layers (which keep the padded batch);
# these architectures are also built without them, where every layer allows the padding-free step.
UNWINDOWED = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma"]
FREE_CASES = [(a, True) for a in ARCHS] + [(a, False) for a in UNWINDOWED]


def windowless(arch: str):
    torch.manual_seed(0)
    config = tiny_config(arch, sliding_window=None, layer_types=None, use_sliding_window=False)
    return causal_lm_from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize(
    ("arch", "windows"),
    FREE_CASES,
    ids=[f"{a}-{'tiny' if w else 'windowless'}" for a, w in FREE_CASES],
)
def test_padding_free_same_loss_and_grads_as_transformers(arch, windows):
    """Patched (every option at its default) against unpatched transformers with the mask, fp32,
    on a right-padded batch: where the model allows it the base model runs the real tokens alone
    (one row of 18 instead of 3 x 9), with the same loss (a MoE's load-balancing loss included)
    and gradients, and a MoE's router logits in the caller's layout (batch * seq rows, those of
    the real tokens transformers', the padding's zero: its tokens never ran); elsewhere it runs
    the padded batch."""
    model = (tiny_model(arch) if windows else windowless(arch)).train()
    reference = twin(model)
    surgery.patch(model)
    free = model.__dict__[STATE_ATTR].padding_free
    assert free or windows  # every windowless one is padding-free
    rows = base_model_rows(model)
    batch = batch_of("padded")
    router = SPECS[arch].router_aux_loss
    extra = {"output_router_logits": True} if router else {}
    out = model(**batch, **extra)
    out.loss.backward()
    want = reference(**batch, **extra)
    want.loss.backward()
    assert rows == ([(1, sum(LENGTHS))] if free else [(len(LENGTHS), max(LENGTHS))])
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.loss, want.loss, rtol=tol["rtol"], atol=tol["atol"])
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=tol["rtol"], atol=tol["atol"], msg=name)
    if router:
        real = batch["attention_mask"].reshape(-1).bool()
        for got, ref in zip(out.router_logits, want.router_logits, strict=True):
            assert got.shape == ref.shape
            torch.testing.assert_close(got[real], ref[real], rtol=tol["rtol"], atol=tol["atol"])
            if free:
                assert not got[~real].any()


def test_padding_free_off_where_the_layers_read_the_layout():
    """Off for sliding windows (the tiny Qwen3's), Gemma 3's per-layer-type RoPE, latent
    attention (Mistral 4), chunked attention (Llama 4), linear attention (Qwen3.5), and where
    the option or what it rests on is switched off."""

    def free(model, **options):
        return surgery.patch(model, **options).__dict__[STATE_ATTR].padding_free

    assert free(windowless("qwen3"))
    assert not free(tiny_model("qwen3"))
    for arch in ("gemma3_text", "mistral4", "llama4_text", "qwen3_5_text"):
        assert not free(tiny_model(arch)), arch
    assert not free(tiny_model("llama"), padding_free=False)
    assert not free(tiny_model("llama"), causal_right_padding=False)
    assert not free(tiny_model("llama"), rope=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_free_variants_same_as_transformers(variant):
    """The loss options and inputs that reach the padding-free step (the per-sequence mean,
    transformers' shifted labels, input embeddings, z-loss, ``num_items_in_batch``): patched, the
    base model running the real tokens alone, against unpatched transformers with the mask on
    the same right-padded batch (its own loss, or the option's by definition from its logits:
    ``tests.surgery.unpatched``), loss and gradients within fp32's tolerance."""
    model = tiny_model("llama").train()
    reference = twin(model)
    surgery.patch(model, **patch_options(variant))
    rows = base_model_rows(model)
    batch = variant_batch(batch_of("padded"), variant)
    loss, grads = patched_step(model, batch, variant)
    want_loss, want_grads = unpatched_step(reference, batch, variant)
    assert rows == [(1, sum(LENGTHS))]
    torch.testing.assert_close(loss, want_loss, **FP32_CLOSE)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, **FP32_CLOSE, msg=name)


def sdpa_query_lengths(monkeypatch) -> list[int]:
    """The query length of every ``F.scaled_dot_product_attention`` call from then on."""
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        seen.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "padded"])
def test_padding_free_attention_per_row_or_padded(arch, per_row, monkeypatch):
    """The padding-free attention over a batch of up to ``ROW_CALLS_MAX`` rows runs one sdpa call
    per row that has real tokens, on those tokens alone (a row of padding only gets none); over
    more rows (here the bound set to 1), one call per layer on the padded (batch, seq) layout.
    Both give unpatched transformers' loss and gradients (fp32, with the mask)."""
    import surgery.attention.unpadding as unpadding

    if not per_row:
        monkeypatch.setattr(unpadding, "ROW_CALLS_MAX", 1)
    model = windowless(arch).train()
    reference = twin(model)
    surgery.patch(model)
    lengths = [*LENGTHS, 0]  # and a row of padding only
    batch = batch_of("padded")
    pad = torch.zeros_like(batch["input_ids"][:1])
    batch = {
        "input_ids": torch.cat([batch["input_ids"], pad]),
        "attention_mask": torch.cat([batch["attention_mask"], pad]),
        "labels": torch.cat([batch["labels"], pad - 100]),
    }
    extra = {"output_router_logits": True} if SPECS[arch].router_aux_loss else {}
    rows = base_model_rows(model)
    calls = sdpa_query_lengths(monkeypatch)
    loss, grads = loss_and_grads(model, **batch, **extra)
    layers = model.config.num_hidden_layers
    assert rows == [(1, sum(lengths))]
    assert calls == (LENGTHS * layers if per_row else [max(LENGTHS)] * layers)
    want_loss, want_grads = unpatched_step(reference, batch, **extra)
    torch.testing.assert_close(loss, want_loss, **FP32_CLOSE)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, **FP32_CLOSE, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["padded", "left"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_padding_free_per_row_within_budget(compiled, kind):
    """On the GPU machine, bf16 (sdpa's CUDA kernels): the padding-free Llama step, its attention
    one call a row (compiled too, graph breaks allowed), within bf16's budget of the unpatched
    fp32 step with the mask, where the padded step (``padding_free=False``) is; a left-padded
    batch likewise, its rows rolled (one unmasked causal call over the batch)."""
    from surgery.attention.unpadding import ROLLED_KWARG

    fp32 = windowless("llama").cuda().train()
    batch = {name: t.cuda() for name, t in batch_of(kind).items()}
    want = loss_and_grads(fp32, **batch)
    per_row = surgery.patch(twin(fp32).to(torch.bfloat16))
    padded = surgery.patch(twin(fp32).to(torch.bfloat16), padding_free=False)
    if compiled:
        torch._dynamo.reset()
        per_row.compile()
    rows = base_model_rows(per_row)
    rolled = []
    per_row.model.register_forward_pre_hook(
        lambda module, args, kwargs: rolled.append(ROLLED_KWARG in kwargs), with_kwargs=True
    )
    got = loss_and_grads(per_row, **batch)
    if kind == "padded":
        assert rows == [(1, sum(LENGTHS))]
    else:
        assert rows == [tuple(batch["input_ids"].shape)] and rolled == [True]
    eager = loss_and_grads(padded, **batch)
    assert_close_budget(got[0], want[0], eager[0], torch.bfloat16, what="loss")
    for name, g in want[1].items():
        assert_close_budget(got[1][name], g, eager[1][name], torch.bfloat16, what=name)
