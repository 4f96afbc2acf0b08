"""Deterministic synthetic training data with structure a small model learns in a few dozen steps.

Nothing is downloaded. Two kinds of documents, both of varied length:

- language-model documents: a sparse order-1 Markov chain (each token has four likely successors,
  so the bigram entropy is low) with copied spans (a stretch of the document repeated later, which
  only attention can predict, so RoPE positions matter). Every token after BOS is a target.
- SFT dialogues: one to three turns of ``USER prompt ASSISTANT response EOS`` where the response
  is the prompt reversed and mapped through a fixed token permutation. Only the response tokens
  and EOS are targets; BOS, role tokens and prompts are labelled -100. A dialogue is one sequence:
  its masked prompt turns are not sequence boundaries.

Labels follow the HF convention (not shifted; the model shifts). Batches are collated either
padded (one document per row, right padding, ``attention_mask``) or packed (one row, restarting
``position_ids``, no ``attention_mask``) by transformers' own ``DataCollatorWithFlattening``, which
also sets the label of each document's first token to -100 so that no token is trained to
predict the start of the next document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DataCollatorWithFlattening

from .configs import SIZES, Size

__all__ = [
    "ASSISTANT",
    "BOS",
    "DATA_KINDS",
    "EOS",
    "IGNORE_INDEX",
    "PAD",
    "USER",
    "Document",
    "SyntheticCorpus",
    "collate",
    "collate_packed",
    "collate_padded",
    "make_batches",
]

PAD, BOS, EOS, USER, ASSISTANT = 0, 1, 2, 3, 4
FIRST_CONTENT = 5
IGNORE_INDEX = -100
DATA_KINDS = ("mixed", "lm", "sft")

# Successor probabilities of the Markov chain: peaked, so there is a lot to learn quickly.
_SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)
_ZIPF_EXPONENT = 1.1


@dataclass(frozen=True)
class Document:
    """One training sequence: ``input_ids`` and HF-style (unshifted) ``labels`` of equal length."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    kind: str

    def __len__(self) -> int:
        return self.input_ids.numel()


