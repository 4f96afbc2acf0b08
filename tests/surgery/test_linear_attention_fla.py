"""The linear-attention layers of hybrid models through flash-linear-attention
(``surgery.integrations.fla``, ``surgery.attention.linear``).

On CPU, fla's kernels do not run: ``StandIn`` has their signatures and computes each document
alone with a reference (a per-token delta-rule recurrence, a per-document convolution, the gated
norm in fp32), and records what it was given. Against transformers' layers run on each document
alone, the patched model's loss, every gradient and every logit show that surgery's path through
those entry points is transformers' math with the documents kept apart: packed rows, padded rows
(their real tokens only), whole rows. On the GPU (``-m gpu``), fla's real kernels against
transformers' PyTorch path run on each document alone, within the dtype's budget."""

from __future__ import annotations

import importlib
import inspect
import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import surgery
from surgery.attention.linear import DOCUMENTS_KWARG, padded_documents
from surgery.integrations import fla
from tests.models import test_hybrid
from tests.models import test_multimodal as multimodal
from tests.models.test_hybrid import HYBRIDS, alone, lm_only
from tests.models.tiny import (
    SPECS,
    assert_grads_close,
    left_padded_batch,
    loss_and_grads,
    packed_batch,
    padded_batch,
    sequences,
    sized_config,
    tiny_model,
    twin,
)
from tests.utils import FP32_CLOSE as TOL
from tests.utils import assert_close_budget, assert_step_within_drift

LENGTHS = [9, 6, 11]  # each longer than the convolution window (4 tokens)


def _documents(x: torch.Tensor, cu_seqlens, cu_seqlens_cpu):
    """The documents of (b, t, ...) as (1, length, ...) pieces, after checking fla's varlen
    contract: batch 1, int64 offsets on the tensor's device, the host copy equal."""
    if cu_seqlens is None:
        assert cu_seqlens_cpu is None
        return [x[i : i + 1] for i in range(x.shape[0])]
    assert x.shape[0] == 1 and cu_seqlens.dtype == torch.long
    assert cu_seqlens.device == x.device and cu_seqlens_cpu.device.type == "cpu"
    assert cu_seqlens.tolist() == cu_seqlens_cpu.tolist() and cu_seqlens_cpu[-1] == x.shape[1]
    bounds = cu_seqlens_cpu.tolist()
    return [x[:, a:b] for a, b in itertools.pairwise(bounds)]


class StandIn:
    """fla's ``causal_conv1d``, ``chunk_gated_delta_rule`` and ``rms_norm_gated`` (their
    signatures, as far as surgery calls them), each document computed alone in fp32; ``calls``
    records (entry point, tokens, document lengths)."""

    def __init__(self):
        self.calls: list[tuple[str, int, tuple[int, ...] | None]] = []
        self.kernels = fla.LinearAttentionKernels(
            conv=self.conv, delta_rule=self.delta_rule, gated_norm=self.gated_norm, name="stand-in"
        )

    def _record(self, name, x, cu_seqlens_cpu):
        lengths = None if cu_seqlens_cpu is None else tuple(cu_seqlens_cpu.diff().tolist())
        self.calls.append((name, x.shape[0] * x.shape[1], lengths))

    def conv(self, x, weight=None, bias=None, residual=None, initial_state=None,
             output_final_state=False, activation=None, backend="triton", cu_seqlens=None,
             cu_seqlens_cpu=None, **kwargs):  # fmt: skip
        assert residual is None and initial_state is None and activation in ("silu", "swish")
        self._record("conv", x, cu_seqlens_cpu)
        width = weight.shape[-1]
        out = []
        for doc in _documents(x, cu_seqlens, cu_seqlens_cpu):
            y = F.conv1d(doc.float().transpose(1, 2), weight.float()[:, None], bias,
                         padding=width - 1, groups=weight.shape[0])  # fmt: skip
            out.append(F.silu(y[..., : doc.shape[1]]).transpose(1, 2))
        return torch.cat(out, dim=1 if cu_seqlens is not None else 0).to(x.dtype), None

    def delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                   cu_seqlens_cpu=None, **kwargs):  # fmt: skip
        assert initial_state is None and not output_final_state and use_qk_l2norm_in_kernel
        assert g.dtype == torch.float32 and (g <= 0).all()
        self._record("delta_rule", q, cu_seqlens_cpu)
        out = []
        pieces = [_documents(t, cu_seqlens, cu_seqlens_cpu) for t in (q, k, v, g, beta)]
        for dq, dk, dv, dg, db in zip(*pieces):
            out.append(_recurrence(dq, dk, dv, dg, db, scale))
        return torch.cat(out, dim=1 if cu_seqlens is not None else 0).to(v.dtype), None

    def gated_norm(self, x, g, weight, bias=None, activation="swish", residual=None,
                   prenorm=False, residual_in_fp32=False, eps=1e-6):  # fmt: skip
        assert bias is None and residual is None and activation == "swish"
        self._record("gated_norm", x[None], None)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (h * F.silu(g.float())).to(x.dtype)


