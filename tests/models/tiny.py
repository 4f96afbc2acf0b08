"""Tiny configurations of every supported architecture, and batches to feed them (no downloads)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 131  # odd on purpose
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
    pad_token_id=0,
)


def _llama():
    return LlamaConfig(**_COMMON, head_dim=HEAD_DIM)


def _mistral():
    return MistralConfig(**_COMMON, head_dim=HEAD_DIM, sliding_window=5)


def _qwen2():
    return Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1)


def _qwen3():
    return Qwen3Config(
        **_COMMON, head_dim=HEAD_DIM, use_sliding_window=True, sliding_window=5, max_window_layers=1
    )


def _gemma():
    return GemmaConfig(**_COMMON, head_dim=HEAD_DIM)


def _gemma2():
    return Gemma2Config(
        **_COMMON,
        head_dim=HEAD_DIM,
        sliding_window=5,
        query_pre_attn_scalar=HEAD_DIM,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )


def _gemma3():
    return Gemma3TextConfig(
        **_COMMON,
        head_dim=HEAD_DIM,
        sliding_window=5,
        query_pre_attn_scalar=HEAD_DIM,
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
        },
    )


CONFIGS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
}
ARCHS = list(CONFIGS)


# Gemma2 has no sdpa path in transformers (its attention-logit softcap needs eager).
NO_SDPA = {"gemma2"}


def attn_for(arch: str, attn: str = "sdpa") -> str:
    return "eager" if arch in NO_SDPA else attn


def tiny_config(arch: str):
    return CONFIGS[arch]()


def tiny_model(arch: str, attn: str = "sdpa", dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch), dtype=dtype, attn_implementation=attn_for(arch, attn)
    )
    # Non-trivial norm weights (Gemma's start at zero, Llama's at one) so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def twin(model):
    """An unpatched copy with identical parameters."""
    return copy.deepcopy(model)


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def kwargs(self) -> dict:
        out = {"input_ids": self.input_ids, "labels": self.labels}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        return out

    def to(self, device):
        return Batch(
            *(
                None if t is None else t.to(device)
                for t in (self.input_ids, self.labels, self.attention_mask, self.position_ids)
            )
        )


def sequences(lengths, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def padded_batch(seqs) -> Batch:
    """Right-padded rows, pads masked in attention_mask and labels (-100)."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return Batch(ids, labels, attention_mask=mask)


def left_padded_batch(seqs) -> Batch:
    """Left-padded rows, every real token a label: the prediction from a row's last pad position
    to its first real token is trained, as transformers trains it. Every pad position is a query
    row that attends to no key."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    return Batch(ids, ids.masked_fill(mask == 0, -100), mask)


def packed_batch(seqs, mask_first: bool = True) -> Batch:
    """One row, position ids restarting at every sequence, no attention mask: what
    DataCollatorWithFlattening makes (it sets each sequence's first label to -100)."""
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = []
    for s in seqs:
        lab = s.clone()
        if mask_first:
            lab[0] = -100
        labels.append(lab)
    return Batch(ids, torch.cat(labels)[None], position_ids=pos)


def loss_and_grads(model, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one forward and the gradient of every trainable parameter (by name)."""
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


def assert_grads_close(got: dict, want: dict, rtol: float, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
