"""The README's quick start runs as written: on a tiny model and tokenizer saved locally, loaded
through the same ``from_pretrained`` calls (only the checkpoint name is replaced), offline."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def save_tiny_checkpoint(path: Path, code: str) -> None:
    """A tiny Qwen3 and a word-level tokenizer over the quick start's words, saved at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.models.tiny import tiny_model

    words = sorted(set(re.findall(r"\w+|[^\w\s]", " ".join(re.findall(r'"([^"]*)"', code)))))
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(path)
    model = tiny_model("qwen3")
    assert len(vocab) <= model.config.vocab_size
    model.save_pretrained(path)


def test_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    code = quick_start()
    name = re.search(r'^name = "([^"]+)"', code, re.M)
    assert name, "the quick start names its checkpoint in `name = ...`"
    save_tiny_checkpoint(tmp_path, code)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(code.replace(name[1], str(tmp_path)), str(README), "exec"), {})
    loss = float(re.search(r"loss (\d+\.\d+)", capsys.readouterr().out)[1])
    assert torch.isfinite(torch.tensor(loss)) and loss > 0
