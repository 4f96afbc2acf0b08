"""Models other code changed before ``surgery.patch``: another kernel library's patches are refused
with nothing changed, accelerate's hooks and mixed-precision wrapper are kept around the patched
forward (``surgery.patching.foreign``), and ``patch`` is all or nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn
from transformers.models.llama import modeling_llama

import surgery
from surgery.patching.foreign import ForeignForwardError, ForwardSlot
from surgery.patching.swap import ORIGINAL_ATTR
from tests.models.tiny import (
    assert_grads_close,
    loss_and_grads,
    padded_batch,
    sequences,
    tiny_model,
    twin,
)
from tests.utils import FP32_CLOSE as TOL

BATCH = padded_batch(sequences([7, 5, 3]))
REPO = Path(__file__).resolve().parents[2]


def snapshot(model: nn.Module) -> list[tuple[str, object, list[str]]]:
    """Every module's instance forward and surgery attributes: what a failed patch must not
    change."""
    return [
        (name, m.__dict__.get("forward"), sorted(a for a in m.__dict__ if "surgery" in a))
        for name, m in model.named_modules()
    ]


def with_module(function, module_name: str):
    function.__module__ = module_name
    return function


# ---------------------------------------------------------------------------------------------
# other libraries' patches: refused, nothing changed


def test_foreign_instance_forward_on_the_last_module_leaves_everything_unchanged():
    model = tiny_model("llama")
    inner = model.forward

    def outer(*args, **kwargs):  # a user's wrapper: patching would drop it
        return inner(*args, **kwargs)

    model.forward = outer
    before = snapshot(model)
    with pytest.raises(ForeignForwardError, match=r"test_foreign.*outer.*Nothing was changed"):
        surgery.patch(model)
    assert snapshot(model) == before
    assert not surgery.is_patched(model)


def test_failure_while_installing_undoes_every_swap(monkeypatch):
    model = tiny_model("qwen3")
    before = snapshot(model)
    installs = []
    original = ForwardSlot.install

    def failing(self, function):
        if len(installs) == 9:
            raise RuntimeError("injected")
        installs.append(self.module)
        return original(self, function)

    monkeypatch.setattr(ForwardSlot, "install", failing)
    with pytest.raises(RuntimeError, match="injected"):
        surgery.patch(model)
    assert len(installs) == 9
    assert snapshot(model) == before
    monkeypatch.undo()
    surgery.patch(model)  # and the model can still be patched
    assert surgery.is_patched(model)


def test_repatch_failure_keeps_the_previous_patch(monkeypatch):
    model = surgery.patch(tiny_model("llama"), z_loss_scale=1e-3)
    original, failures = ForwardSlot.install, []

    def fail_once_midway(self, function):
        if not failures and self.module is model.model.layers[1].mlp:
            failures.append(self.module)
            raise OSError("injected")
        return original(self, function)

    monkeypatch.setattr(ForwardSlot, "install", fail_once_midway)
    with pytest.raises(OSError, match="injected"):
        surgery.patch(model, z_loss_scale=1e-2)
    monkeypatch.undo()
    assert surgery.patch_options(model) == surgery.PatchOptions(z_loss_scale=1e-3)
    assert model.train()(**BATCH.kwargs()).z_loss is not None


def test_foreign_class_forward_is_refused(monkeypatch):
    def lce_forward(self, *args, **kwargs):
        raise AssertionError("never called")

    fake = with_module(lce_forward, "liger_kernel.transformers.model.llama")
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", fake)
    model = tiny_model("llama")
    before = snapshot(model)
    with pytest.raises(ForeignForwardError, match=r"lce_forward \(Liger-Kernel\)"):
        surgery.patch(model)
    assert snapshot(model) == before


def test_modules_are_matched_by_transformers_class_not_by_the_rebound_name(monkeypatch):
    """Another library rebinding ``LlamaRMSNorm`` in transformers' module: a model built before
    keeps transformers' norms and they are patched; a model built after holds the other class,
    which is refused by name."""
    built_before = tiny_model("llama")

    class LigerLikeRMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))

        def forward(self, hidden_states):
            return hidden_states * self.weight

    LigerLikeRMSNorm.__module__ = "liger_kernel.transformers.rms_norm"
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", LigerLikeRMSNorm)

    surgery.patch(built_before)
    norms = [m for m in built_before.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(ORIGINAL_ATTR in m.__dict__ for m in norms)

    built_after = tiny_model("llama")
    assert any(isinstance(m, LigerLikeRMSNorm) for m in built_after.modules())
    before = snapshot(built_after)
    with pytest.raises(ForeignForwardError, match=r"input_layernorm.*LigerLikeRMSNorm.*Liger"):
        surgery.patch(built_after)
    assert snapshot(built_after) == before


def test_rebound_rope_function_is_refused(monkeypatch):
    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q, k

    fake = with_module(liger_rotary_pos_emb, "liger_kernel.transformers.rope")
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", fake)
    model = tiny_model("llama")
    with pytest.raises(ForeignForwardError, match="apply_rotary_pos_emb is now liger_kernel"):
        surgery.patch(model)
    assert not surgery.is_patched(model)


LIGER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import surgery
    from surgery.patching.foreign import ForeignForwardError
    from tests.models.tiny import tiny_model
    import liger_kernel.transformers as liger

    def attempt(model):
        before = [(n, m.__dict__.get("forward")) for n, m in model.named_modules()]
        try:
            surgery.patch(model)
            error = None
        except ForeignForwardError as err:
            error = str(err)
        after = [(n, m.__dict__.get("forward")) for n, m in model.named_modules()]
        left = [n for n, m in model.named_modules() if any("surgery" in a for a in m.__dict__)]
        return {"error": error, "unchanged": before == after and not left,
                "patched": surgery.is_patched(model)}

    results = {}
    for arch in ("llama", "gemma2"):
        model = tiny_model(arch)
        liger._apply_liger_kernel_to_instance(model=model)
        results[arch + "-instance"] = attempt(model)
    liger.apply_liger_kernel_to_llama()  # class level, process-wide
    results["llama-class-built-after"] = attempt(tiny_model("llama"))
    print(json.dumps(results))
    """
)


