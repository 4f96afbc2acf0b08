"""On the GPU machine (skipped without CUDA): bf16 training steps of every architecture against an
fp32 reference within the error budget of tests/utils.py, packed batches, and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import surgery
from tests.models.tiny import (
    ARCHS,
    attn_for,
    causal_lm_from_config,
    packed_batch,
    padded_batch,
    sized_config,
    tiny_config,
    unpatched_packs_exactly,
)
from tests.surgery.routing_helpers import replayed_steps
from tests.utils import TOLERANCES, assert_close_budget, rel_err

pytestmark = pytest.mark.gpu

VOCAB = 32_000  # a real vocabulary size
LENGTHS = [301, 200, 57]  # packed into one row of 558 tokens


def gpu_model(arch: str, attn: str = "sdpa", dtype=torch.float32, **size):
    config = sized_config(
        arch,
        **{
            "vocab_size": VOCAB,
            "hidden_size": 128,
            "intermediate_size": 256,
            "sliding_window": 64,
            "max_position_embeddings": 1024,
            **size,
        },
    )
    torch.manual_seed(0)
    model = causal_lm_from_config(config, attn_implementation=attn_for(arch, attn))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to("cuda", dtype).train()


def step(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch.kwargs(), **kwargs)
    out.loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return out.loss.detach().float(), grads


def batch_of(kind: str):
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]
    return (packed_batch(seqs) if kind == "packed" else padded_batch(seqs)).to("cuda")


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_step_within_budget(arch, kind):
    """Patched bf16 against unpatched fp32: the error may exceed unpatched bf16's own error by the
    budget's factor and floor (loss and the concatenated gradient of every parameter). A mixture
    of experts routes as the fp32 run in all three, and the patched run's own decisions may
    differ from it only where rounding can tip them (``routing_helpers``)."""
    fp32 = gpu_model(arch)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    patched = surgery.patch(copy.deepcopy(bf16))
    batch = want_batch = batch_of(kind)
    # unpatched transformers keeps packed sequences apart only without a KV cache, and some
    # architectures not at all: there its reference is the same documents padded
    if kind == "packed" and not unpatched_packs_exactly(arch):
        want_batch = batch_of("padded")
    # a mixture of experts: every run routes as the fp32 one (routing_helpers)
    (ref_loss, ref_grads), (eager_loss, eager_grads), (loss, grads) = replayed_steps(
        fp32,
        lambda: step(fp32, want_batch, use_cache=False),
        lambda: step(bf16, want_batch, use_cache=False),
        lambda: step(patched, batch),
        want_batch.kwargs(),
        batch.kwargs(),
        TOLERANCES[torch.bfloat16]["factor"],
        f"{arch} {kind}",
    )
    assert_close_budget(loss, ref_loss, eager_loss, torch.bfloat16, what=f"{arch} loss")
    assert_close_budget(grads, ref_grads, eager_grads, torch.bfloat16, what=f"{arch} grads")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_packed_fp32_matches_sequences_one_by_one(arch):
    model = surgery.patch(gpu_model(arch))
    reference = gpu_model(arch)
    batch = batch_of("packed")
    loss, grads = step(model, batch)
    seqs, start = [], 0
    for n in LENGTHS:
        seqs.append(batch.input_ids[0, start : start + n])
        start += n
    n_tokens = sum(n - 1 for n in LENGTHS)
    reference.zero_grad(set_to_none=True)
    total = 0.0
    for s in seqs:
        part = reference(input_ids=s[None], labels=s[None]).loss * (len(s) - 1) / n_tokens
        part.backward()
        total += part.detach()
    want = torch.cat([p.grad.flatten() for p in reference.parameters()])
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(loss, torch.as_tensor(total), rtol=tol["rtol"], atol=tol["atol"])
    assert rel_err(grads, want) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_torch_compile_training_step(arch):
    model = surgery.patch(gpu_model(arch, dtype=torch.bfloat16))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    batch = batch_of("packed")
    for _ in range(2):  # the second call runs the compiled graph without recompiling
        loss, grads = step(compiled, batch)
    want_loss, want_grads = step(eager, batch)
    assert torch.isfinite(loss) and torch.isfinite(grads).all()
    tol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(loss, want_loss, rtol=tol["rtol"], atol=tol["atol"])
    assert rel_err(grads, want_grads) < tol["rtol"]


@pytest.mark.parametrize("padding", ["right", "left"])
def test_shared_attention_mask_within_budget_and_one_mask_kept(padding):
    """sdpa's masked backends keep the additive copy they make of a boolean mask, once per
    layer; with ``share_attention_mask`` one copy is kept for all layers. The bf16 step stays
    within the budget of the boolean-mask bf16 step against fp32 (left padding: fully masked
    query rows included, which get sdpa's zeros on both paths; the bitwise and fp32 checks of
    those rows are in test_attention_mask.py)."""
    config = tiny_config("llama")
    config.update(dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=8, max_position_embeddings=4096))  # fmt: skip
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().train()
    B, T = 2, 2048
    ids = torch.randint(1, VOCAB, (B, T), device="cuda")
    mask = torch.ones(B, T, dtype=torch.long, device="cuda")
    if padding == "right":
        mask[1, T // 2 :] = 0
    else:
        mask[1, : T // 2] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def run(dtype, share):
        # causal_right_padding off: the right-padded batch would otherwise run without a mask.
        model = surgery.patch(
            copy.deepcopy(base).to(dtype), share_attention_mask=share, causal_right_padding=False
        )
        for _ in range(2):  # the first step also allocates library workspaces: measure the second
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = model(**batch)
            kept = torch.cuda.memory_allocated() - before
            out.loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        return out.loss.detach().float(), grads, kept

    ref_loss, ref_grads, _ = run(torch.float32, False)
    bool_loss, bool_grads, bool_kept = run(torch.bfloat16, False)
    loss, grads, kept = run(torch.bfloat16, True)
    assert torch.isfinite(loss) and torch.isfinite(grads).all()
    assert_close_budget(loss, ref_loss, bool_loss, torch.bfloat16, what=f"{padding} loss")
    assert_close_budget(grads, ref_grads, bool_grads, torch.bfloat16, what=f"{padding} grads")
    mask_bytes = B * T * T * 2  # (B, 1, T, T) bf16
    saved = bool_kept - kept
    assert saved >= 0.9 * (config.num_hidden_layers - 1) * mask_bytes, (saved, mask_bytes)


def test_right_padding_runs_causal_within_budget():
    """``causal_right_padding``: the unmasked (flash) run of a right-padded bf16 batch against
    the fp32 masked reference, within the budget of the masked bf16 run."""
    fp32 = gpu_model("llama")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    batch = batch_of("padded")
    ref_loss, ref_grads = step(surgery.patch(fp32, causal_right_padding=False), batch)
    masked_loss, masked_grads = step(
        surgery.patch(copy.deepcopy(bf16), causal_right_padding=False), batch
    )
    loss, grads = step(surgery.patch(bf16), batch)
    assert_close_budget(loss, ref_loss, masked_loss, torch.bfloat16, what="loss")
    assert_close_budget(grads, ref_grads, masked_grads, torch.bfloat16, what="grads")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"])
def test_varlen_attention_within_budget(arch, monkeypatch):
    """``varlen_attention``: two packed bf16 rows (GQA, sliding windows of 64 on the sliding
    layers) through torch's varlen flash attention, against the fp32 masked reference, within
    the budget of the masked bf16 run; the kernel really ran, once per layer."""
    import surgery.attention.varlen as varlen

    windows = []
    real = varlen.varlen_kernel

    def counting(device):
        kernel = real(device)
        assert kernel is not None, "no varlen kernel on this GPU / torch"

        def run(*args, **kwargs):
            windows.append(kwargs["window_size"])
            return kernel(*args, **kwargs)

        return run

    monkeypatch.setattr(varlen, "varlen_kernel", counting)
    rows = [[301, 200, 57], [100, 380, 78]]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, 558), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
    labels = ids.masked_fill(pos == 0, -100)
    batch = {"input_ids": ids.cuda(), "position_ids": pos.cuda(), "labels": labels.cuda()}

    fp32 = gpu_model(arch)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)

    def run(model):
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        return out.loss.detach().float(), grads

    ref_loss, ref_grads = run(surgery.patch(fp32, varlen_attention=False))
    masked_loss, masked_grads = run(surgery.patch(copy.deepcopy(bf16), varlen_attention=False))
    assert windows == []
    loss, grads = run(surgery.patch(bf16))
    assert len(windows) == fp32.config.num_hidden_layers
    assert any(w != (-1, 0) for w in windows) == (arch != "llama"), windows
    assert_close_budget(loss, ref_loss, masked_loss, torch.bfloat16, what=f"{arch} loss")
    assert_close_budget(grads, ref_grads, masked_grads, torch.bfloat16, what=f"{arch} grads")


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_flex_attention_within_budget(kind, monkeypatch):
    """``flex_attention``: Gemma 2's softcapped attention through torch's compiled flex kernels,
    bf16, against the fp32 reference (unpatched, eager) within the budget of the eager
    attention's bf16 run (the option off); flex really ran in every layer (the rows are longer
    than the sliding window of 64, so its layers cut the blocks), training through its backward.
    Rows that attend to nothing stay with the eager function (``test_flex_attention.py``)."""
    from tests.surgery.test_flex_attention import recorded_flex_calls

    calls = recorded_flex_calls(monkeypatch)
    fp32 = gpu_model("gemma2", attn="eager", head_dim=32)  # flex takes heads of 16 and more
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in (301, 270, 250)]
    # right padding shorter than the window: every layer's rows attend to some key
    batch = (packed_batch(seqs) if kind == "packed" else padded_batch(seqs)).to("cuda")
    assert unpatched_packs_exactly("gemma2")
    ref_loss, ref_grads = step(fp32, batch, use_cache=False)
    eager_loss, eager_grads = step(surgery.patch(bf16, flex_attention=False), batch)
    assert calls == []
    loss, grads = step(surgery.patch(copy.deepcopy(bf16)), batch)
    assert calls == [True] * fp32.config.num_hidden_layers
    assert_close_budget(loss, ref_loss, eager_loss, torch.bfloat16, what=f"gemma2 {kind} loss")
    assert_close_budget(grads, ref_grads, eager_grads, torch.bfloat16, what=f"gemma2 {kind} grads")