def _recurrence(q, k, v, g, beta, scale):
    """The gated delta rule token by token on (1, t, h, d) (grouped value heads: each query and
    key head serves hv / h value heads), queries and keys L2-normalised as fla does
    (``x / sqrt(sum(x^2) + 1e-6)``), in fp32."""
    group = v.shape[2] // q.shape[2]
    q, k = (x.float() / (x.float().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    v, g, beta = v.float(), g.float(), beta.float()
    state = q.new_zeros(v.shape[2], q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        state = state * g[0, t].exp()[:, None, None]
        delta = (v[0, t] - torch.einsum("hk,hkv->hv", k[0, t], state)) * beta[0, t][:, None]
        state = state + k[0, t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[0, t], state))
    return torch.stack(out)[None]


def assert_packed_as_alone(model, reference, **kwargs) -> None:
    """``model``'s loss and gradients on ``LENGTHS`` documents packed in one row are
    ``reference``'s on each document alone."""
    seqs = sequences(LENGTHS)
    want_loss, want_grads, _ = alone(reference, seqs, **kwargs)
    loss, grads = loss_and_grads(model, **packed_batch(seqs).kwargs(), **kwargs)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)


@pytest.fixture
def stand_in(monkeypatch):
    """fla's kernels, for every device, are the stand-in's."""
    kernels = StandIn()
    monkeypatch.setattr(fla, "linear_attention_kernels", lambda device: kernels.kernels)
    return kernels


@pytest.mark.parametrize("arch", HYBRIDS)
def test_packed_row_through_fla_trains_as_if_alone(arch, stand_in):
    """Three documents in one packed row: loss, gradients and logits are each document's alone
    through transformers' layers, and every fla entry point ran the row with its documents."""
    model = tiny_model(arch).train()
    reference = twin(model)
    seqs = sequences(LENGTHS)
    packed = packed_batch(seqs).kwargs()
    want_loss, want_grads, want_logits = alone(reference, seqs, **lm_only(arch))
    surgery.patch(model)
    loss, grads = loss_and_grads(model, **packed, **lm_only(arch))
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    with torch.no_grad():
        logits = model(**{k: v for k, v in packed.items() if k != "labels"}, **lm_only(arch))
    torch.testing.assert_close(logits.logits[0], want_logits, **TOL)
    layers = sum(t == "linear_attention" for t in model.config.layer_types)
    assert [c for c in stand_in.calls if c[0] == "delta_rule"] == [
        ("delta_rule", sum(LENGTHS), tuple(LENGTHS))
    ] * (2 * layers)


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_runs_its_real_tokens(arch, side, stand_in):
    """A padded training batch (right or left): fla is given each row's real tokens alone, as
    one row of documents, and the loss and gradients are transformers' on the padded batch."""
    model = tiny_model(arch).train()
    reference = twin(model)
    seqs = sequences([7, 12, 4], seed=4)
    batch = (padded_batch if side == "right" else left_padded_batch)(seqs).kwargs()
    want_loss, want_grads = loss_and_grads(reference, **batch, **lm_only(arch))
    surgery.patch(model)
    loss, grads = loss_and_grads(model, **batch, **lm_only(arch))
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads_close(grads, want_grads, **TOL)
    assert {c[1:] for c in stand_in.calls if c[0] != "gated_norm"} == {(23, (7, 12, 4))}


@pytest.mark.parametrize("arch", HYBRIDS)
def test_whole_rows_through_fla(arch, stand_in):
    """Rows without padding or packing (no mask, no position ids): fla runs the batch as it is,
    no ``cu_seqlens``; an eval forward's logits are transformers'."""
    model = tiny_model(arch).eval()
    reference = twin(model)
    surgery.patch(model)
    ids = torch.stack(sequences([10, 10], seed=5))
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
        want = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **TOL)
    assert {c[1:] for c in stand_in.calls if c[0] != "gated_norm"} == {(20, None)}


