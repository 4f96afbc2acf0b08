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

A real checkpoint's run (``python -m surgery.convergence --pretrained``) can train on the user's own
file instead (:func:`read_documents`): a ``.jsonl`` of ``{"text": ...}`` rows (language-model
documents) or chat ``{"messages": [...]}`` rows (rendered with the tokenizer's chat template, only
the assistant turns trained), or a plain ``.txt``. Each row, or each paragraph of the text, is one
document, cut to ``max_length`` tokens; :func:`split_batches` makes the same eval batch and
training batches of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from .configs import SIZES, Size

__all__ = [
    "ASSISTANT",
    "BOS",
    "DATA_FILE_SUFFIXES",
    "DATA_KINDS",
    "EOS",
    "IGNORE_INDEX",
    "PAD",
    "USER",
    "Document",
    "SyntheticCorpus",
    "chat_document",
    "collate",
    "collate_packed",
    "collate_padded",
    "make_batches",
    "read_documents",
    "split_batches",
    "synthetic_batches",
    "text_document",
]

PAD, BOS, EOS, USER, ASSISTANT = 0, 1, 2, 3, 4
FIRST_CONTENT = 5
IGNORE_INDEX = -100
DATA_KINDS = ("mixed", "lm", "sft")
DATA_FILE_SUFFIXES = (".jsonl", ".txt")

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
    return synthetic_batches(
        s.vocab_size, steps, s.docs_per_step, s.min_doc_len, s.max_doc_len, kind=kind, seed=seed
    )


def synthetic_batches(
    vocab_size: int,
    steps: int,
    docs_per_step: int,
    min_len: int,
    max_len: int,
    *,
    kind: str = "mixed",
    seed: int = 0,
) -> tuple[list[list[Document]], list[Document]]:
    """``steps`` batches of ``docs_per_step`` synthetic documents of ``min_len`` to ``max_len``
    tokens over ``vocab_size`` tokens, and one eval batch, all deterministic in ``seed``."""
    corpus = SyntheticCorpus(vocab_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    train = [corpus.documents(docs_per_step, min_len, max_len, kind, g) for _ in range(steps)]
    eval_docs = corpus.documents(docs_per_step, min_len, max_len, kind, g)
    return train, eval_docs


# ---------------------------------------------------------------------------------------------
# the user's own data, through the checkpoint's tokenizer


def _document(ids: list[int], labels: list[int], max_length: int, kind: str) -> Document | None:
    """``ids`` and ``labels`` cut to ``max_length``; None when no target is left (nothing to
    train). The first label is always -100: nothing predicts a document's first token."""
    ids, labels = ids[:max_length], labels[:max_length]
    if labels:
        labels[0] = IGNORE_INDEX
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return Document(torch.tensor(ids), torch.tensor(labels), kind)


def text_document(text: str, tokenizer: Any, max_length: int) -> Document | None:
    """A language-model document: ``text`` tokenized with the tokenizer's special tokens (its BOS,
    where it adds one) and EOS appended where the tokenizer has one, as packing pipelines do, so
    that the end of a document is learned; every token is a target. Cut to ``max_length``."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return _document(ids, list(ids), max_length, "lm")


def chat_document(
    messages: list[dict[str, Any]], tokenizer: Any, max_length: int
) -> Document | None:
    """A chat: ``messages`` rendered with the tokenizer's chat template; the tokens of every
    assistant turn (its content and whatever the template closes the turn with, e.g. an
    end-of-turn token) are targets, everything else (system and user turns, the template's
    assistant headers) is -100. A multi-turn chat is one document. Cut to ``max_length``.

    An assistant turn is the text that rendering ``messages[: i + 1]`` adds to rendering
    ``messages[:i]`` with the generation prompt; token i is a target when its first character
    falls in such a span (offsets from the tokenizer). That needs a template whose rendering of
    a chat's beginning is the beginning of the whole chat's rendering; one that rewrites earlier
    turns (drops their reasoning, say) is refused with an error rather than masked wrongly."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat rows need a tokenizer with a chat template; this one has none")

    def render(msgs, generation_prompt=False):
        return tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=generation_prompt
        )

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template renders a chat's first turns differently from the same turns "
                "inside the whole chat, so the assistant's tokens cannot be told apart"
            )
        spans.append((len(before), len(through)))
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:  # slow (Python) tokenizers have no offsets
        raise ValueError("chat rows need a fast tokenizer (character offsets)") from err
    ids = list(encoded["input_ids"])
    labels = [
        tok if any(a <= start < b for a, b in spans) else IGNORE_INDEX
        for tok, (start, _) in zip(ids, encoded["offset_mapping"])
    ]
    return _document(ids, labels, max_length, "sft")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not a JSON line ({err})") from None
            yield where, row


def _paragraphs(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    text = path.read_text(encoding="utf-8")
    paragraphs = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    if len(paragraphs) == 1:  # no blank lines: one document per line
        paragraphs = [line for line in text.splitlines() if line.strip()]
    for i, paragraph in enumerate(paragraphs, 1):
        yield f"{path}: paragraph {i}", {"text": paragraph.strip()}


def read_documents(
    path: str | Path, tokenizer: Any, *, max_length: int, limit: int | None = None
) -> list[Document]:
    """Documents from the user's file, in file order, at most ``limit`` of them (the rest of the
    file is not read), each cut to ``max_length`` tokens; documents left with no target are
    skipped.

    - ``.jsonl``: one JSON object a line, either ``{"text": "..."}`` (:func:`text_document`) or
      ``{"messages": [{"role": ..., "content": ...}, ...]}`` (:func:`chat_document`); other keys
      are ignored and both kinds may be mixed.
    - ``.txt``: paragraphs separated by blank lines, each a text document (a file without blank
      lines: each line).
    """
    path = Path(path)
    if path.suffix not in DATA_FILE_SUFFIXES:
        raise ValueError(f"{path}: expected a {' or '.join(DATA_FILE_SUFFIXES)} file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _paragraphs(path)
    docs: list[Document] = []
    for where, row in rows:
        if limit is not None and len(docs) >= limit:
            break
        try:
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                doc = chat_document(row["messages"], tokenizer, max_length)
            elif isinstance(row, dict) and isinstance(row.get("text"), str):
                doc = text_document(row["text"], tokenizer, max_length)
            else:
                raise ValueError('expected {"text": "..."} or {"messages": [...]}')
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if doc is not None:
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: no document with a token to train on")
    return docs


def split_batches(
    documents: Sequence[Document], steps: int, docs_per_step: int
) -> tuple[list[list[Document]], list[Document]]:
    """The eval batch and ``steps`` training batches of ``docs_per_step`` documents, in order.

    The first ``docs_per_step`` documents are the eval batch and are held out; training takes the
    rest in order and starts over when they run out. With no more documents than one batch, the
    eval batch is all of them and training reuses them too."""
    if docs_per_step < 1:
        raise ValueError("docs_per_step must be at least 1")
    docs = list(documents)
    held_out = len(docs) > docs_per_step
    eval_docs = docs[:docs_per_step]
    pool = docs[docs_per_step:] if held_out else docs
    stream = [pool[i % len(pool)] for i in range(steps * docs_per_step)]
    train = [stream[i : i + docs_per_step] for i in range(0, len(stream), docs_per_step)]
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
