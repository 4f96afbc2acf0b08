"""Recomputed activations (``recompute_mlp_product``, ``recompute_norm_output``): the same loss and
gradients, bit for bit, as keeping them, with activation checkpointing and LoRA; and the bytes that
autograd keeps per layer drop by the MLP product and two norm outputs."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import surgery
from surgery.forwards import head as surgery_head
from surgery.forwards import recompute
from tests.models.tiny import (
    ARCHS,
    HIDDEN,
    loss_and_grads,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
)
from tests.utils import MatrixProducts, enable_activation_checkpointing

peft = pytest.importorskip("peft")

KEEP = {"recompute_mlp_product": False, "recompute_norm_output": False}
LENGTHS = [7, 5, 3]


def assert_bitwise(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        assert torch.equal(grads[name], want_grads[name]), name


def checkpointing(model, mode: str):
    if mode != "none":
        enable_activation_checkpointing(model, use_reentrant=mode == "reentrant")
    return model


# Every architecture in fp32 and bf16, and fp32 under both kinds of activation checkpointing
# (non-reentrant: its own saved-tensor hooks, ours stand aside; reentrant: ours run in the
# recomputation).
BITWISE_CASES = [
    (arch, dtype, ckpt)
    for arch in ("llama", "qwen3", "gemma2")
    for dtype, ckpt in (
        (torch.float32, "none"),
        (torch.bfloat16, "none"),
        (torch.float32, "non-reentrant"),
        (torch.float32, "reentrant"),
    )
]


@pytest.mark.parametrize(
    ("arch", "dtype", "ckpt"),
    BITWISE_CASES,
    ids=[f"{a}-{str(d).removeprefix('torch.')}-{c}" for a, d, c in BITWISE_CASES],
)
def test_recompute_is_bitwise_identical(arch, dtype, ckpt):
    model = tiny_model(arch, dtype=dtype).train()
    reference = twin(model)
    checkpointing(surgery.patch(model), ckpt)
    checkpointing(surgery.patch(reference, **KEEP), ckpt)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    assert_bitwise(loss_and_grads(model, **batch), loss_and_grads(reference, **batch))


def lora_model(model, targets):
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    )
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return wrapped


LORA_TARGETS = [["down_proj"], ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]]


@pytest.mark.parametrize("targets", LORA_TARGETS, ids=["down", "qv-gate-up-down"])
def test_recompute_with_lora_is_bitwise_identical(targets):
    model = tiny_model("llama").train()
    reference = twin(model)
    model = lora_model(surgery.patch(model), targets)
    reference = lora_model(surgery.patch(reference, **KEEP), targets)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    assert_bitwise(loss_and_grads(model, **batch), loss_and_grads(reference, **batch))


class _KeptStorages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                self.storages.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out


def kept_bytes(model, batch) -> int:
    """Bytes of the tensors made in one forward that are still alive while only the loss is
    referenced: what autograd keeps for the backward (parameters excluded)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    mode = _KeptStorages()
    with mode:
        loss = model(**batch).loss
    gc.collect()
    kept = sum(
        n for key, (ref, n) in mode.storages.items() if key not in params and not ref.expired()
    )
    loss.backward()  # the graph is used: nothing above was a leak
    return kept


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_saved_bytes_drop_per_layer(arch, lora):
    config = tiny_config(arch)
    layers, batch = config.num_hidden_layers, padded_batch(sequences(LENGTHS)).kwargs()
    kept = {}
    for name, options in (("keep", KEEP), ("recompute", {})):
        model = surgery.patch(tiny_model(arch).train(), **options)
        if lora:
            model = lora_model(model, LORA_TARGETS[1])
        kept[name] = kept_bytes(model, batch)
    # Per layer, one (tokens x intermediate) product and two (tokens x hidden) norm outputs, fp32.
    # Under LoRA the first layer's input norm output needs no gradient (frozen embeddings and
    # norm): its projections' adapters keep it as it is, there being nothing cheaper to keep.
    norm_outputs = 2 * layers - (1 if lora else 0)
    # Llama (sdpa) runs the real tokens alone (padding_free); Gemma 2 (eager) the padded batch.
    tokens = sum(LENGTHS) if arch == "llama" else batch["input_ids"].numel()
    want = tokens * (layers * config.intermediate_size + norm_outputs * HIDDEN) * 4
    assert kept["keep"] - kept["recompute"] == want