def test_generation_and_gapped_masks_keep_transformers_forward(stand_in):
    """A KV cache (generation, an eval forward with the config's use_cache) and a mask whose real
    tokens are not one run per row never reach fla: transformers' forward runs them, and its
    results come out."""
    test_hybrid.test_generate_and_padded_eval_match_unpatched("qwen3_5_text")
    assert stand_in.calls == []
    model = tiny_model("qwen3_5_text").eval()
    reference = twin(model)
    surgery.patch(model)
    ids = torch.stack(sequences([8, 8], seed=6))
    mask = torch.ones_like(ids)
    mask[0, 3] = 0  # a gap: transformers runs the row with a zero there
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want_logits = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(logits[mask.bool()], want_logits[mask.bool()], **TOL)
    assert stand_in.calls == []


def test_padded_documents_layout():
    """Right, left and gapped masks -> the real tokens' flat indices and offsets, or None."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]])
    docs = padded_documents(mask)
    assert docs.tokens.tolist() == [0, 1, 2, 5, 6, 7, 12, 13]
    assert docs.cu_seqlens.tolist() == [0, 3, 6, 8] and docs.gather is None
    assert padded_documents(torch.ones(2, 4, dtype=torch.long)) is None
    assert padded_documents(torch.tensor([[1, 0, 1, 1]])) is None


def test_fla_entry_points_checked(monkeypatch):
    """An fla whose entry point lacks an argument surgery passes is not used (a warning, and
    ``fla_status`` says why); off CUDA nothing is imported."""

    def module(name, **functions):
        mod = types.ModuleType(name)
        mod.__dict__.update(functions)
        monkeypatch.setitem(sys.modules, name, mod)

    def conv(x, weight, bias=None, activation=None, cu_seqlens=None):  # no cu_seqlens_cpu
        raise AssertionError("not to be called")

    module("fla")
    module("fla.modules")
    module("fla.modules.causal_conv1d", causal_conv1d=conv)
    module("fla.modules.norm")
    module("fla.modules.norm.fused_norm_gate", rms_norm_gated=StandIn().gated_norm)
    module("fla.ops")
    module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=StandIn().delta_rule)
    fla._fla.cache_clear()
    try:
        assert fla.linear_attention_kernels(torch.device("cpu")) is None
        with pytest.warns(UserWarning, match=r"causal_conv1d takes no \['cu_seqlens_cpu'\]"):
            assert fla.linear_attention_kernels(torch.device("cuda")) is None
        assert "cu_seqlens_cpu" in fla.fla_status(torch.device("cuda"))
    finally:
        fla._fla.cache_clear()


def test_describe_without_fla(monkeypatch):
    """Without fla installed, describe says what installing the extra would do."""
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None)
    model = tiny_model("qwen3_5_text")
    surgery.patch(model)
    assert fla.EXTRA in str(surgery.describe(model))


def test_layout_unknown_to_fla_keeps_padded_path(stand_in):
    """A linear-attention module whose layout fla's path does not know (here: no ``A_log``) is
    never given to fla: its packed documents run padded through transformers' forward."""
    arch = "qwen3_5_text"
    model = tiny_model(arch).train()
    reference = twin(model)
    spec = SPECS[arch]
    for module in model.modules():
        if spec.is_instance(module, spec.linear_attention):
            module.activation = "gelu"  # not the SiLU fla's convolution applies
    for module in reference.modules():
        if spec.is_instance(module, spec.linear_attention):
            module.activation = "gelu"
    surgery.patch(model)
    assert "a layout fla's path does not know" in str(surgery.describe(model))
    assert_packed_as_alone(model, reference)
    assert stand_in.calls == []


