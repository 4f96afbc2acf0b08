"""Llama 4's text model: what its attention does beyond RoPE depends on positions (chunked
attention on the RoPE layers, the query temperature on the layers without RoPE), and the patched
model reads them from the position ids. A packed row's documents train as if each were alone
(unpatched transformers lets them leak, measured first); padded batches and generation with a KV
cache are transformers' own."""

from __future__ import annotations

import pytest
import torch

import surgery
import surgery.attention.varlen as varlen
from surgery.attention import chunked as chunked_attention
from surgery.attention.chunked import chunked_document_mask
from surgery.kernels.packing import split_at_chunks
from surgery.kernels.reduction import host_cu_seqlens
from tests.surgery.test_varlen_attention import ReferenceVarlen
from tests.utils import FP32_CLOSE as TOL
from tests.utils import assert_close_budget

from .tiny import (
    TINY,
    assert_grads_close,
    left_padded_batch,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_model,
    twin,
)

ARCH = "llama4_text"
CHUNK = TINY.sliding_window  # the mini config's attention_chunk_size
# Each longer than a chunk; packed, the second starts mid-chunk of the row's token index.
LENGTHS = [8, 9]


def alone(reference, seqs) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The packed batch's token-mean loss and gradients from each document run alone (each
    document's first label ignored, as the packing collator does), and the concatenated logits."""
    reference.zero_grad(set_to_none=True)
    n_tokens = sum(len(s) - 1 for s in seqs)
    total, logits = 0.0, []
    for s in seqs:
        out = reference(input_ids=s[None], labels=s[None], use_cache=False)
        part = out.loss * (len(s) - 1) / n_tokens
        part.backward()
        total += part.detach()
        logits.append(out.logits[0].detach())
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    return torch.as_tensor(total), grads, torch.cat(logits)


def test_mini_model_has_both_kinds_of_layer():
    model = tiny_model(ARCH)
    config = model.config
    assert config.layer_types == ["chunked_attention", "full_attention"]
    assert config.attention_chunk_size < max(LENGTHS)
    rope, nope = (layer.self_attn for layer in model.model.layers)
    assert rope.use_rope and hasattr(rope, "qk_norm")
    assert not nope.use_rope and not hasattr(nope, "qk_norm") and nope.attn_temperature_tuning
    assert config.moe_layers == [1] and config.num_experts_per_tok == 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_train_as_if_alone(attn):
    """Two documents packed in one row (position ids restarting, no attention mask): the patched
    model's loss, every gradient and every position's logits are those of the documents alone.
    Unpatched, the second document's chunks (5.17) and query temperatures (both releases) follow
    the token's index in the row."""
    model = tiny_model(ARCH, attn).train()
    reference = twin(model)
    seqs = sequences(LENGTHS)
    packed = packed_batch(seqs).kwargs()
    want_loss, want_grads, want_logits = alone(reference, seqs)

    # The leak this guards against: unpatched, the second document's logits are off.
    with torch.no_grad():
        leaked = reference(**packed, use_cache=False)
    first = LENGTHS[0]
    leak = (leaked.logits[0] - want_logits).abs()
    assert leak[:first].max() < 1e-5  # the first document sees nothing before it
    assert leak[first:].max() > 1e-4

    surgery.patch(model)
    loss, grads = loss_and_grads(model, **packed)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    with torch.no_grad():
        logits = model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False)
    torch.testing.assert_close(logits.logits[0], want_logits, **TOL)


