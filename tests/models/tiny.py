"""Tiny configurations of every supported architecture, and batches to feed them (no downloads)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

import surgery
from surgery.convergence.mini import MiniSize
from surgery.convergence.minis import mini_config

VOCAB = 131  # odd on purpose
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8

# Every architecture's tiny model has this shape; what makes it differ from Llama comes from its
# mini config (``surgery.convergence.minis``; transformers' config class alone where the table has
# no entry), so a new spec is tested here with no other edit.
TINY = MiniSize(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=256,
    sliding_window=5,  # shorter than the longest test sequences (7)
)

# config.model_type -> spec, in the registry's order: the architectures the tests run.
SPECS = surgery.supported()
ARCHS = list(SPECS)


def attn_for(arch: str, attn: str = "sdpa") -> str:
    """``attn``, unless the architecture needs another (Gemma2: eager)."""
    return mini_config(SPECS[arch]).attention(attn)


def sized_config(arch: str, **size):
    """The config of ``arch`` at another size: the tiny size with the fields ``size`` names
    replaced (``vocab_size=32_000``, ...), every argument the spec derives from the size derived
    again (Gemma 3n/4's per-layer tables, Mistral 4's head split)."""
    return mini_config(SPECS[arch]).build(dataclasses.replace(TINY, **size), pad_token_id=0)


def tiny_config(arch: str, **overrides):
    """The tiny config of ``arch`` (a ``config.model_type``); ``overrides`` replace any argument."""
    return mini_config(SPECS[arch]).build(TINY, **{"pad_token_id": 0, **overrides})


def gemma4_moe_config(size: MiniSize = TINY, **overrides):
    """Gemma 4's mini config with its mixture of experts (``GEMMA4_MOE_ARGUMENTS``; the
    registry's tiny Gemma 4 is dense) at ``size``; ``overrides`` replace any argument."""
    from surgery.convergence.minis.gemma import GEMMA4_MOE_ARGUMENTS

    mini = mini_config(SPECS["gemma4_text"])
    moe = dataclasses.replace(mini, arguments={**mini.arguments, **GEMMA4_MOE_ARGUMENTS})
    return moe.build(size, **{"pad_token_id": 0, **overrides})


def causal_lm_from_config(config, **kwargs):
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` through the spec's own class:
    transformers maps Mistral 4's config to its causal LM under ``AutoModelForImageTextToText``
    only."""
    spec = SPECS[config.model_type]
    return spec.causal_lm_class()._from_config(config, **kwargs)


def tiny_model(arch: str, attn: str = "sdpa", dtype=torch.float32, seed: int = 0, **overrides):
    """The tiny model of ``arch`` (``overrides``: config arguments replaced, ``tiny_config``)."""
    torch.manual_seed(seed)
    model = causal_lm_from_config(
        tiny_config(arch, **overrides), dtype=dtype, attn_implementation=attn_for(arch, attn)
    )
    # Non-trivial norm weights (Gemma's start at zero, Llama's at one) so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        # Gemma 3n scales every token by its embedding's root mean square, whose gradient is NaN
        # at zero: give the padding token (whose row transformers zeroes) an embedding of its own,
        # as a trained checkpoint has. Other architectures keep theirs (their budgets were set so).
        if arch == "gemma3n_text":
            embed = model.get_input_embeddings()
            embed.weight[embed.padding_idx].normal_(std=model.config.initializer_range)
    return model


def twin(model):
    """An unpatched copy with identical parameters."""
    return copy.deepcopy(model)


def unpatched_packs_exactly(arch: str) -> bool:
    """Whether unpatched transformers (without a KV cache) keeps the documents of a packed row
    apart. Not in a hybrid model: its linear-attention layers carry their recurrent state from one
    document into the next; nor in Llama 4, whose query temperature (and, in transformers 5.17,
    whose chunks) follow the token's index in the row. Tests that take the unpatched model as the
    reference on packed rows then give it the same documents padded, each in a row of its own."""
    spec = SPECS[arch]
    position_dependent = spec.attention_temperature or spec.chunked_attention
    return spec.linear_attention is None and not position_dependent


def attention_modules(model, arch: str) -> list:
    """The modules of ``model`` that the spec of ``arch`` patches as attention, in order (a
    hybrid's linear-attention layers are not among them)."""
    spec = SPECS[arch]
    return [m for m in model.modules() if spec.is_instance(m, spec.attention)]


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


def tiny_tokenizer():
    """A word-level tokenizer whose ids are exactly the tiny models' vocabulary: [PAD] 0, [UNK]
    1, t2 (also the end of sequence) to t130; for the trainers that want a processing class."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", eos_token="t2"
    )
