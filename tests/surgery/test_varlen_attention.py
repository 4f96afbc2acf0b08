"""``varlen_attention``: packed batches run their attention per document through torch's
variable-length flash attention instead of sdpa with transformers' block-diagonal mask.

Flash attention needs CUDA, so here the kernel is replaced by ``reference_varlen`` (a loop over
the documents with an explicit causal / sliding-window mask in fp32), which tests the plumbing:
document boundaries from the position ids, the flattened layout, GQA, the scale, the mapping of
transformers' ``sliding_window`` to flash attention's window, and when the path is taken at all.
The real kernel is compared with the masked path on the GPU (tests/surgery/test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import surgery
import surgery.attention.varlen as varlen
from surgery.attention.forward import packed_sequences
from tests.models.tiny import (
    ARCHS,
    attention_modules,
    attn_for,
    causal_lm_from_config,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_config,
    tiny_model,
    twin,
    unpatched_packs_exactly,
)
from tests.surgery.routing_helpers import replayed_steps
from tests.surgery.unpatched import (
    VARIANTS,
    patch_options,
    patched_step,
    unpatched_step,
    variant_batch,
)
from tests.utils import TOLERANCES, ReferenceVarlen, assert_close_budget

LENGTHS = [9, 6, 3]  # the tiny configs' sliding window is 5: it cuts into the first two


@pytest.fixture
def reference_kernel(monkeypatch):
    kernel = ReferenceVarlen()
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device: kernel)
    return kernel


def expected_calls(arch, lengths, scale):
    """The kernel call of each attention layer: flash attention's (left, right) window, from
    transformers' rule that a query sees the keys less than ``sliding_window`` positions back,
    on its sliding layers, over the packed documents of ``lengths``; on a chunked layer (Llama 4)
    over the documents' chunks, split where a document's position reaches a multiple of
    ``attention_chunk_size``."""
    config = tiny_config(arch)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    documents = dict(cu=offsets, max=max(lengths))
    calls = []
    for i in range(config.num_hidden_layers):
        if types is not None and types[i] == "linear_attention":
            continue  # a hybrid's linear-attention layer: no attention
        if types is not None and types[i] == "chunked_attention":
            size = config.attention_chunk_size
            starts = [o + p for o, n in zip(offsets, lengths) for p in range(0, n, size)]
            chunks = dict(cu=[*starts, offsets[-1]], max=min(size, max(lengths)))
            calls.append(dict(**chunks, scale=scale, window=(-1, 0)))
            continue
        # Without layer types (Mistral) a window, if any, applies to every layer.
        sliding = window is not None and (types is None or types[i] == "sliding_attention")
        calls.append(dict(**documents, scale=scale, window=(window - 1, 0) if sliding else (-1, 0)))
    return calls


SDPA_ARCHS = [arch for arch in ARCHS if attn_for(arch) == "sdpa"]


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.float().flatten() for g in grads.values()])


def assert_packed_bf16_within_budget_of_transformers(arch, kernel, variant="mean"):
    """The patched bf16 step on packed rows, its attention through ``kernel``, against unpatched
    transformers in fp32 within the budget its bf16 run sets (``tests.surgery.unpatched`` for the
    variant's loss), on the same packed rows, or on the documents padded where transformers
    does not keep packed documents apart (``unpatched_packs_exactly``); a mixture of experts
    routes as the fp32 run (``routing_helpers``). Returns nothing; asserts the calls too."""
    fp32 = tiny_model(arch).train()
    bf16 = twin(fp32).to(torch.bfloat16)
    patched = surgery.patch(twin(bf16), **patch_options(variant))
    seqs = sequences(LENGTHS)
    batch = variant_batch(packed_batch(seqs).kwargs(), variant)
    want_batch, extra = batch, {"use_cache": False}
    if not unpatched_packs_exactly(arch):
        want_batch, extra = variant_batch(padded_batch(seqs).kwargs(), variant), {}
    ref, want, got = replayed_steps(
        fp32,
        lambda: unpatched_step(fp32, want_batch, variant, **extra),
        lambda: unpatched_step(bf16, want_batch, variant, **extra),
        lambda: patched_step(patched, batch, variant),
        want_batch,
        batch,
        TOLERANCES[torch.bfloat16]["factor"],
        f"{arch} {variant}",
    )
    attentions = attention_modules(patched, arch)
    scaling = surgery.attention.forward.read_path(attentions[0], "scaling")
    assert kernel.calls == expected_calls(arch, LENGTHS, scaling)
    assert len(kernel.calls) == len(attentions)  # every layer, chunked ones too
    assert got[1].keys() == want[1].keys()
    assert_close_budget(got[0], ref[0], want[0], torch.bfloat16, what="loss")
    assert_close_budget(flat(got[1]), flat(ref[1]), flat(want[1]), torch.bfloat16, what="grads")


@pytest.mark.parametrize("arch", SDPA_ARCHS)
def test_packed_bf16_within_budget_of_transformers(arch, reference_kernel):
    assert_packed_bf16_within_budget_of_transformers(arch, reference_kernel)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "mean"])
def test_packed_variants_within_budget_of_transformers(variant, reference_kernel):
    """The loss options and inputs on packed rows (the per-sequence mean over the documents the
    position ids give, transformers' shifted labels, input embeddings, z-loss,
    ``num_items_in_batch``), the same budget."""
    assert_packed_bf16_within_budget_of_transformers("llama", reference_kernel, variant)


def test_fp32_and_the_option_off_keep_the_masked_path(reference_kernel):
    """fp32 layers, and bf16 ones with ``varlen_attention=False``, never call the kernel."""
    batch = packed_batch(sequences(LENGTHS)).kwargs()
    fp32 = tiny_model("llama").train()
    loss_and_grads(surgery.patch(twin(fp32)), **batch)
    loss_and_grads(surgery.patch(fp32.to(torch.bfloat16), varlen_attention=False), **batch)
    assert reference_kernel.calls == []


def test_several_packed_rows_are_flattened_row_by_row(reference_kernel):
    """Two rows, each packed: documents never span rows, and every row's first token starts
    one even where its position does not restart (a chunk of a longer document)."""
    model = surgery.patch(tiny_model("llama", dtype=torch.bfloat16).train())
    ids = torch.randint(1, 100, (2, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [7, 8, 9, 0, 1, 0, 1, 2, 3, 4]])
    model(input_ids=ids, position_ids=pos, labels=ids)
    assert reference_kernel.calls[0]["cu"] == [0, 4, 10, 13, 15, 20]
    assert reference_kernel.calls[0]["max"] == 6


def test_ignored_label_runs_are_not_boundaries(reference_kernel):
    """A masked prompt inside a document (a run of -100) does not split it."""
    model = surgery.patch(tiny_model("llama", dtype=torch.bfloat16).train())
    batch = packed_batch(sequences(LENGTHS))
    batch.labels[0, 2:7] = -100
    model(**batch.kwargs())
    assert reference_kernel.calls[0]["cu"] == [0, 9, 15, 18]


def test_not_taken_without_packing(reference_kernel):
    """Rows of one document each, padded batches, calls without labels in eval, a softcapped
    eager model, the option off: the attention runs as before and the kernel is never called."""
    model = surgery.patch(tiny_model("llama", dtype=torch.bfloat16).train())
    ids = torch.randint(1, 100, (2, 8))
    model(input_ids=ids, position_ids=torch.arange(8).expand(2, 8), labels=ids)
    model(**padded_batch(sequences(LENGTHS)).kwargs())
    packed = packed_batch(sequences(LENGTHS)).kwargs()
    with torch.no_grad():
        model.eval()(input_ids=packed["input_ids"], position_ids=packed["position_ids"])
    model.train()
    surgery.patch(model, varlen_attention=False)(**packed)
    gemma2 = tiny_model("gemma2", dtype=torch.bfloat16).train()
    assert attn_for("gemma2") == "eager"
    surgery.patch(gemma2)(**packed)
    assert reference_kernel.calls == []


def test_head_size_flash_cannot_read_takes_the_masked_path(reference_kernel):
    """Heads of 12 bf16 channels (24 bytes, not whole 16-byte vectors): flash attention's varlen
    kernel cannot take them; the masked path runs, as with the option off."""
    config = tiny_config("llama", head_dim=12)
    torch.manual_seed(0)
    model = causal_lm_from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    batch = packed_batch(sequences(LENGTHS)).kwargs()
    want, _ = loss_and_grads(surgery.patch(twin(model).train(), varlen_attention=False), **batch)
    got, _ = loss_and_grads(surgery.patch(model.train()), **batch)
    assert reference_kernel.calls == []
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_packed_sequences_from_position_ids(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device: "kernel")
    cpu = torch.device("cpu")
    for dtype in (torch.int32, torch.int64):
        pos = torch.tensor([[0, 1, 2, 0, 1, 0]], dtype=dtype)
        packed = packed_sequences(pos, (1, 6), cpu)
        assert packed.cu_seqlens.tolist() == [0, 3, 5, 6] and packed.max_length == 3
        assert packed.cu_seqlens.dtype == torch.int32 and packed.kernel == "kernel"
    # (1, T) position ids shared by every row of a (B, T) batch
    packed = packed_sequences(torch.tensor([[0, 1, 0, 1]]), (2, 4), cpu)
    assert packed.cu_seqlens.tolist() == [0, 2, 4, 6, 8]
    # one document per row, whatever its offset: nothing to do
    assert packed_sequences(torch.tensor([[0, 1, 2], [5, 6, 7]]), (2, 3), cpu) is None


def test_no_kernel_on_cpu():
    """Without the monkeypatch: a CPU tensor gets no varlen kernel, the mask path runs."""
    assert varlen.varlen_kernel(torch.device("cpu")) is None
    assert packed_sequences(torch.tensor([[0, 1, 0]]), (1, 3), torch.device("cpu")) is None