def test_chunked_document_mask():
    """Against the rule written out per pair: k <= q, same document, same chunk of positions."""
    pos = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4]]
    )
    got = chunked_document_mask(pos, 2, 3)[:, 0]
    doc = torch.cumsum(torch.cat([torch.ones(2, 1), (pos[:, 1:] != pos[:, :-1] + 1).float()], 1), 1)
    q, k = torch.arange(13)[:, None], torch.arange(13)[None, :]
    want = (
        (k <= q)
        & (doc[:, :, None] == doc[:, None, :])
        & (pos[:, :, None] // 3 == pos[:, None, :] // 3)
    )
    assert torch.equal(got, want)
    assert torch.equal(
        chunked_document_mask(pos[:1], 2, 3),
        chunked_document_mask(pos[:1], 1, 3).expand(2, -1, -1, -1),
    )


@pytest.mark.parametrize("layout", ["right", "left"])
def test_temperature_matches_unpatched_on_padded_batches(layout):
    """Padded batches (right: the mask dropped, causal; left: masked), trained: loss and every
    gradient are transformers'. The temperature bites: without it the logits differ."""
    model = tiny_model(ARCH).train()
    reference = twin(model)
    surgery.patch(model)
    make = padded_batch if layout == "right" else left_padded_batch
    batch = make(sequences([9, 6, 3])).kwargs()
    loss, grads = loss_and_grads(model, **batch)
    want_loss, want_grads = loss_and_grads(reference, **batch)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    with torch.no_grad():
        logits = reference(**batch).logits
        reference.model.layers[1].self_attn.attn_temperature_tuning = False
        assert (reference(**batch).logits - logits).abs().max() > 20 * TOL["atol"]


def test_temperature_is_scaled_from_position_ids(monkeypatch):
    """The no-RoPE layer scales its query once per forward, by the factor of each token's
    position id."""
    seen = []
    real = chunked_attention.temperature_scaled_query

    def spy(module, query, position_ids):
        seen.append(position_ids)
        return real(module, query, position_ids)

    monkeypatch.setattr(chunked_attention, "temperature_scaled_query", spy)
    model = surgery.patch(tiny_model(ARCH).eval())
    batch = packed_batch(sequences([4, 3])).kwargs()
    with torch.no_grad():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    assert len(seen) == 1 and seen[0].tolist() == [[0, 1, 2, 3, 0, 1, 2]]


def test_generate_matches_unpatched():
    """Greedy generation through the KV cache (prefill, then one token at a time past a chunk
    boundary) is transformers'; a left-padded batch generates what each prompt generates alone."""
    model = tiny_model(ARCH).eval()
    reference = twin(model)
    surgery.patch(model)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    prompt = padded_batch(sequences([6]))
    got = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    want = reference.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    torch.testing.assert_close(got, want)

    seqs = sequences([7, 4], seed=3)
    batch = left_padded_batch(seqs)
    got = model.generate(batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
    for row, s in enumerate(seqs):
        want = reference.generate(s[None], attention_mask=torch.ones_like(s)[None], **kwargs)
        torch.testing.assert_close(got[row, -len(s) - 6 :], want[0])


# A row continuing a document mid-chunk (positions from 3), then two documents crossing chunk
# boundaries; a second row of three documents, the last starting at a multiple of the chunk.
CHUNKED_POSITIONS = torch.tensor(
    [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2],
     [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2]]
)  # fmt: skip


def test_split_at_chunks_is_the_chunked_mask():
    """The chunks, each attending causally to itself, allow exactly what ``chunked_document_mask``
    allows: documents restart at each row and where the position does not continue, chunks at
    every multiple of the chunk size of a document's own position."""
    batch, seq = CHUNKED_POSITIONS.shape
    documents = host_cu_seqlens(CHUNKED_POSITIONS, (batch, seq))
    for size in (3, CHUNK, 8):
        cu = split_at_chunks(CHUNKED_POSITIONS, (batch, seq), documents, size)
        chunk = torch.zeros(batch * seq, dtype=torch.long)
        chunk[cu[1:-1]] = 1
        chunk = chunk.cumsum(0).view(batch, seq)
        q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        allowed = (k <= q) & (chunk[:, :, None] == chunk[:, None, :])
        assert torch.equal(allowed, chunked_document_mask(CHUNKED_POSITIONS, batch, size)[:, 0])
    cu = split_at_chunks(CHUNKED_POSITIONS, (batch, seq), documents, CHUNK)
    assert cu.tolist() == [0, 2, 7, 10, 15, 17, 20, 25, 26, 31, 36, 37, 40]


def test_chunked_layers_take_varlen_within_budget_of_the_masked_path(monkeypatch):
    """Packed bf16 rows whose documents cross chunk boundaries (one continuing mid-chunk): every
    layer runs the (reference) varlen kernel, the chunked layer over the documents' chunks and
    the global one over the documents; loss and gradients within the bf16 budget of the masked
    path. fp32 keeps the masked path."""
    kernel = ReferenceVarlen()
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device: kernel)
    torch.manual_seed(0)
    ids = torch.randint(1, TINY.vocab_size, CHUNKED_POSITIONS.shape)
    batch = dict(input_ids=ids, labels=ids, position_ids=CHUNKED_POSITIONS)
    fp32 = tiny_model(ARCH).train()
    bf16 = twin(fp32).to(torch.bfloat16)
    ref_loss, ref_grads = loss_and_grads(surgery.patch(fp32), **batch)
    masked_loss, masked_grads = loss_and_grads(
        surgery.patch(twin(bf16), varlen_attention=False), **batch
    )
    assert kernel.calls == []  # fp32, and the option off: the masked path
    loss, grads = loss_and_grads(surgery.patch(bf16), **batch)

    documents = [0, 10, 17, 20, 26, 37, 40]
    chunks = [0, 2, 7, 10, 15, 17, 20, 25, 26, 31, 36, 37, 40]
    assert [(c["cu"], c["max"], c["window"]) for c in kernel.calls] == [
        (chunks, 5, (-1, 0)),  # layer 0: chunked
        (documents, 11, (-1, 0)),  # layer 1: global
    ]

    def flat(g):
        return torch.cat([t.float().flatten() for t in g.values()])

    assert_close_budget(loss.float(), ref_loss, masked_loss.float(), torch.bfloat16, what="loss")
    assert_close_budget(flat(grads), flat(ref_grads), flat(masked_grads), torch.bfloat16,
                        what="grads")  # fmt: skip


