"""Patched fp32 models under ``torch.autocast`` (bf16, fp16): what HF Trainer(bf16=True) and
accelerate's ``mixed_precision="bf16"`` run.

The bar is the unpatched model under the same autocast, same weights, same batch. Budget: the
unpatched model's own drift. Autocast moves the unpatched model's loss and gradients away from its
fp32 answer (no autocast) by the error of the autocast dtype; the patched model's distance from
that fp32 answer is held to the unpatched model's: the loss by the TOLERANCES margin of the
autocast dtype (``assert_close_budget``: factor 1.5 and floor 2e-3 for bf16, 5e-4 for fp16), the
gradients by ``MODEL_STEP`` (``assert_step_within_drift``: the median over the parameters of
their error ratios between 0.5 and 1.25, each parameter within 3x plus the dtype's floor). A
kernel that lost precision everywhere, or kept more than autocast asks, moves the median; one
parameter's gradient 1% off fails on its own (seen: an RMSNorm weight gradient scaled by 1.01
fails every fp16 case at 3.6x its budget).
Every recompute option is on (the default); recomputing is bit for bit keeping, under autocast too.
A mixture of experts runs all three steps with the fp32 step's routing replayed, and the patched
step's own routing decisions may differ from it only where rounding can tip a near tie
(``routing_helpers``): otherwise one such token compares two different functions.

Each comparison pools ``INSTANCES`` (4) models of other seeds: every error is the norm of the
difference over all of them against the norm of the fp32 answer over all of them. One instance is
too noisy a measure of one parameter: the patched and unpatched runs round differently, a correct
patch's error is the unpatched one's give or take chance (median ratio 1.0 over 1,140
single-instance comparisons, 10 seeds of every case, on a 2-core Xeon), and the chance is wide
where a gradient is a small sum of terms that cancel (a hybrid's dt_bias and A_log, one value per
linear-attention value head; q/k norm weights of 8) or where the whole step amplifies rounding
(Gemma 3n and 4 in bf16). Held to 1.5x per parameter, single instances put 4.6% of those
comparisons over budget, up to 3.9x it (Qwen3-Next's dt_bias, 4 values). Qwen3.5's failed so on
a fresh clone of another CPU, at 7.8e-4 against 7.6e-4 (fp16, packed): no precision was lost
there (its linear attention got the same inputs, bit for bit, and upstream gradients 4.8e-4 from
fp32 against the unpatched 4.6e-4; an upstream gradient perturbed at random by the same 4.7e-4
moves that dt_bias gradient by 3.5e-4 to 1.1e-3 over 200 draws), only a 4-value sum measured once.
Hybrids get 16 value heads here (``HYBRID_VALUE_HEADS``), as the GPU test gives them 32.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import surgery
from surgery.forwards import recompute
from tests.models.tiny import (
    ARCHS,
    SPECS,
    attn_for,
    causal_lm_from_config,
    left_padded_batch,
    packed_batch,
    padded_batch,
    sequences,
    sized_config,
    tiny_model,
    twin,
    unpatched_packs_exactly,
)
from tests.surgery import routing_helpers
from tests.surgery.routing_helpers import replayed_steps
from tests.utils import ListDataset, assert_close_budget, assert_step_within_drift, tolerance

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LENGTHS = [7, 5, 3]
KEEP = {"recompute_mlp_product": False, "recompute_norm_output": False}


def batch_of(kind: str):
    seqs = sequences(LENGTHS)
    make = {"packed": packed_batch, "padded": padded_batch, "left": left_padded_batch}[kind]
    return make(seqs).kwargs()


def step(model, batch, dtype=None, backward_inside=False, **kwargs):
    """Loss of one training forward under autocast (none when ``dtype`` is None) and the gradient
    of every parameter, the backward called outside the autocast region (as HF Trainer and
    accelerate do) or inside it."""
    model.zero_grad(set_to_none=True)
    region = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
    with region:
        loss = model(**batch, **kwargs).loss
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def assert_within_drift(arch, name, dtype, got, want, ref):
    """``got`` (patched, autocast) against ``ref`` (unpatched, fp32) within the budget that
    ``want`` (unpatched, same autocast) sets; dtypes equal to the unpatched model's."""
    (loss, grads), (want_loss, want_grads), (ref_loss, ref_grads) = got, want, ref
    assert loss.dtype == want_loss.dtype == torch.float32
    assert_close_budget(loss, ref_loss, want_loss, dtype, f"{arch} {name} loss")
    assert grads.keys() == want_grads.keys()
    for param in want_grads:
        assert grads[param].dtype == want_grads[param].dtype, param
    assert_step_within_drift(grads, ref_grads, want_grads, dtype, f"{arch} {name}")