class SyntheticCorpus:
    """A seeded generator of documents over a vocabulary of ``vocab_size`` tokens.

    The language (successor table, response permutation) depends only on ``vocab_size`` and
    ``seed``, so train and eval documents drawn from two corpora with the same seed share it.
    """

    def __init__(self, vocab_size: int, seed: int = 0):
        if vocab_size < FIRST_CONTENT + 16:
            raise ValueError(f"vocab_size {vocab_size} is too small for synthetic data")
        self.vocab_size = vocab_size
        g = torch.Generator().manual_seed(seed)
        n = vocab_size - FIRST_CONTENT
        # Successors are drawn from a Zipf law over a shuffled vocabulary, as in text: a few
        # frequent tokens give a quick first drop in loss, and rare ones reach the vocab's tail.
        zipf = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** _ZIPF_EXPONENT
        ranked = torch.randperm(n, generator=g)
        picks = torch.multinomial(zipf, n * len(_SUCCESSOR_PROBS), replacement=True, generator=g)
        self._successors = ranked[picks].view(n, len(_SUCCESSOR_PROBS))
        self._successor_probs = torch.tensor(_SUCCESSOR_PROBS)
        self._permutation = torch.randperm(n, generator=g)
        self._n_content = n

    def _markov(self, length: int, g: torch.Generator) -> list[int]:
        tok = int(torch.randint(0, self._n_content, (1,), generator=g))
        choices = torch.multinomial(self._successor_probs, length, replacement=True, generator=g)
        out = []
        for c in choices.tolist():
            out.append(tok)
            tok = int(self._successors[tok, c])
        return [t + FIRST_CONTENT for t in out]

    def lm_document(self, length: int, g: torch.Generator) -> Document:
        body = self._markov(length - 1, g)
        # Repeat an earlier span later in the document: predictable only by looking back.
        if len(body) >= 16 and float(torch.rand((), generator=g)) < 0.7:
            span = int(torch.randint(4, max(5, len(body) // 4), (), generator=g))
            src = int(torch.randint(0, len(body) - 2 * span + 1, (), generator=g))
            dst = int(torch.randint(src + span, len(body) - span + 1, (), generator=g))
            body[dst : dst + span] = body[src : src + span]
        ids = torch.tensor([BOS, *body])
        labels = ids.clone()
        labels[0] = IGNORE_INDEX  # BOS is never a target (the shift drops it anyway)
        return Document(ids, labels, "lm")

    def sft_dialogue(self, max_length: int, g: torch.Generator) -> Document:
        ids, labels = [BOS], [IGNORE_INDEX]
        turns = int(torch.randint(1, 4, (), generator=g))
        for _ in range(turns):
            room = max_length - len(ids) - 3  # USER, ASSISTANT, EOS
            if room < 4:
                break
            n = int(torch.randint(2, max(3, min(room // 2, 24) + 1), (), generator=g))
            prompt = self._markov(n, g)
            response = [
                int(self._permutation[t - FIRST_CONTENT]) + FIRST_CONTENT for t in reversed(prompt)
            ]
            masked = [USER, *prompt, ASSISTANT]
            ids += masked + response + [EOS]
            labels += [IGNORE_INDEX] * len(masked) + response + [EOS]
        return Document(torch.tensor(ids), torch.tensor(labels), "sft")

    def documents(
        self, n: int, min_len: int, max_len: int, kind: str, g: torch.Generator
    ) -> list[Document]:
        if kind not in DATA_KINDS:
            raise ValueError(f"unknown data kind {kind!r}; expected one of {DATA_KINDS}")
        docs = []
        for i in range(n):
            length = int(torch.randint(min_len, max_len + 1, (), generator=g))
            # Mixed batches alternate, so every batch has both kinds.
            is_sft = kind == "sft" or (kind == "mixed" and i % 2 == 1)
            if is_sft:
                docs.append(self.sft_dialogue(length, g))
            else:
                docs.append(self.lm_document(length, g))
        return docs


def make_batches(
    size: str | Size,
    steps: int,
    *,
    kind: str = "mixed",
    seed: int = 0,
) -> tuple[list[list[Document]], list[Document]]:
    """``steps`` training batches of documents and one eval batch, all deterministic in ``seed``."""
    s = SIZES[size] if isinstance(size, str) else size
    corpus = SyntheticCorpus(s.vocab_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    train = [
        corpus.documents(s.docs_per_step, s.min_doc_len, s.max_doc_len, kind, g)
        for _ in range(steps)
    ]
    eval_docs = corpus.documents(s.docs_per_step, s.min_doc_len, s.max_doc_len, kind, g)
    return train, eval_docs


def collate_padded(docs: Sequence[Document]) -> dict[str, torch.Tensor]:
    """One document per row, right-padded with PAD; padded labels are -100."""
    width = max(len(d) for d in docs)
    input_ids = torch.full((len(docs), width), PAD, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(docs), width), dtype=torch.long)
    for row, d in enumerate(docs):
        input_ids[row, : len(d)] = d.input_ids
        labels[row, : len(d)] = d.labels
        attention_mask[row, : len(d)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


_FLATTEN = DataCollatorWithFlattening(return_tensors="pt")


def collate_packed(docs: Sequence[Document]) -> dict[str, torch.Tensor]:
    """All documents in one row, as ``DataCollatorWithFlattening`` makes it: ``position_ids``
    restart at 0 for each document and each document's first label is -100."""
    features = [{"input_ids": d.input_ids.tolist(), "labels": d.labels.tolist()} for d in docs]
    return dict(_FLATTEN(features))


def collate(docs: Sequence[Document], layout: str) -> dict[str, torch.Tensor]:
    if layout == "padded":
        return collate_padded(docs)
    if layout == "packed":
        return collate_packed(docs)
    raise ValueError(f"unknown layout {layout!r}; expected 'padded' or 'packed'")