def test_documents_kwarg_reaches_no_attention_layer(stand_in):
    """The documents are for the linear-attention layers: the attention layers drop them."""
    model = tiny_model("qwen3_5_text").eval()
    surgery.patch(model)
    seen = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and "Linear" not in type(module).__name__:
            module.register_forward_pre_hook(
                lambda m, a, kw: seen.append(DOCUMENTS_KWARG in kw), with_kwargs=True
            )
    with torch.no_grad():
        model(**{k: v for k, v in packed_batch(sequences(LENGTHS)).kwargs().items()
                 if k != "labels"}, use_cache=False)  # fmt: skip
    assert seen and stand_in.calls


# ------------------------------------------------------------------------------------------------
# GPU: fla's own kernels

needs_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or fla.linear_attention_kernels(torch.device("cuda")) is None,
    reason="needs CUDA and flash-linear-attention",
)

# Documents that cross fla's 64-token chunks, at widths where the chunked kernels tile.
GPU_LENGTHS = [150, 37, 200]
GPU_SIZE = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2)


def _torch_path(monkeypatch, arch):
    """transformers' PyTorch Gated DeltaNet in the reference model (with fla installed,
    transformers' layers pick fla's kernels by themselves)."""
    module = importlib.import_module(SPECS[arch].module)
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        monkeypatch.setattr(module, name, inspect.unwrap(getattr(module, name)))


@pytest.mark.gpu
@needs_fla
def test_fla_release_is_checked():
    """The installed fla takes every argument surgery passes and is a checked release."""
    kernels = fla.linear_attention_kernels(torch.device("cuda"))
    assert kernels.name.split()[-1].startswith(tuple(f"{c}." for c in fla.CHECKED))


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernels_against_transformers_alone(arch, dtype, monkeypatch):
    """fla's kernels on a packed row: the loss and every gradient against transformers'
    PyTorch path in fp32 on each document alone, within the dtype's budget of transformers' own
    error with fla (transformers' default once fla is installed) on each document alone. The
    PyTorch path computes the recurrence in fp32 whatever the dtype; fla computes in the dtype
    with fp32 accumulation, and its fp32 products run in TF32 (measured on the H200: 3.9e-4
    relative on an embedding gradient where the fp32 PyTorch path is 3e-7 from fp64), so the
    budget is fla's own error, not the PyTorch path's. The gradients are one whole step's,
    held as the model-step tests hold theirs (``assert_step_within_drift``: one parameter's
    error is a draw with a wide spread; on the H200, Qwen3.5's bf16 ``A_log`` gradient came
    1.09e-2 from fp32 where transformers with fla came 4.5e-3, 2.4x, inside the per-parameter
    3x)."""
    device = torch.device("cuda")
    config = sized_config(arch, **GPU_SIZE)
    torch.manual_seed(0)
    base = (
        SPECS[arch]
        .causal_lm_class()
        ._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    )
    base = base.to(device).train()
    models = {name: twin(base).to(dtype) for name in ("patched", "eager")}
    surgery.patch(models["patched"])
    seqs = [s.to(device) for s in sequences(GPU_LENGTHS, seed=7)]
    packed = {k: v.to(device) for k, v in packed_batch(seqs).kwargs().items()}
    loss, grads = loss_and_grads(models["patched"], **packed, **lm_only(arch))
    with monkeypatch.context() as torch_path:
        _torch_path(torch_path, arch)
        ref_loss, ref_grads, _ = alone(base, seqs, **lm_only(arch))
    eager_loss, eager_grads, _ = alone(models["eager"], seqs, **lm_only(arch))
    assert_close_budget(loss[None], ref_loss[None], eager_loss[None], dtype, "loss")
    assert_step_within_drift(grads, ref_grads, eager_grads, dtype, arch)