# Rounding instances pooled in each comparison: the same architecture, dtype and layout on models
# of this many seeds, every error the norm over all of them (module docstring).
INSTANCES = range(4)
# A hybrid's dt_bias and A_log hold one value per linear-attention value head: the tiny configs'
# 4 are as noisy a measure as one instance (module docstring); Qwen3.5's checkpoints have 32.
HYBRID_VALUE_HEADS = 16


def autocast_model(arch: str, seed: int):
    overrides = {}
    if SPECS[arch].linear_attention is not None:
        overrides["linear_num_value_heads"] = HYBRID_VALUE_HEADS
    return tiny_model(arch, seed=seed, **overrides).train()


def pooled(runs: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, grads) of several instances as one: the losses side by side, each parameter's
    gradients concatenated, so that ``rel_err`` is the norm of the error over all instances
    against the norm of the reference over all of them."""
    losses = torch.stack([loss for loss, _ in runs])
    grads = {name: torch.cat([g[name].flatten() for _, g in runs]) for name in runs[0][1]}
    return losses, grads


def instance_steps(model, arch, name, kind, what, **patch_options):
    """(reference, unpatched, patched) steps of one model: the unpatched fp32 and autocast steps
    and the patched autocast step, a mixture of experts routing every run as the fp32 one
    (``routing_helpers``)."""
    dtype = AUTOCAST_DTYPES[name]
    unpatched = twin(model)
    patched = surgery.patch(model, **patch_options)
    batch = want_batch = batch_of(kind)
    # unpatched transformers keeps packed sequences apart only without a KV cache, and in a
    # hybrid model not at all: there its reference is the same documents padded
    extra = {"use_cache": False} if kind == "packed" else {}
    if kind == "packed" and not unpatched_packs_exactly(arch):
        want_batch, extra = batch_of("padded"), {}
    return replayed_steps(
        model,
        lambda: step(unpatched, want_batch, **extra),
        lambda: step(unpatched, want_batch, dtype, **extra),
        lambda: step(patched, batch, dtype),
        want_batch,
        batch,
        tolerance(dtype, batch["input_ids"].device)["factor"],
        what,
    )


def compare(arch, name, kind, seeds=INSTANCES, build=autocast_model, **patch_options):
    runs = [
        instance_steps(
            build(arch, seed),
            arch,
            name,
            kind,
            f"{arch} {name} {kind} seed {seed}",
            **patch_options,
        )
        for seed in seeds
    ]
    ref, want, got = (pooled([run[i] for run in runs]) for i in range(3))
    assert_within_drift(arch, name, AUTOCAST_DTYPES[name], got, want, ref)


@pytest.mark.parametrize("kind", ["padded", "packed", "left"])
@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_matches_unpatched_under_autocast(arch, name, kind):
    """Every architecture, the kernels' PyTorch path (fast on CPU)."""
    compare(arch, name, kind)


@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3_text"])
def test_training_step_matches_unpatched_under_autocast_triton(arch, name, interpreted):
    """The Triton kernels themselves (the interpreter on CPU): norms of both castings, Qwen3's and
    Gemma 3's q/k norms, Gemma 2's final softcap and eager attention."""
    compare(arch, name, "padded")


def test_routing_tie_is_replayed(monkeypatch):
    """A near tie that bf16 rounding tips: in this tiny model (seed 14) the patched step would send
    one token of the second MoE layer, at an fp32 margin of 3.5e-5, to another expert than the
    unpatched step does, and without replaying the fp32 routing the experts' gradient is 0.33
    off where the budget is 7.9e-3. Replayed, the step passes and the flip is explained."""
    summaries = []
    check = routing_helpers.assert_flips_within_rounding

    def keep(*args, **kwargs):
        summaries.append(check(*args, **kwargs))
        return summaries[-1]

    monkeypatch.setattr(routing_helpers, "assert_flips_within_rounding", keep)
    compare("qwen3_next", "bf16", "padded", seeds=[14], build=lambda arch, seed: tiny_model(
        arch, seed=seed).train())  # fmt: skip
    ((patched, unpatched),) = summaries
    # The case this test is about (if the kernels or the tiny config change, find another seed).
    assert sum(patched["flips"]) > sum(unpatched["flips"]), (patched, unpatched)


def topk_arguments(input, k, dim=-1, largest=True, sorted=True):
    """``topk``'s arguments, however the router passed them (Mistral 4 passes ``k`` by name)."""
    return input, k, dim, largest