def test_liger_patched_models_are_refused_in_a_fresh_process():
    """Liger-Kernel's own patches (its instance patch and its class-level patch): a clear refusal
    naming Liger-Kernel, and the model left exactly as Liger left it (a subprocess: Liger's
    class-level patches last for the whole process)."""
    pytest.importorskip("liger_kernel")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", LIGER_SCRIPT], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for case, result in results.items():
        assert result["error"] and "Liger-Kernel" in result["error"], (case, result)
        assert "Nothing was changed" in result["error"], (case, result)
        assert result["unchanged"] and not result["patched"], (case, result)


# ---------------------------------------------------------------------------------------------
# accelerate: hooks and the mixed-precision wrapper are kept


def test_device_map_with_disk_offloaded_layers(tmp_path):
    """``from_pretrained(device_map=...)`` with a decoder layer and the lm_head offloaded to disk:
    the patched forwards run inside accelerate's hooks (the offloaded weights are loaded for the
    call), the losses equal the unpatched model's, and unpatch puts the hooked forwards back."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    }

    def load(offload: str):
        return AutoModelForCausalLM.from_pretrained(
            tmp_path / "model", device_map=device_map, offload_folder=tmp_path / offload
        ).train()

    model, reference = load("a"), load("b")
    head_hook_forward = model.lm_head.__dict__["forward"]
    assert model.lm_head.weight.device.type == "meta"  # offloaded: loaded by the hook per call
    surgery.patch(model)
    assert surgery.is_patched(model)
    assert model.lm_head.__dict__["forward"] is head_hook_forward  # the hook is kept
    assert model.lm_head.__dict__["_old_forward"].__func__ is surgery.forwards.head.lm_head_forward

    with torch.no_grad():
        want = reference(**BATCH.kwargs())
        got = model(**BATCH.kwargs())
        assert got.logits is None  # the fused loss ran, reading the weight the hook loaded
        torch.testing.assert_close(got.loss, want.loss, **TOL)
        model.eval(), reference.eval()
        torch.testing.assert_close(
            model(**BATCH.kwargs()).logits, reference(**BATCH.kwargs()).logits, **TOL
        )

    surgery.unpatch(model)
    assert model.lm_head.__dict__["forward"] is head_hook_forward
    old = model.lm_head.__dict__["_old_forward"]
    assert old.__func__ is nn.Linear.forward and old.__self__ is model.lm_head


@pytest.mark.parametrize("order", ["hooks-then-patch", "patch-then-hooks"])
def test_accelerate_hooks_are_kept_in_training(order):
    """A hook on every module (as ``dispatch_model`` attaches), before or after ``patch``: each
    patched module's hook still runs around the patched forward, loss and gradients equal the
    unpatched model's, and unpatch puts transformers' forward back inside the hooks."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counter(ModelHook):
        calls: ClassVar[dict[str, int]] = {}

        def __init__(self, name):
            self.name = name

        def pre_forward(self, module, *args, **kwargs):
            Counter.calls[self.name] = Counter.calls.get(self.name, 0) + 1
            return args, kwargs

    model = tiny_model("gemma2").train()
    reference = twin(model)
    want_loss, want_grads = loss_and_grads(reference, **BATCH.kwargs())
    if order == "patch-then-hooks":
        surgery.patch(model)
    for name, module in model.named_modules():
        add_hook_to_module(module, Counter(name))
    surgery.patch(model)
    Counter.calls.clear()
    loss, grads = loss_and_grads(model, **BATCH.kwargs())
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    for name in ("", "lm_head", "model.layers.0.self_attn", "model.layers.1.mlp", "model.norm"):
        assert Counter.calls.get(name) == 1, name
    mlp = model.model.layers[0].mlp
    assert mlp._old_forward.__func__ is surgery.forwards.layers.gated_mlp_forward

    surgery.unpatch(model)
    assert mlp._old_forward.__func__ is type(mlp).forward and mlp._hf_hook is not None
    Counter.calls.clear()
    loss, _ = loss_and_grads(model, **BATCH.kwargs())
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    assert Counter.calls.get("lm_head") == 1


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield lambda **kw: Accelerator(cpu=True, **kw)
    AcceleratorState._reset_state(True)