@pytest.mark.parametrize("pair", ["qwen3_5_text-qwen3_5", "qwen3_5_moe_text-qwen3_5_moe"])
def test_multimodal_wrapper_packed_through_fla(pair, stand_in):
    """A Qwen3.5 multimodal wrapper, two image chats packed into one row with (4, 1, seq)
    position ids: its linear-attention layers run the row through fla with the documents of the
    text row, and the loss and every gradient (vision tower included) are each chat's alone
    through transformers."""
    spec, wrapper = multimodal.PAIRS[pair]
    model = multimodal.tiny_vlm(spec, wrapper)
    model.config.text_config.output_router_logits = False  # one statistic of the whole batch
    reference = twin(model)
    surgery.patch(model)
    rows = multimodal.image_batch(model, wrapper)
    lengths = (multimodal.SEQ, multimodal.SEQ - 3)
    docs, packed = [], {k: [] for k in ("input_ids", "mm_token_type_ids", "position_ids")}
    for row, length in enumerate(lengths):
        ids = rows["input_ids"][row : row + 1, :length]
        kinds = rows["mm_token_type_ids"][row : row + 1, :length]
        grid = rows["image_grid_thw"][row : row + 1]
        rope, _ = model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid)
        pixels = rows["pixel_values"].view(2, -1, rows["pixel_values"].shape[-1])[row]
        docs.append(dict(input_ids=ids, mm_token_type_ids=kinds, image_grid_thw=grid,
                         pixel_values=pixels, labels=ids))  # fmt: skip
        packed["input_ids"].append(ids)
        packed["mm_token_type_ids"].append(kinds)
        packed["position_ids"].append(torch.cat([torch.arange(length).view(1, 1, -1), rope]))
    batch = {k: torch.cat(v, dim=-1) for k, v in packed.items()}
    batch["labels"] = torch.cat([d["labels"].masked_fill(torch.arange(n) == 0, -100)
                                 for d, n in zip(docs, lengths)], dim=-1)  # fmt: skip
    batch.update(pixel_values=rows["pixel_values"], image_grid_thw=rows["image_grid_thw"])
    loss, grads = loss_and_grads(model, **batch)
    reference.zero_grad(set_to_none=True)
    targets = sum(n - 1 for n in lengths)
    want = sum(reference(**d, use_cache=False).loss * (n - 1) / targets
               for d, n in zip(docs, lengths))  # fmt: skip
    want.backward()
    want_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    torch.testing.assert_close(loss, want.detach(), **TOL)
    assert_grads_close({n: grads[n] for n in want_grads}, want_grads, **TOL)
    assert {c[1:] for c in stand_in.calls if c[0] == "delta_rule"} == {(sum(lengths), lengths)}


def test_training_step_makes_no_cache_where_fla_runs(stand_in, monkeypatch):
    """Where fla runs the layers, a training step with labels makes no KV cache from the
    config's use_cache (with one the layers would run transformers' forward); without fla it
    returns transformers' cache, and a use_cache=True passed is kept either way."""
    model = surgery.patch(tiny_model("qwen3_5_text").train())
    batch = padded_batch(sequences([7, 4])).kwargs()

    def cache(**kwargs):  # the field transformers 5.24 renamed from past_key_values
        out = model(**batch, **kwargs)
        return out.get("cache", out.get("past_key_values"))

    with torch.no_grad():
        assert cache() is None
        assert cache(use_cache=True) is not None
        monkeypatch.setattr(fla, "linear_attention_kernels", lambda device: None)
        assert cache() is not None


def test_zero3_partitioned_weights_keep_the_padded_path(stand_in):
    """Weights DeepSpeed ZeRO-3 partitions (marked ``ds_id``) are gathered only around their own
    modules' forwards, which the fla path does not call for the convolution and the norm: such
    a layer runs its packed documents padded through transformers' forward."""
    arch = "qwen3_5_text"
    model = tiny_model(arch).train()
    reference = twin(model)
    spec = SPECS[arch]
    surgery.patch(model)
    for module in model.modules():
        if spec.is_instance(module, spec.linear_attention):
            module.norm.weight.ds_id = 0
    assert_packed_as_alone(model, reference)
    assert stand_in.calls == []