def ranking_off_by(noise: float):
    """A router forward wrapper: its ``topk`` calls pick their experts from scores ``noise``
    (Gaussian) away from the scores they rank, and return the true scores of what they picked:
    a router choosing on wrong scores, its weights computed right."""

    class RankingOff(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in (torch.topk, torch.Tensor.topk):
                return func(*args, **kwargs)
            x, k, dim, largest = topk_arguments(*args, **kwargs)
            g = torch.Generator(device=x.device).manual_seed(0)
            off = x + noise * torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
            picked = func(off, k, dim=dim, largest=largest).indices
            return torch.return_types.topk((x.gather(dim, picked), picked))

    def wrap(forward):
        def ranked_off(*args, **kwargs):
            with RankingOff():
                return forward(*args, **kwargs)

        return ranked_off

    return wrap


@pytest.mark.parametrize("arch", ["mixtral", "llama4_text", "mistral4"])
def test_router_ranking_off_by_more_than_rounding_fails(arch, monkeypatch):
    """What the replay alone would hide: patched routers that choose on scores off by far more
    than rounding (0.1) but weigh the chosen experts right compute, with the fp32 routing
    replayed, the function of the unpatched model, within the budget; the patched run's own
    decisions give them away."""
    patch = surgery.patch

    def patch_with_routers_off(model, **options):
        patch(model, **options)
        for module in model.modules():
            if type(module).__name__.endswith("Router"):
                module.forward = ranking_off_by(0.1)(module.forward)
        return model

    monkeypatch.setattr(surgery, "patch", patch_with_routers_off)
    with pytest.raises(AssertionError, match="routing flip"):
        compare(arch, "bf16", "padded")


@pytest.mark.parametrize("low_memory", [False, True], ids=["eager", "recompute"])
def test_loss_schedules_under_autocast(low_memory):
    compare("gemma2", "bf16", "padded", loss_low_memory=low_memory)


@pytest.mark.parametrize("name", list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_eval_loss_and_logits_under_autocast(arch, name):
    """Outside training the patched model returns logits (lm_head under autocast, as unpatched)
    and the loss through ``cross_entropy``."""
    dtype = AUTOCAST_DTYPES[name]
    model = tiny_model(arch).eval()
    unpatched = twin(model)
    surgery.patch(model)
    batch = batch_of("padded")
    with torch.no_grad():
        ref = unpatched(**batch)
        with torch.autocast("cpu", dtype=dtype):
            want = unpatched(**batch)
            got = model(**batch)
    assert got.logits.dtype == want.logits.dtype
    assert got.loss.dtype == want.loss.dtype == torch.float32
    assert_close_budget(got.logits, ref.logits, want.logits, dtype, "logits")
    assert_close_budget(got.loss, ref.loss, want.loss, dtype, "loss")


def bf16_model_fp32_norms(arch):
    """bf16 weights but fp32 norm weights (as ``_keep_in_fp32_modules`` keeps some): bf16
    activations meet fp32 weights inside the norms, whose outputs the recompute rebuilds."""
    model = tiny_model(arch).to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith("norm"):
            module.float()
    return model


MODELS = {"fp32": lambda arch: tiny_model(arch), "bf16-fp32-norms": bf16_model_fp32_norms}
RECOMPUTE_CASES = [
    (arch, model, backward)
    for arch in ("llama", "qwen3", "gemma2")
    for model in MODELS
    for backward in ("outside", "inside")
]


@pytest.mark.parametrize(
    ("arch", "model", "backward"),
    RECOMPUTE_CASES,
    ids=[f"{a}-{m}-backward_{b}" for a, m, b in RECOMPUTE_CASES],
)
def test_recompute_is_bitwise_under_autocast(arch, model, backward, monkeypatch):
    """Under autocast, rebuilding the norm outputs and MLP products gives the loss and every
    gradient of keeping them, bit for bit, wherever the backward runs; and rebuilds happened."""
    rebuilds = []
    rebuild = recompute._Source.rebuild

    def counting(source):
        rebuilds.append(source.dtype)
        return rebuild(source)

    monkeypatch.setattr(recompute._Source, "rebuild", counting)
    base = MODELS[model](arch).train()
    kept = surgery.patch(twin(base), **KEEP)
    rebuilt = surgery.patch(base)
    batch = batch_of("padded")
    inside = backward == "inside"
    want_loss, want_grads = step(kept, batch, torch.bfloat16, backward_inside=inside)
    assert not rebuilds
    loss, grads = step(rebuilt, batch, torch.bfloat16, backward_inside=inside)
    assert rebuilds
    assert torch.equal(loss, want_loss)
    for name in want_grads:
        assert torch.equal(grads[name], want_grads[name]), name


@pytest.mark.parametrize("backward", ["outside", "inside_fp16"])
def test_recompute_replays_the_forward_autocast_state(backward):
    """``recompute.register``: the rebuild runs under the autocast state of the forward, so an
    output that autocast shaped (here a bf16 product of fp32 tensors) is rebuilt bit for bit
    whether the backward runs outside autocast or under another one."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    w2 = torch.randn(16, 4, requires_grad=True)

    def run(rebuilt: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.mm(x, w)
            assert y.dtype == torch.bfloat16
            if rebuilt:
                recompute.register(y, torch.mm, x, w)
            with recompute.saved_tensor_scope(rebuilt):
                z = torch.mm(y, w2)  # saves y itself (already bf16) for w2's gradient
        region = (
            torch.autocast("cpu", dtype=torch.float16)
            if backward == "inside_fp16"
            else contextlib.nullcontext()
        )
        with region:
            return torch.autograd.grad(z.float().square().sum(), (x, w, w2))

    want = run(rebuilt=False)
    got = run(rebuilt=True)
    for g, wg in zip(got, want):
        assert torch.equal(g, wg)


def trainer_step(model, tmp_path, name, bf16):
    """One HF Trainer step (bf16=True: accelerate's autocast around the forward), SGD with lr 1:
    the parameter change is minus the gradient."""
    from transformers import Trainer, TrainingArguments

    rows = ListDataset([{"input_ids": s.tolist()} for s in sequences([9, 6, 7, 4], seed=3)])

    def collate(examples):
        return padded_batch([torch.tensor(e["input_ids"]) for e in examples]).kwargs()

    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the change is the gradient itself
        bf16=bf16,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    loss = torch.tensor(next(log["loss"] for log in trainer.state.log_history if "loss" in log))
    grads = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return loss, grads


def test_trainer_bf16_on_fp32_model(tmp_path):
    """The reported crash: Trainer(bf16=True) on an fp32 model. One step trains like unpatched."""
    model = tiny_model("llama")
    unpatched = twin(model)
    reference = twin(model)
    surgery.patch(model)
    got = trainer_step(model, tmp_path, "patched", bf16=True)
    want = trainer_step(unpatched, tmp_path, "unpatched", bf16=True)
    ref = trainer_step(reference, tmp_path, "fp32", bf16=False)
    # bf16=True really ran under autocast: the unpatched model moved away from its fp32 step.
    assert not torch.equal(want[1]["lm_head.weight"], ref[1]["lm_head.weight"])
    assert_within_drift("llama", "Trainer bf16", torch.bfloat16, got, want, ref)


GPU_VOCAB = 32_000  # a real vocabulary size
GPU_HEAD_DIM = 64


def gpu_model(arch: str, seed: int = 0):
    """An fp32 model of ``arch`` on CUDA with a real vocabulary and head_dim 64, so that the q/k
    norm weights hold 64 elements: a relative error over the 8 of the tiny configs is too noisy
    a measure for a per-parameter budget (two bf16 runs differ by up to 2x there by chance)."""
    config = sized_config(
        arch,
        vocab_size=GPU_VOCAB,
        hidden_size=4 * GPU_HEAD_DIM,
        intermediate_size=512,
        head_dim=GPU_HEAD_DIM,
        sliding_window=64,
        max_position_embeddings=1024,
    )
    if hasattr(config, "linear_num_value_heads"):
        # A hybrid's dt_bias and A_log hold one value per linear-attention value head: over the
        # tiny configs' 4 their relative error is as noisy (on the H100, Qwen3.5 dense: patched
        # 1.5e-2 against unpatched bf16's 2.2e-3 on dt_bias, an outlier of a ratio that ranges
        # 0.5-3.9 over seeds on CPU); Qwen3.5's checkpoints have 32 (16 key heads).
        config.linear_num_value_heads = 32
    torch.manual_seed(seed)
    model = causal_lm_from_config(config, attn_implementation=attn_for(arch))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.cuda().train()


def gpu_batch(kind: str, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, GPU_VOCAB, (n,), generator=g) for n in (301, 200, 57)]
    return (packed_batch(seqs) if kind == "packed" else padded_batch(seqs)).to("cuda").kwargs()


def cuda_step(model, batch, autocast, **kwargs):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_cuda_autocast_bf16_step(arch, kind):
    """CUDA autocast bf16 on an fp32 model at a real vocabulary size: loss and every parameter's
    gradient against the unpatched model under the same autocast, within its own drift."""
    model = gpu_model(arch)
    unpatched = twin(model)
    surgery.patch(model)
    batch = want_batch = gpu_batch(kind)
    # unpatched transformers keeps packed sequences apart only without a KV cache, and some
    # architectures not at all: there its reference is the same documents padded
    if kind == "packed" and not unpatched_packs_exactly(arch):
        want_batch = gpu_batch("padded")
    # a mixture of experts: every run routes as the fp32 one (routing_helpers)
    ref, want, got = replayed_steps(
        model,
        lambda: cuda_step(unpatched, want_batch, autocast=False, use_cache=False),
        lambda: cuda_step(unpatched, want_batch, autocast=True, use_cache=False),
        lambda: cuda_step(model, batch, autocast=True),
        want_batch,
        batch,
        tolerance(torch.bfloat16, want_batch["input_ids"].device)["factor"],
        f"{arch} {kind}",
    )
    assert_within_drift(arch, kind, torch.bfloat16, got, want, ref)