def _projection_dtypes(model: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype)
    )
    return seen


@pytest.mark.parametrize("order", ["prepare-then-patch", "patch-then-prepare"])
def test_accelerate_mixed_precision_stays_on(accelerator, order):
    """``Accelerator(mixed_precision="bf16").prepare(model)`` before or after ``patch``: the
    patched forward runs under accelerate's autocast (projections in bf16), the fused loss equals
    the unpatched prepared model's within bf16 rounding, and unpatch leaves accelerate's wrapper
    around transformers' own forward."""
    acc = accelerator(mixed_precision="bf16")
    model = tiny_model("llama").train()
    reference = acc.prepare(twin(model))
    if order == "prepare-then-patch":
        model = surgery.patch(acc.prepare(model))
    else:
        model = acc.prepare(surgery.patch(model))
    seen = _projection_dtypes(model)
    out = model(**BATCH.kwargs())
    assert seen == [torch.bfloat16]
    assert out.logits is None  # fused
    want = reference(**BATCH.kwargs()).loss
    torch.testing.assert_close(out.loss, want, rtol=2e-2, atol=2e-2)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    surgery.unpatch(model)
    assert not surgery.is_patched(model)
    seen.clear()
    torch.testing.assert_close(model(**BATCH.kwargs()).loss, want, rtol=0, atol=0)
    assert seen == [torch.bfloat16]  # accelerate's autocast still wraps the forward
