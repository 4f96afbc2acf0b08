"""Hybrid architectures (linear-attention layers beside attention layers: Qwen3-Next, Qwen3.5):
a packed row's documents stay apart in the linear-attention layers too (their convolution window
and recurrent state restart at each document), against each document run alone through the
unpatched model; unpatched transformers lets them leak, which the tests measure first. Also the
layout the layers are given, the KV-cache path (generation) and ``unpatch``."""

from __future__ import annotations

import sys

import pytest
import torch

import surgery
from surgery.attention import varlen
from surgery.attention.linear import packed_documents
from surgery.kernels import reduction
from surgery.patching.swap import ORIGINAL_ATTR
from tests.utils import FP32_CLOSE as TOL
from tests.utils import TOLERANCES, dense_varlen

from .tiny import (
    SPECS,
    assert_grads_close,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    tiny_model,
    twin,
)

HYBRIDS = [arch for arch, spec in SPECS.items() if spec.linear_attention is not None]
# Both longer than the linear attention's convolution window (4 tokens).
LENGTHS = [9, 6]


def lm_only(arch: str) -> dict:
    # The router's load-balancing loss is one statistic of the whole batch, not a sum over
    # documents: packed or alone it differs (test_architectures compares it on its own).
    return {"output_router_logits": False} if SPECS[arch].router_aux_loss else {}


def alone(reference, seqs, **kwargs) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The packed batch's token-mean loss and gradients from each document run alone (each
    document's first label ignored, as the packing collator does), and the concatenated logits."""
    reference.zero_grad(set_to_none=True)
    n_tokens = sum(len(s) - 1 for s in seqs)
    total, logits = 0.0, []
    for s in seqs:
        out = reference(input_ids=s[None], labels=s[None], use_cache=False, **kwargs)
        part = out.loss * (len(s) - 1) / n_tokens
        part.backward()
        total += part.detach()
        logits.append(out.logits[0].detach())
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    return torch.as_tensor(total), grads, torch.cat(logits)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_packed_documents_train_as_if_alone(arch):
    """Two documents packed in one row (position ids restarting, no attention mask): the patched
    model's loss, every gradient and every position's logits are those of the documents alone.
    Unpatched transformers, on the same row, carries the first document's state into the second."""
    model = tiny_model(arch).train()
    reference = twin(model)
    seqs = sequences(LENGTHS)
    packed = packed_batch(seqs).kwargs()
    want_loss, want_grads, want_logits = alone(reference, seqs, **lm_only(arch))

    # The leak this guards against: unpatched, the second document's logits are off.
    with torch.no_grad():
        leaked = reference(**packed, use_cache=False, **lm_only(arch))
    first = LENGTHS[0]
    leak = (leaked.logits[0] - want_logits).abs()
    assert leak[:first].max() < 1e-5  # the first document sees nothing before it
    assert leak[first:].max() > 1e-3

    surgery.patch(model)
    loss, grads = loss_and_grads(model, **packed, **lm_only(arch))
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    with torch.no_grad():
        logits = model(**{k: v for k, v in packed.items() if k != "labels"}, **lm_only(arch))
    torch.testing.assert_close(logits.logits[0], want_logits, **TOL)


@pytest.mark.parametrize("lengths", [[*LENGTHS, 5], [11]], ids=["three", "one"])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_trl_padding_free_batch_trains_as_if_alone(arch, lengths):
    """The batch TRL's padding-free collator builds (position ids, and the packed layout as
    flash attention's cu_seq_lens_* / max_length_* and the convolution's seq_idx) trains a
    patched hybrid as its documents alone, without flash-linear-attention too (transformers'
    own layers, given those keyword arguments, refuse them without its kernels): the layers take
    the documents from the position ids (a single document: whole rows)."""
    collator = pytest.importorskip("trl.trainer.sft_trainer").DataCollatorForLanguageModeling
    model = tiny_model(arch).train()
    reference = twin(model)
    surgery.patch(model)
    seqs = sequences(lengths, seed=3)
    batch = collator(pad_token_id=0, padding_free=True)([{"input_ids": s.tolist()} for s in seqs])
    assert {"position_ids", "cu_seq_lens_q", "seq_idx"} <= batch.keys()
    want_loss, want_grads, _ = alone(reference, seqs, **lm_only(arch))
    loss, grads = loss_and_grads(model, **batch, **lm_only(arch))
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


@pytest.mark.parametrize("arch", ["qwen3_5_text"])
def test_packed_rows(arch):
    """Two packed rows of other document counts (one row a single document), in an eval forward
    without labels (no KV cache asked for: with one, transformers' attention mixes documents
    too): every position's logits are its document's alone."""
    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    rows = [sequences([5, 3, 4], seed=2), sequences([12], seed=3)]
    ids = torch.stack([torch.cat(r) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in rows])
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        for row, docs in enumerate(rows):
            want = torch.cat([reference(input_ids=s[None]).logits[0] for s in docs])
            torch.testing.assert_close(got[row], want, **TOL)


