"""The HF Trainer with gradient accumulation on packed batches (DataCollatorWithFlattening): the
patched model trains like the unpatched one; and TRL's SFTTrainer keeps our RoPE."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.attention import forward as surgery_attention
from tests.models.tiny import VOCAB, sequences, tiny_model, tiny_tokenizer, twin
from tests.utils import ListDataset

STEPS = 2


def rows():
    # unequal lengths: micro-batches hold different numbers of tokens, which is what
    # num_items_in_batch normalises for
    seqs = sequences([9, 3, 7, 4, 6, 8, 5, 3], seed=3)
    return ListDataset([{"input_ids": s.tolist()} for s in seqs])


def train(model, tmp_path, name):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=0.5,
        optim="sgd",  # linear in the gradients: Adam would amplify rounding where a gradient is ~0
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=rows(), data_collator=DataCollatorWithFlattening()
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return trainer, losses


def test_trainer_gradient_accumulation_matches_unpatched(tmp_path):
    model = tiny_model("llama")
    reference = twin(model)
    # unpatched transformers keeps packed sequences apart under sdpa only without a KV cache
    reference.config.use_cache = False
    surgery.patch(model)

    trainer, losses = train(model, tmp_path, "patched")
    _, want = train(reference, tmp_path, "reference")

    assert trainer.model_accepts_loss_kwargs
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_trainer_sequence_reduction_is_scaled_per_micro_batch(tmp_path):
    model = surgery.patch(tiny_model("qwen3"), loss_reduction="sequence")
    trainer, losses = train(model, tmp_path, "sequence")
    # num_items_in_batch is never passed; the Trainer divides by the accumulation steps instead
    assert trainer.model_accepts_loss_kwargs is False
    assert len(losses) == STEPS and all(0 < x < 2 * torch.log(torch.tensor(VOCAB)) for x in losses)


def test_trl_sft_trainer_keeps_our_rope(tmp_path, monkeypatch):
    """SFTTrainer replaces the model's forward with its own fused lm_head (TRL >= 1.x) and calls the
    backbone directly: our loss is not used there, but our RoPE (on the attention modules) is."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    calls = []
    original = surgery_attention.apply_rope

    def spy(*args, **kwargs):
        calls.append(args[2])  # position_ids
        return original(*args, **kwargs)

    monkeypatch.setattr(surgery_attention, "apply_rope", spy)

    model = surgery.patch(tiny_model("llama"))
    data = datasets.Dataset.from_dict({"input_ids": [s.tolist() for s in sequences([9, 3, 7, 4])]})
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        per_device_train_batch_size=2,
        max_steps=1,
        padding_free=True,
        max_length=None,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
    )
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer()
    )
    trainer.train()
    assert calls, "our apply_rope did not run under SFTTrainer"
    # padding-free rows: position ids restart inside the row and reach apply_rope as such
    assert any((p[..., 1:] < p[..., :-1]).any() for p in calls)
    assert surgery.is_patched(model)
