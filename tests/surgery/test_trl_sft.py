"""``surgery.integrations.trl_sft.SFTTrainer``: with the patch's default options it trains as
``trl.SFTTrainer`` does (loss, metrics, parameters); with ``loss_reduction="sequence"`` and a
z-loss its loss, z-loss and gradients are those of an fp32 reference on each document's logits
alone, and the z-loss is logged; settings that compute TRL's loss themselves, and a head surgery
does not serve, refuse the options instead of dropping them."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import surgery
import surgery.forwards.head as head_module
from surgery.integrations import trl as serving
from surgery.kernels import cross_entropy_reference
from tests.models.tiny import sequences, tiny_model, tiny_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from surgery.integrations.trl_sft import SFTTrainer  # noqa: E402  (needs trl)
from tests.surgery.test_trl_trainers import COMMON  # noqa: E402  (two steps, SGD, fp32 on CPU)


def _trainer(cls, model, tmp_path, padding_free, **settings):
    seqs = sequences([9, 3, 7, 5])
    data = datasets.Dataset.from_dict({"input_ids": [s.clamp(min=3).tolist() for s in seqs]})
    settings = {**COMMON, **settings}
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                         padding_free=padding_free, max_length=None, **settings)  # fmt: skip
    return cls(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer())


def _spy(monkeypatch):
    calls = []
    original = head_module.linear_cross_entropy_statistics

    def spy(*args, **kwargs):
        calls.append(kwargs.get("reduction"))
        return original(*args, **kwargs)

    monkeypatch.setattr(head_module, "linear_cross_entropy_statistics", spy)
    return calls


CASES = {"padded": ("llama", False), "padding-free": ("llama", True),
         "moe-padding-free": ("qwen3_moe", True)}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_default_options_train_as_trls_own_sft_trainer(case, tmp_path, monkeypatch):
    """The MoE case: TRL adds the router's load-balancing loss (logged as ``aux_loss``)."""
    arch, padding_free = CASES[case]
    calls = _spy(monkeypatch)
    runs = {}
    for cls in (SFTTrainer, trl.SFTTrainer):
        model = surgery.patch(tiny_model(arch))
        trainer = _trainer(cls, model, tmp_path / cls.__module__, padding_free)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        runs[cls] = logs, {n: p.detach().clone() for n, p in model.named_parameters()}
    assert calls and set(calls) == {"mean"}, "surgery's loss never ran"
    (logs, params), (want_logs, want_params) = runs[SFTTrainer], runs[trl.SFTTrainer]
    assert len(logs) == len(want_logs) == 2
    for got, want in zip(logs, want_logs):
        keys = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "grad_norm")
        for key in keys + (("aux_loss",) if arch == "qwen3_moe" else ()):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, want in want_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-4, atol=1e-6)


def _documents_logits(model, input_ids, position_ids):
    """The logits of each document of the packed row run alone through ``model``, in order."""
    starts = [*(position_ids[0] == 0).nonzero().flatten().tolist(), input_ids.shape[1]]
    pieces = [model(input_ids=input_ids[:, a:b]).logits for a, b in itertools.pairwise(starts)]
    return torch.cat(pieces, dim=1)


def test_sequence_mean_and_z_loss_are_the_loss_trained_and_logged(tmp_path):
    z_scale = 1e-2
    model = surgery.patch(tiny_model("llama"), loss_reduction="sequence", z_loss_scale=z_scale)
    reference = tiny_model("llama")
    trainer = _trainer(SFTTrainer, model, tmp_path, padding_free=True)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert batch["position_ids"].eq(0).sum() == 2, "the batch packs two documents"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "options do not apply" warning
        loss = trainer.compute_loss(model, batch)
    labels, position_ids = batch["labels"], batch["position_ids"]
    logits = _documents_logits(reference, batch["input_ids"], position_ids)
    want = cross_entropy_reference(logits, labels, reduction="sequence", position_ids=position_ids,
                                   z_loss_scale=z_scale, shift=True)  # fmt: skip
    token_mean = cross_entropy_reference(logits, labels, position_ids=position_ids, shift=True)
    assert abs(want.loss - token_mean.loss) > 1e-3, "the two reductions must differ here"
    torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.loss.backward()
    got_grads = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(got_grads[name].grad, param.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    metrics = trainer._metrics["train"]
    assert metrics["z_loss"][-1] == pytest.approx(want.z_loss.item(), rel=1e-5)
    assert "entropy" in metrics and "mean_token_accuracy" in metrics


def test_evaluation_with_compute_metrics_gets_the_logits_trls_trainer_gives(tmp_path):
    """``Trainer.evaluate`` with ``compute_metrics`` asks ``compute_loss`` for the outputs, whose
    logits it hands the metrics: the fused head's outputs hold none, so, as ``trl.SFTTrainer``,
    they come from a forward of their own (without the labels); the loss and the metrics equal
    TRL's trainer's."""
    results = {}
    for cls in (SFTTrainer, trl.SFTTrainer):
        model = surgery.patch(tiny_model("llama"))
        trainer = _trainer(cls, model, tmp_path / cls.__module__, padding_free=False)
        trainer.eval_dataset = trainer.train_dataset
        logits = []
        trainer.compute_metrics = lambda p, seen=logits: seen.append(p.predictions) or {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[cls] = trainer.evaluate(), logits[0]
    (got, got_logits), (want, want_logits) = results[SFTTrainer], results[trl.SFTTrainer]
    assert got_logits.shape[-1] == tiny_model("llama").config.vocab_size
    torch.testing.assert_close(torch.as_tensor(got_logits), torch.as_tensor(want_logits))
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_a_trl_setting_that_computes_the_loss_itself_refuses_the_options(tmp_path):
    model = surgery.patch(tiny_model("llama"), z_loss_scale=1e-3)
    trainer = _trainer(SFTTrainer, model, tmp_path, padding_free=False, loss_type="dft")
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with pytest.raises(ValueError, match=r"z_loss_scale=0.001.*loss_type='dft'"):
        trainer.compute_loss(model, batch)


def test_a_head_surgery_does_not_serve_refuses_the_options(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "CHECKED", ())
    calls = _spy(monkeypatch)
    for options in ({"loss_reduction": "sequence"}, {}):
        model = surgery.patch(tiny_model("llama"), **options)
        trainer = _trainer(SFTTrainer, model, tmp_path, padding_free=True)
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if options:
                with pytest.raises(RuntimeError, match="does not serve TRL's fused head"):
                    trainer.compute_loss(model, batch)
            else:  # no option set: TRL's own head and loss
                assert trainer.compute_loss(model, batch).isfinite()
    assert not calls