def test_packed_step_reads_position_ids_once(monkeypatch):
    """A packed bf16 training step on sdpa with the varlen attention (a dense stand-in for its
    kernel on CPU): the attention layers and the linear-attention layers get their documents
    from one host read of the position ids (``host_cu_seqlens``), and the loss is the one without
    the varlen attention."""
    real = reduction.host_cu_seqlens
    reads, varlen_calls = [], []

    def counted_read(*args, **kwargs):
        reads.append(args)
        return real(*args, **kwargs)

    def counted_varlen(*args, **kwargs):
        varlen_calls.append(1)
        return dense_varlen(*args, **kwargs)

    for module in list(sys.modules.values()):  # wherever surgery imported it
        name = getattr(module, "__name__", "")
        if name.startswith("surgery") and getattr(module, "host_cu_seqlens", None) is real:
            monkeypatch.setattr(module, "host_cu_seqlens", counted_read)
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device: counted_varlen)
    model = tiny_model("qwen3_5_text", dtype=torch.bfloat16).train()
    reference = surgery.patch(twin(model), varlen_attention=False)
    surgery.patch(model)
    batch = packed_batch(sequences(LENGTHS)).kwargs()
    with torch.no_grad():
        loss = model(**batch).loss
        assert len(reads) == 1 and varlen_calls
        want = reference(**batch).loss
    torch.testing.assert_close(loss, want, **{k: TOLERANCES[torch.bfloat16][k] for k in TOL})


def test_documents_layout():
    """Packed rows -> a (documents, longest) right-padded batch: the gather and scatter indices
    and the mask, against the layout written out by hand; rows of one document each -> None."""
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    docs = packed_documents(pos, (2, 5), torch.device("cpu"))
    # documents (flat token indices): [0 1 2] [3 4] [5 6] [7 8 9]; padding slots point at 10
    assert docs.gather.tolist() == [0, 1, 2, 3, 4, 10, 5, 6, 10, 7, 8, 9]
    assert docs.scatter.tolist() == [0, 1, 2, 3, 4, 6, 7, 9, 10, 11]
    assert docs.mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    # a position that does not continue starts a document (a chunk starting mid-document too)
    assert packed_documents(torch.tensor([4, 5, 6, 7]), (1, 4), torch.device("cpu")) is None
    assert packed_documents(torch.arange(5)[None].expand(3, 5), (3, 5), torch.device("cpu")) is None
    assert packed_documents(
        torch.tensor([[3, 4, 9, 10]]), (1, 4), torch.device("cpu")
    ).mask.shape == (
        2,
        2,
    )


@pytest.mark.parametrize("arch", HYBRIDS)
def test_generate_and_padded_eval_match_unpatched(arch):
    """The KV-cache path (prefill, then one token at a time through the recurrent state and the
    gated attention's cache) and a padded batch's eval logits are transformers' own."""
    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    prompt = padded_batch(sequences([6]))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    want = reference.generate(prompt.input_ids, attention_mask=prompt.attention_mask, **kwargs)
    torch.testing.assert_close(got, want)
    batch = padded_batch(sequences([7, 4]))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        want_logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(logits[real], want_logits.logits[real], **TOL)


def test_unpatch_restores_the_layers():
    """``unpatch`` puts back the base model's and the linear-attention layers' own forwards: the
    model is transformers' again, leak included."""
    arch = "qwen3_next"
    model = tiny_model(arch).eval()
    reference = twin(model)
    spec = SPECS[arch]
    linear = [m for m in model.modules() if spec.is_instance(m, spec.linear_attention)]
    surgery.patch(model)
    assert all(ORIGINAL_ATTR in m.__dict__ for m in [model.model, *linear])
    surgery.unpatch(model)
    assert not any(ORIGINAL_ATTR in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    packed = packed_batch(sequences(LENGTHS)).kwargs()
    del packed["labels"]
    with torch.no_grad():
        torch.testing.assert_close(
            model(**packed, use_cache=False).logits, reference(**packed, use_cache=False).logits
        )


def test_packed_documents_under_torch_compile():
    """``torch.compile`` with graph breaks allowed: the documents are found eagerly (one graph
    break) and the compiled rest keeps them apart: the compiled step is the documents' alone."""
    arch = "qwen3_5_text"
    model = tiny_model(arch).train()
    reference = twin(model)
    compiled = torch.compile(surgery.patch(model), backend="eager")
    seqs = sequences(LENGTHS)
    torch._dynamo.reset()
    try:
        loss, grads = loss_and_grads(compiled, **packed_batch(seqs).kwargs())
    finally:
        torch._dynamo.reset()
    want_loss, want_grads, _ = alone(reference, seqs)
    torch.testing.assert_close(loss, want_loss, **TOL)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert_grads_close(grads, want_grads, **TOL)