def recomputed_products(model, batch) -> int:
    """The products the backward runs under transformers' non-reentrant activation checkpointing
    beyond those it runs without: the layers' recomputation."""
    counts = []
    for ckpt in (False, True):
        if ckpt:
            enable_activation_checkpointing(model, use_reentrant=False)
        loss = model(**batch).loss
        with MatrixProducts() as products:
            loss.backward()
        counts.append(products.count)
    return counts[1] - counts[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointed_recomputation_runs_no_more_products_than_transformers(arch):
    """Non-reentrant checkpointing stops a layer's recomputation once every tensor the layer
    saved is back; transformers' last product of a layer (nn.Linear's, or the experts' grouped
    GEMM) saves its inputs before it runs and is not recomputed. Surgery's layers recompute no
    more products than transformers' (a down projection computed in an autograd Function before
    its tensors were saved ran again in each layer)."""
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    theirs = recomputed_products(tiny_model(arch).train(), batch)
    ours = recomputed_products(surgery.patch(tiny_model(arch).train()), batch)
    assert theirs > 0
    assert ours <= theirs


def test_recompute_off_under_outer_saved_tensor_hooks(monkeypatch):
    """Other saved-tensor hooks own every saved tensor: ours stay out of their way. Under them the
    default patch packs nothing itself and hands the outer hooks what a patch that keeps the norm
    outputs hands them (the norm outputs themselves; the MLP product, which the fused
    ``gated_linear`` never keeps, is kept by neither), and its backward rebuilds nothing; without
    them the same model packs and rebuilds."""
    packed, rebuilds = [], []
    pack, rebuild = recompute._pack, recompute._Source.rebuild

    def counting_pack(t):
        packed.append(t.shape)
        return pack(t)

    def counting_rebuild(source):
        rebuilds.append(source.size)
        return rebuild(source)

    monkeypatch.setattr(recompute, "_pack", counting_pack)
    monkeypatch.setattr(recompute._Source, "rebuild", counting_rebuild)
    batch = padded_batch(sequences(LENGTHS)).kwargs()

    def saved_through_outer_hooks(model) -> list[tuple]:
        seen = []

        def pack(t):
            seen.append((tuple(t.shape), str(t.dtype)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        loss.backward()
        return sorted(seen)

    base = tiny_model("llama").train()
    kept = saved_through_outer_hooks(surgery.patch(twin(base), recompute_norm_output=False))
    model = surgery.patch(base)
    assert saved_through_outer_hooks(model) == kept
    assert packed == rebuilds == []
    model(**batch).loss.backward()
    assert packed and rebuilds, "nothing recomputed without outer hooks: the counts prove nothing"


def test_in_place_change_of_a_recompute_input_raises():
    model = surgery.patch(tiny_model("llama").train())
    loss = model(**padded_batch(sequences(LENGTHS)).kwargs()).loss
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified"):
        loss.backward()


def test_released_recompute_input_raises():
    """A parameter emptied after its module's call (as DeepSpeed ZeRO-3 releases one, through
    ``.data`` without a version bump) is never read to rebuild an activation."""
    model = surgery.patch(tiny_model("llama").train())
    loss = model(**padded_batch(sequences(LENGTHS)).kwargs()).loss
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight.data = torch.empty(0)
    with pytest.raises(RuntimeError, match="changed shape"):
        loss.backward()


@pytest.mark.parametrize("zero3", [False, True])
def test_zero3_parameters_are_not_registered_for_recompute(monkeypatch, zero3):
    registered = []
    original = recompute._Source.__init__

    def spy(self, output, fn, inputs):
        registered.append(inputs)
        original(self, output, fn, inputs)

    monkeypatch.setattr(recompute._Source, "__init__", spy)
    model = surgery.patch(tiny_model("llama").train())
    if zero3:
        for param in model.parameters():
            param.ds_id = 0  # what ZeRO-3 puts on every parameter it partitions
    model(**padded_batch(sequences(LENGTHS)).kwargs()).loss.backward()
    from_norms = [inputs for inputs in registered if any(t.dim() == 1 for t in inputs)]
    # The MLP products still are (under ZeRO-3 down_proj is called, not read: gated_linear is off)
    assert registered
    assert bool(from_norms) is not zero3


def test_loss_options_reach_the_fused_loss(monkeypatch):
    seen = []
    original = surgery_head.linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append((kwargs["low_memory"], kwargs["chunk_bytes"], kwargs["skip_ignored"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(surgery_head, "linear_cross_entropy", spy)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    model = tiny_model("llama").train()
    reference = twin(model)
    surgery.patch(model, loss_low_memory=True, loss_chunk_bytes=1 << 12, loss_skip_ignored=False)
    loss, _ = loss_and_grads(model, **batch)
    want, _ = loss_and_grads(surgery.patch(reference), **batch)
    assert seen[0] == (True, 1 << 12, False) and seen[1] == (False, None, True)  # the defaults
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"recompute_mlp_product": 1},
        {"recompute_norm_output": "no"},
        {"loss_low_memory": None},
        {"loss_chunk_bytes": 0},
        {"loss_chunk_bytes": 1.5},
        {"loss_skip_ignored": "yes"},
        {"embedding_backward": 1},
    ],
    ids=[
        "mlp-int",
        "norm-str",
        "low-memory-none",
        "chunk-0",
        "chunk-float",
        "skip-str",
        "embedding-int",
    ],
)
def test_bad_recompute_and_loss_options_raise(options):
    model = tiny_model("llama")
    with pytest.raises((ValueError, TypeError)):
        surgery.patch(model, **options)
    assert not surgery.is_patched(model)


def test_mlp_reads_down_proj_only_where_it_is_plain(monkeypatch):
    """With the product rebuilt, a plain ``down_proj`` (``nn.Linear``, no bias, no hooks, a plain
    weight) runs with the product as one step (``gated_linear``: the product rebuilt inside the
    activation's backward kernel); a hooked one is called as a module, its hook runs, and its
    product is rebuilt as before; ``recompute_mlp_product=False`` calls every one."""
    from surgery.forwards import layers

    calls = []
    original = layers.gated_linear

    def spy(*args, **kwargs):
        calls.append(args[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, "gated_linear", spy)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    model = surgery.patch(tiny_model("llama").train())
    mlps = [layer.mlp for layer in model.model.layers]
    model(**batch).loss.backward()
    assert [w is m.down_proj.weight for w, m in zip(calls, mlps)] == [True] * len(mlps)
    calls.clear()
    hooked = []
    mlps[0].down_proj.register_forward_hook(lambda *args: hooked.append(True))
    model(**batch).loss.backward()
    assert len(calls) == len(mlps) - 1 and hooked == [True]
    calls.clear()
    model = surgery.patch(tiny_model("llama").train(), recompute_mlp_product=False)
    model(**batch).loss.backward()
    assert calls == []