def test_packed_chunked_cu_seqlens_op():
    """The op ``torch.compile`` without graph breaks reads both boundaries from."""
    cu, chunked = torch.ops.surgery.packed_chunked_cu_seqlens(CHUNKED_POSITIONS, 2, 20, CHUNK)
    assert cu.dtype == chunked.dtype == torch.int32
    assert cu.tolist() == [0, 10, 17, 20, 26, 37, 40]
    assert chunked.tolist() == [0, 2, 7, 10, 15, 17, 20, 25, 26, 31, 36, 37, 40]


@pytest.mark.gpu
def test_chunked_layers_through_flash_varlen_within_budget_of_the_masked_path():
    """The same packed rows through torch's varlen flash attention (chunks of 5 positions, a
    continuation row): loss and gradients within the bf16 budget of the masked path."""
    assert varlen.varlen_kernel(torch.device("cuda")) is not None, "no varlen kernel here"
    torch.manual_seed(0)
    pos = CHUNKED_POSITIONS.repeat(1, 3).cuda()  # position restarts where the repeat joins
    ids = torch.randint(1, TINY.vocab_size, pos.shape, device="cuda")
    batch = dict(input_ids=ids, labels=ids, position_ids=pos)
    fp32 = tiny_model(ARCH).cuda().train()
    bf16 = twin(fp32).to(torch.bfloat16)
    ref_loss, ref_grads = loss_and_grads(surgery.patch(fp32), **batch)
    masked_loss, masked_grads = loss_and_grads(
        surgery.patch(twin(bf16), varlen_attention=False), **batch
    )
    loss, grads = loss_and_grads(surgery.patch(bf16), **batch)

    def flat(g):
        return torch.cat([t.float().flatten() for t in g.values()])

    assert_close_budget(loss.float(), ref_loss, masked_loss.float(), torch.bfloat16, what="loss")
    assert_close_budget(flat(grads), flat(ref_grads), flat(masked_grads), torch.bfloat16,
                        what="grads")  # fmt: skip
