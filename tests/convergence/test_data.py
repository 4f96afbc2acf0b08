"""Synthetic data: deterministic, varied, learnable, and collated like transformers does it."""

from __future__ import annotations

import itertools

import torch
from transformers import DataCollatorWithFlattening

from surgery.convergence.configs import SIZES
from surgery.convergence.data import (
    ASSISTANT,
    BOS,
    EOS,
    IGNORE_INDEX,
    PAD,
    USER,
    SyntheticCorpus,
    collate_packed,
    collate_padded,
    make_batches,
)


def _flat(batches):
    return [(d.input_ids.tolist(), d.labels.tolist(), d.kind) for docs in batches for d in docs]


def test_deterministic_in_the_seed():
    a_train, a_eval = make_batches("tiny", 4, seed=3)
    b_train, b_eval = make_batches("tiny", 4, seed=3)
    c_train, _ = make_batches("tiny", 4, seed=4)
    assert _flat(a_train) == _flat(b_train)
    assert _flat([a_eval]) == _flat([b_eval])
    assert _flat(a_train) != _flat(c_train)
    assert _flat([a_eval]) not in (_flat([d]) for d in a_train)  # eval documents are held out


def test_varied_lengths_and_both_kinds():
    size = SIZES["tiny"]
    train, _ = make_batches("tiny", 16)
    docs = [d for batch in train for d in batch]
    lengths = {len(d) for d in docs}
    assert len(lengths) > 4
    assert all(4 <= n <= size.max_doc_len for n in lengths)
    assert all(len(batch) == size.docs_per_step for batch in train)
    assert {d.kind for d in docs} == {"lm", "sft"}
    assert all(d.input_ids.max() < size.vocab_size and d.input_ids.min() >= 0 for d in docs)


def test_sft_dialogues_mask_prompts_and_have_several_turns():
    corpus = SyntheticCorpus(509, seed=0)
    g = torch.Generator().manual_seed(0)
    dialogues = [corpus.sft_dialogue(64, g) for _ in range(20)]
    assert max(int((d.input_ids == USER).sum()) for d in dialogues) > 1  # multi-turn
    for d in dialogues:
        ids, labels = d.input_ids.tolist(), d.labels.tolist()
        assert ids[0] == BOS and labels[0] == IGNORE_INDEX
        in_prompt = False
        for tok, lab in zip(ids[1:], labels[1:]):
            if tok == USER:
                in_prompt = True
            if in_prompt:
                assert lab == IGNORE_INDEX  # role tokens and the prompt are never targets
            else:
                assert lab == tok  # the response and EOS are
            if tok == ASSISTANT:
                in_prompt = False
        assert ids[-1] == EOS and labels[-1] == EOS


def test_lm_documents_follow_the_markov_chain():
    corpus = SyntheticCorpus(509, seed=0)
    g = torch.Generator().manual_seed(0)
    docs = [corpus.lm_document(40, g) for _ in range(20)]
    follows = total = 0
    for d in docs:
        ids = d.input_ids.tolist()[1:]
        for a, b in itertools.pairwise(ids):
            total += 1
            follows += (b - 5) in corpus._successors[a - 5].tolist()
    assert follows / total > 0.8  # the rest: where a copied span starts or ends


def test_collate_padded():
    train, _ = make_batches("tiny", 1, seed=1)
    docs = train[0]
    batch = collate_padded(docs)
    width = max(len(d) for d in docs)
    assert batch["input_ids"].shape == (len(docs), width)
    for row, d in enumerate(docs):
        n = len(d)
        assert torch.equal(batch["input_ids"][row, :n], d.input_ids)
        assert torch.equal(batch["labels"][row, :n], d.labels)
        assert (batch["input_ids"][row, n:] == PAD).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)


def test_collate_packed_is_data_collator_with_flattening():
    train, _ = make_batches("tiny", 1, seed=2)
    docs = train[0]
    batch = collate_packed(docs)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask
    expected = DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": d.input_ids.tolist(), "labels": d.labels.tolist()} for d in docs]
    )
    for key in batch:
        assert torch.equal(batch[key], expected[key])
    assert batch["input_ids"].shape == (1, sum(len(d) for d in docs))
    offset = 0
    for d in docs:
        n = len(d)
        assert batch["position_ids"][0, offset : offset + n].tolist() == list(range(n))
        assert batch["labels"][0, offset] == IGNORE_INDEX  # no target across documents
        assert torch.equal(batch["labels"][0, offset + 1 : offset + n], d.labels[1:])
        offset += n
