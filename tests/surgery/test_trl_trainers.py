"""TRL's trainers with a patched model: each trains, a few steps, to the parameters and metrics
of the same trainer with TRL's own head on the same patched model (serving turned off by
declaring the installed TRL release unchecked), and surgery's kernel is what ran."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import surgery
import surgery.forwards.head as head_module
from surgery.integrations import trl as serving
from tests.models.tiny import sequences, tiny_model, tiny_tokenizer

head_api = importlib.import_module("surgery.kernels.linear_cross_entropy.api")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

STEPS = 2
COMMON = dict(
    max_steps=STEPS,
    learning_rate=0.1,
    optim="sgd",  # linear in the gradients: Adam would amplify rounding where a gradient is ~0
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    logging_steps=1,
    seed=0,
    data_seed=0,
    dataloader_num_workers=0,
    bf16=False,  # TRL's configs default to bf16 autocast; fp32 compares tightly
)


def _prompts():
    return [" ".join(f"t{i}" for i in range(3 + k, 6 + 2 * k)) for k in range(4)]


def _reward(completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


def _sft(model, tmp_path, padding_free, common):
    seqs = sequences([9, 3, 7, 6])  # token counts differ between the batches
    data = datasets.Dataset.from_dict({"input_ids": [s.clamp(min=3).tolist() for s in seqs]})
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                         padding_free=padding_free, max_length=None, **common)  # fmt: skip
    return trl.SFTTrainer(model=model, args=args, train_dataset=data,
                          processing_class=tiny_tokenizer())  # fmt: skip


def _policy_gradient(model, tmp_path, kind, common):
    """GRPO or RLOO (``kind``): two completions of four tokens per prompt, a length reward."""
    config, trainer = {"grpo": (trl.GRPOConfig, trl.GRPOTrainer),
                       "rloo": (trl.RLOOConfig, trl.RLOOTrainer)}[kind]  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": _prompts()})
    args = config(output_dir=str(tmp_path), per_device_train_batch_size=4, beta=0.0,
                  num_generations=2, max_completion_length=4, **common)  # fmt: skip
    return trainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                   processing_class=tiny_tokenizer())  # fmt: skip


def _kto(model, tmp_path, _, common):
    prompts = _prompts()
    data = datasets.Dataset.from_dict({
        "prompt": prompts,
        "completion": [" t9 t8 t7", " t4", " t5 t6", " t11 t12"],
        "label": [True, False, True, False],
    })  # fmt: skip
    ref = surgery.patch(tiny_model("llama", seed=1))
    args = trl.KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **common)
    return trl.KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=data,
                          processing_class=tiny_tokenizer())  # fmt: skip


TRAINERS = {
    "sft-padded": (_sft, False),
    "sft-padding-free": (_sft, True),
    "grpo": (_policy_gradient, "grpo"),
    "rloo": (_policy_gradient, "rloo"),
    "kto": (_kto, None),
}


def _train(name, tmp_path, monkeypatch, serve, **settings):
    """Train with surgery serving TRL's head (``serve``) or TRL's own head; ``settings`` replace
    ``COMMON``'s (the GPU test: ``use_cpu=False, bf16=True``)."""
    build, flag = TRAINERS[name]
    calls, factors = [], []
    original, scale = head_module.linear_log_probs, head_api.scale_by_upstream_

    def spy(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    def scale_spy(t, g):  # the factor the backward scales the forward's gradients by
        factors.append(float(g))
        return scale(t, g)

    with monkeypatch.context() as patch:
        patch.setattr(head_module, "linear_log_probs", spy)
        patch.setattr(head_api, "scale_by_upstream_", scale_spy)
        if not serve:
            patch.setattr(serving, "CHECKED", ())
        model = surgery.patch(tiny_model("llama"))
        trainer = build(model, tmp_path / ("served" if serve else "trl"), flag,
                        {**COMMON, **settings})  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return params, logs, calls, factors


@pytest.mark.parametrize("name", list(TRAINERS), ids=list(TRAINERS))
def test_trainer_trains_as_with_trls_own_head(name, tmp_path, monkeypatch):
    params, logs, calls, factors = _train(name, tmp_path, monkeypatch, serve=True)
    want_params, want_logs, trl_calls, _ = _train(name, tmp_path, monkeypatch, serve=False)
    assert any(calls), f"{name}: surgery's kernel never served a training call"
    assert not trl_calls
    if name.startswith("sft"):
        # From the second step, the gradients made in the forward are for TRL's own token-mean
        # upstream gradient: nothing left to scale (no pass over the weight gradient).
        assert factors and all(f == 1.0 for f in factors), factors
    assert len(logs) == len(want_logs) == STEPS
    for got, want in zip(logs, want_logs):
        for key, value in want.items():
            if isinstance(value, float) and not key.endswith(("time", "runtime", "per_second")):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    moved = 0
    for param, want in want_params.items():
        torch.testing.assert_close(params[param], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=param: f"{n}: {m}")  # fmt: skip
        moved += not torch.equal(want, tiny_model("llama").state_dict()[param])
    assert moved, "no parameter moved: the comparison would be empty"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sft-padding-free", "grpo"])
def test_gpu_trainer_bf16_within_the_budget_of_trls_own_head(name, tmp_path, monkeypatch):
    """On the GPU, under the Trainer's bf16 autocast (TRL's default), surgery's head moves the
    parameters within 1.5 times the error of TRL's own head, both against TRL's head in fp32. One
    process trains on one GPU: with more visible the Trainer would take nn.DataParallel, which TRL
    refuses, so the Trainer is shown one."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = dict(use_cpu=False)
    params, _, calls, _ = _train(name, tmp_path, monkeypatch, serve=True, bf16=True, **gpu)
    theirs, *_ = _train(name, tmp_path, monkeypatch, serve=False, bf16=True, **gpu)
    exact, *_ = _train(name, tmp_path, monkeypatch, serve=False, bf16=False, **gpu)
    assert any(calls)
    start = tiny_model("llama").state_dict()

    def moved(p):
        return torch.cat([(p[n] - start[n].float()).flatten() for n in sorted(p)])

    ref = moved(exact)
    err, err_trl = (float((moved(p) - ref).norm() / ref.norm()) for p in (params, theirs))
    assert ref.norm() > 0
    assert err <= 1.5 * err_trl + 1e-4, f"{err:.3e} vs TRL's own head {err_trl:.3e}"
