"""The one generic attention forward: q/k/v projections, optional q/k norm, RoPE through
``apply_rope`` from the position ids, the KV cache, and transformers' attention interface.

The model's rotary module still runs once per forward, and the attention reads its frequencies at
call time instead of using the cos/sin tables it produced; except where they follow the sequence's
length (``LENGTH_DEPENDENT_ROPE``): the module rewrites those on every forward, so another forward
before the backward, activation checkpointing's second run of the layer, or a copy of the
attention (PEFT's ``modules_to_save``, whose copied rotary module never runs) would read other
frequencies than its own forward's. There the layer's cos/sin (``position_embeddings``, computed
in this forward and kept by checkpointing as the layer's argument) are rotated with surgery's
cos/sin kernel (``apply_rotary_pos_emb``).

Packed batches through flash attention's varlen kernel: ``surgery.attention.varlen``; the shared
sdpa mask: ``surgery.attention.shared_mask``; the lean eager attention: ``surgery.attention.eager``;
softcapped eager attention through flex attention: ``surgery.attention.flex``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from surgery.attention.chunked import (
    POSITIONS_KWARG,
    after_rope,
    chunked_layer_mask,
    is_chunked_layer,
)
from surgery.attention.eager import lean_eager_attention
from surgery.attention.flex import flex_layer, flex_runs, flex_softcap_attention
from surgery.attention.linear import DOCUMENTS_KWARG
from surgery.attention.shared_mask import SharedMask, shared_sdpa_mask, zero_unattended_rows
from surgery.attention.unpadding import (
    ROLLED_KWARG,
    UNPADDED_KWARG,
    Rolled,
    Unpadded,
    pad_heads,
)
from surgery.attention.varlen import (
    PACKED_KWARG,
    PackedSequences,
    flash_head_size,
    packed_sequences,
    varlen_attention,
)
from surgery.forwards import recompute
from surgery.forwards.layers import projections
from surgery.forwards.recompute import RECOMPUTE_ATTR, RecomputePlan
from surgery.kernels import apply_rope, apply_rotary_pos_emb
from surgery.kernels.rope import mrope_rows
from surgery.models import ArchitectureSpec
from surgery.patching.signature import cache_argument, in_signature_of, update_cache

__all__ = [
    "LENGTH_DEPENDENT_ROPE",
    "AttentionBinding",
    "PackedSequences",
    "SharedMask",
    "attention_forward",
    "attention_forward_for",
    "attention_interface",
    "attention_kwargs",
    "flash_head_size",
    "lean_eager_attention",
    "length_dependent",
    "mrope_layout",
    "packed_sequences",
    "position_query_scale",
    "read_path",
    "shared_sdpa_mask",
    "varlen_attention",
]


@dataclass(frozen=True)
class AttentionBinding:
    """What one patched attention module needs besides itself. Kept in the module's ``__dict__``
    (not as a submodule), so ``state_dict`` and ``named_modules`` are unchanged; ``deepcopy``
    maps ``rotary`` to the copy's rotary module (a copy of the whole model's; of the attention
    alone, PEFT's ``modules_to_save``, a private one that never runs: its frequencies are read only
    where they do not change, ``length_dependent``)."""

    spec: ArchitectureSpec
    rotary: nn.Module
    eager_attention: Callable
    fallback_rope: Callable | None
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``, for a caller that passes no
    position ids (the decoder layers of every supported model do, or their base model: see
    ``ArchitectureSpec.positions_to_attention``)."""
    share_mask: bool = True
    """Hand sdpa one additive mask shared by all layers instead of the boolean one."""
    mrope: tuple[tuple[int, int, int], bool] | None = None
    """Multimodal RoPE (``ArchitectureSpec.mrope``): ``apply_rope``'s ``mrope_section`` and
    ``mrope_interleaved``, read from the rotary module (``mrope_layout``); None: plain RoPE, or
    (an ``mrope`` spec whose rotary module's layout was not recognised) transformers' cos/sin."""
    lean_eager: bool = True
    """Run the eager implementation through ``lean_eager_attention``."""
    flex: bool = False
    """Run a softcapped eager attention through ``flex_softcap_attention`` where it can."""


BINDING_ATTR = "_surgery_attention"
MROPE_POSITIONS_KWARG = "surgery_mrope_positions"
"""The keyword argument, passed the same way from the base model (``surgery.forwards.base_model``),
that carries the positions a multimodal-RoPE model's rotary module takes: (3, batch, seq) temporal,
height and width rows, or (batch, seq) for the same position in all three (text)."""
CAUSAL_KWARG = "surgery_causal"
"""The keyword argument, passed the same way, saying the causal-LM forward dropped the padding mask
(``PatchOptions.causal_right_padding``): layers without a sliding window then run sdpa causal and
unmasked whatever mask the base model built (transformers builds a plain causal mask under
``torch.compile`` before torch 2.14 instead of letting sdpa's ``is_causal`` take it)."""


def attention_kwargs(module: nn.Module, spec: ArchitectureSpec) -> dict:
    """The attention's own arguments the spec names (``ArchitectureSpec.attention_kwargs``: a
    sliding window, a softcap), read from ``module`` now: None where one is missing."""
    return {name: read_path(module, path) for name, path in spec.attention_kwargs}


def read_path(obj, path: str):
    """The attribute at the dotted ``path`` of ``obj``, or None where one along it is missing."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def mrope_layout(rotary: nn.Module) -> tuple[tuple[int, int, int], bool] | None:
    """The multimodal-RoPE sections of a transformers rotary module, as ``apply_rope`` takes them
    (``mrope_section``, ``mrope_interleaved``): which position row (temporal, height, width) each
    frequency reads, found by running the module's own ``recomposition_frequencies`` (the step
    that picks each frequency's row when it builds cos/sin) on rows holding 0, 1 and 2, so that
    the layout is the rotary class's, whatever its config says. None when the module has no
    such step or its layout is neither of ``apply_rope``'s (contiguous, interleaved)."""
    half = rotary.inv_freq.shape[-1]
    # On the host whatever the default device (from_pretrained builds the model on meta, where
    # ``apply_<name>`` patches it): the step reads the probe and the sections alone.
    probe = torch.arange(3, dtype=torch.float32, device="cpu").view(3, 1, 1, 1)
    probe = probe.repeat(1, 1, 1, half)
    try:
        with torch.no_grad():
            rows = rotary.recomposition_frequencies(probe)[..., :half].reshape(-1)
    except (AttributeError, RuntimeError, IndexError, ValueError):
        return None
    rows = [int(r) for r in rows.round().tolist()]
    section = (rows.count(0), rows.count(1), rows.count(2))
    for interleaved in (False, True):
        if list(mrope_rows(half, section, interleaved)) == rows:
            return section, interleaved
    return None


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""transformers' RoPE types whose frequencies its rotary module rewrites from the sequence's
length on every forward (dynamic NTK past max_position_embeddings, LongRoPE's long factors; the
latter in place)."""


def length_dependent(rotary: nn.Module | None, layer_type: str | None = None) -> bool:
    """Whether a transformers ``rotary`` module's RoPE is of a ``LENGTH_DEPENDENT_ROPE`` type; of
    a module with a type per layer type (Gemma 3 and later), ``layer_type``'s, or (None) any."""
    rope_type = getattr(rotary, "rope_type", "default")
    if not isinstance(rope_type, dict):
        return rope_type in LENGTH_DEPENDENT_ROPE
    types = rope_type.values() if layer_type is None else [rope_type.get(layer_type)]
    return any(t in LENGTH_DEPENDENT_ROPE for t in types)


def rope_frequencies(module: nn.Module, binding: AttentionBinding) -> tuple[torch.Tensor, float]:
    rotary = binding.rotary
    if binding.spec.rope_per_layer_type:
        layer_type = module.layer_type
        return (
            getattr(rotary, f"{layer_type}_inv_freq"),
            getattr(rotary, f"{layer_type}_attention_scaling"),
        )
    return rotary.inv_freq, rotary.attention_scaling


def position_query_scale(
    module: nn.Module, spec: ArchitectureSpec, position_ids: torch.Tensor
) -> torch.Tensor:
    """The query scale of ``ArchitectureSpec.position_query_scale`` at (batch, seq) or (1, seq)
    ``position_ids``: transformers' ``get_llama_4_attn_scale`` of ``spec.module`` (imported: its
    classes built ``module``), (batch, 1, seq, 1) in fp32."""
    rope = module.config.rope_parameters
    scale = sys.modules[spec.module].get_llama_4_attn_scale
    return scale(
        position_ids, rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    )


def _shared_kv_key(module: nn.Module, reading: bool):
    """Where ``module`` reads (or stores) keys and values in ``shared_kv_states``: under its layer
    type; transformers 5.17's Gemma 3n keyed them by layer index (``kv_shared_layer_index`` of the
    storing layer)."""
    if hasattr(module, "kv_shared_layer_index"):
        return module.kv_shared_layer_index if reading else module.layer_idx
    return module.layer_type


def attention_interface(
    self: nn.Module,
    binding: AttentionBinding,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None, SharedMask | None]:
    """transformers' attention interface of the module's implementation on (B, H, T, D) query,
    key and value, with ``kwargs`` (dropout, scaling, ...) passed on: sdpa gets the one additive
    mask shared by every layer (``share_mask``), eager runs ``lean_eager_attention``
    (``lean_eager``). Returns its (output, weights) and the shared mask, if any, whose
    ``unattended`` rows the caller sets in o_proj's output (``zero_unattended_rows``)."""
    implementation = self.config._attn_implementation
    shared = None
    if binding.share_mask and implementation == "sdpa":
        # Under autocast sdpa runs in the autocast dtype whatever the queries' (fp32 queries come
        # from an fp32 q_norm): a mask built in fp32 would become -inf in fp16.
        device = query.device.type
        autocast = torch.is_autocast_enabled(device)
        mask_dtype = torch.get_autocast_dtype(device) if autocast else query.dtype
        shared = shared_sdpa_mask(attention_mask, mask_dtype)
        if shared is not None:
            attention_mask = shared.additive
    if implementation == "eager" and binding.lean_eager:
        interface = functools.partial(lean_eager_attention, eager=binding.eager_attention)
    else:
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, binding.eager_attention)
    attn_output, attn_weights = interface(self, query, key, value, attention_mask, **kwargs)
    return attn_output, attn_weights, shared


def attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    shared_kv_states=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention of every architecture (the module docstring): the projections
    (``_projected``), the q/k norms and RoPE (``_rotated``), the cache or the keys and values an
    earlier layer shares, then the attention: varlen over a packed batch's documents, or
    transformers' attention function (``_attend``), and the output projection."""
    cache = cache_argument(cache, kwargs)
    binding: AttentionBinding = self.__dict__[BINDING_ATTR]
    spec = binding.spec
    # A layer reusing an earlier layer's keys and values (spec.kv_sharing) has no k/v of its own.
    kv_shared = spec.kv_sharing and self.is_kv_shared_layer
    input_shape = hidden_states.shape[:-1]
    # The projections save hidden_states, the input norm's output: rebuilt in the backward when
    # the norm registered it (surgery.forwards.recompute).
    plan: RecomputePlan | None = self.__dict__.get(RECOMPUTE_ATTR)
    query, key, value, gate = _projected(self, spec, hidden_states, kv_shared, plan)
    # Llama 4's decoder layers pass no position_ids: its base model hands them on (spec field
    # positions_to_attention); on its layers without RoPE nothing is rotated.
    position_ids = kwargs.get("position_ids", kwargs.pop(POSITIONS_KWARG, None))
    if position_ids is not None and position_ids.shape[-1] > input_shape[-1]:
        # transformers ran this layer on the last positions alone (Gemma 4's kv-sharing layers
        # under an int logits_to_keep: hidden states, cos/sin and masks cut, not the position ids)
        position_ids = position_ids[..., -input_shape[-1] :]
    # A padding-free step (surgery.attention.unpadding): one row of real tokens, each at its own
    # position.
    unpadded: Unpadded | None = kwargs.pop(UNPADDED_KWARG, None)
    if unpadded is not None:
        position_ids = unpadded.positions
    # A left-padded step run rolled (surgery.attention.unpadding.Rolled): each token at the
    # position of its column in the caller's batch.
    rolled: Rolled | None = kwargs.pop(ROLLED_KWARG, None)
    if rolled is not None:
        position_ids = rolled.positions
    rope_positions = kwargs.pop(MROPE_POSITIONS_KWARG, None)
    query, key, per_row = _rotated(self, binding, query, key, position_ids, rope_positions,
                                   unpadded, position_embeddings, kv_shared, plan)  # fmt: skip

    if kv_shared:
        key, value = shared_kv_states[_shared_kv_key(self, reading=True)]
        key, value = key.to(query.device), value.to(query.device)  # a device map's other GPU
    elif cache is not None:
        key, value = update_cache(cache, key, value, self.layer_idx, kwargs)
    if spec.kv_sharing and self.store_full_length_kv:
        shared_kv_states[_shared_kv_key(self, reading=False)] = key, value

    dropout = self.attention_dropout if self.training else 0.0
    extra = attention_kwargs(self, spec)
    packed: PackedSequences | None = kwargs.pop(PACKED_KWARG, None)
    chunked = is_chunked_layer(self, spec)  # Llama 4: a packed batch's chunks come with it
    attention_mask = chunked_layer_mask(chunked, attention_mask, cache, kwargs)
    if kwargs.pop(CAUSAL_KWARG, False) and extra.get("sliding_window") is None and not chunked:
        attention_mask = None
    kwargs.pop(DOCUMENTS_KWARG, None)  # for the linear-attention layers of a hybrid model
    if chunked and packed is not None:
        # Each chunk of a document attends causally to itself: the documents' chunks, found
        # once per forward (none: the masked path).
        packed = packed.chunks
    direct = None  # the (b, t, heads, d) output where no transformers attention function runs
    if packed is not None and cache is None and _varlen_runs(self, query, value, dropout, extra):
        direct = varlen_attention(
            query, key, value, packed, self.scaling, extra.get("sliding_window")
        )
    elif (
        query.shape[-2] == key.shape[-2]  # no cached keys: training, a loss call, a prefill
        and unpadded is None
        and flex_layer(self, binding.flex, extra.get("softcap"))
        and flex_runs(query, dropout)
    ):
        direct = flex_softcap_attention(
            self, query, key, value, attention_mask, self.scaling, extra["softcap"]
        )
    if direct is not None:
        attn_output = direct.reshape(*input_shape, -1)
        if gate is not None:
            attn_output = attn_output * torch.sigmoid(gate)
        return self.o_proj(attn_output), None

    attn_output, attn_weights, shared = _attend(
        self, binding, query, key, value, attention_mask, unpadded, per_row, dropout, extra, kwargs
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        attn_output = attn_output * torch.sigmoid(gate)
    output = self.o_proj(attn_output)
    if shared is not None:
        output = zero_unattended_rows(output, shared.unattended, self.o_proj)
    elif rolled is not None:  # the padding's queries, which the caller's mask gives no key
        output = zero_unattended_rows(output, rolled.unattended, self.o_proj)
    return output, attn_weights


def _projected(self: nn.Module, spec: ArchitectureSpec, hidden_states: torch.Tensor, kv_shared,
               plan):  # fmt: skip
    """The layer's query (b, t, heads, d), key (the same; empty in a kv-sharing layer), value
    (b, heads, t, d: v-normed where the spec says) and output gate (b, t, heads * d, or None);
    ``plan``: the layer's recompute plan, if any."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    gate = None
    # No key heads in a kv-sharing layer; no v_proj in Gemma 4's attention_k_eq_v layers (the
    # values are the key projection).
    linears = (self.q_proj,) if kv_shared else (self.q_proj, self.k_proj, self.v_proj)
    with recompute.saved_tensor_scope(plan is not None and plan.norm_output):
        q, *kv = projections(hidden_states, *(m for m in linears if m is not None))
    if spec.attention_output_gate:  # per head: the query, then its output gate
        query, gate = q.view(*input_shape, -1, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
    else:
        query = q.view(hidden_shape)
    if kv_shared:  # RoPE rotates the query alone
        key = value = query[..., :0, :]
    else:
        key = kv[0].view(hidden_shape)
        value = key if len(kv) == 1 else kv[1].view(hidden_shape)
    if spec.v_norm and not kv_shared:
        value = self.v_norm(value)
    return query, key, value.transpose(1, 2), gate


def _rope(self: nn.Module, binding: AttentionBinding, query: torch.Tensor, rope_positions):
    """``apply_rope`` bound to the layer's rotary settings, the frequencies on the query's
    device, and the positions as (rows, seq)."""
    spec = binding.spec
    if rope_positions.dim() == 1:
        rope_positions = rope_positions.unsqueeze(0)
    inv_freq, scaling = rope_frequencies(self, binding)
    if inv_freq.device != query.device:
        # A device map (accelerate's hooks) put the rotary module on another GPU than this
        # layer; unpatched, its cos/sin would be moved here with the layer's inputs.
        inv_freq = inv_freq.to(query.device)
    rotary_dim = 2 * inv_freq.shape[-1]
    section, interleaved = binding.mrope if binding.mrope is not None else (None, False)
    rope = functools.partial(
        apply_rope,
        attention_scaling=scaling,
        rotary_dim=None if rotary_dim == self.head_dim else rotary_dim,
        layout=spec.rope_layout,
        mrope_section=section,
        mrope_interleaved=interleaved,
    )
    return rope, inv_freq, rope_positions


def _rotated(self, binding, query, key, position_ids, rope_positions, unpadded,
             position_embeddings, kv_shared, plan):  # fmt: skip
    """The query and key (b, heads, t, d) q/k-normed and rotated, as the layer does after its
    rotation (``after_rope``, ``position_query_scale``); and whether a padding-free step runs
    its attention one call per row. ``rope_positions``: a multimodal model's rotary positions
    (3-D over images), not the text ones the decoder layers pass."""
    spec = binding.spec
    rotated = spec.rope_layer_attr is None or bool(getattr(self, spec.rope_layer_attr))
    if not spec.mrope:
        rope_positions = position_ids
    elif binding.mrope is None:  # a layout apply_rope does not know: transformers' cos/sin
        rope_positions = None
    if position_embeddings is not None and length_dependent(
        binding.rotary, getattr(self, "layer_type", None)
    ):
        rope_positions = None  # this forward's cos/sin (the module docstring)
    rope = inv_freq = None
    if rope_positions is not None and rotated:
        rope, inv_freq, rope_positions = _rope(self, binding, query, rope_positions)

    def normed_and_rotated(query, key, rope_positions, inv_freq, *layout):
        if spec.qk_norm:  # RMSNorm over the head dim: the same before or after the transpose
            query = self.q_norm(query)
            key = key if kv_shared else self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        if rope is not None:
            query, key = rope(query, key, rope_positions, inv_freq)
        if layout:  # padding-free: back in the (batch, seq) layout, rebuilt with the rest
            query, key = (pad_heads(t, *layout, unpadded.batch, unpadded.seq) for t in (query, key))
        return query, key

    # The attention keeps the rotated q and k, and the q/k norms keep the projections they
    # normalise: compiled, the rotated ones are rebuilt from those in the backward (a norm and a
    # rotation) instead of being kept as well.
    rebuilt = (
        spec.qk_norm
        and rope is not None
        and plan is not None
        and plan.norm_output
        and recompute.compiling_with_grad()
    )
    # Padding-free: the attention one call per row, on slices of the one row; but where q and k
    # are rebuilt, slices taken outside their region made the partitioner keep them, so there
    # (and over more than ROW_CALLS_MAX rows) they are padded inside it for one padded call.
    per_row = unpadded is not None and unpadded.per_row and not rebuilt
    layout = () if unpadded is None or per_row else unpadded.layout
    if rebuilt:
        args = (query, key, rope_positions, inv_freq, *layout)
        norms = (self.q_norm, getattr(self, "k_norm", None))
        query, key = recompute.compiled_recompute(normed_and_rotated, *args, modules=norms)
    else:
        query, key = normed_and_rotated(query, key, rope_positions, inv_freq, *layout)
    if rope is None and rotated:
        query, key = _rotated_by_tables(binding, query, key, position_embeddings)
    query, key = after_rope(self, spec, query, key, position_ids, rotated)
    if spec.position_query_scale:
        query = query * position_query_scale(self, spec, position_ids).to(query.dtype)
    return query, key, per_row


def _rotated_by_tables(binding: AttentionBinding, query, key, position_embeddings):
    """The query and key (b, heads, t, d) rotated with the tables the layer was handed: surgery's
    cos/sin kernel; transformers' own rotation for a multimodal layout ``apply_rope`` does not
    know (``AttentionBinding.mrope``) and for Llama 4's complex frequencies (its
    ``apply_rotary_emb``, over (b, t, heads, d))."""
    spec = binding.spec
    if spec.rope_layout == "interleaved":
        rotate = sys.modules[spec.module].apply_rotary_emb
        query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), position_embeddings)
        return query.transpose(1, 2), key.transpose(1, 2)
    cos, sin = position_embeddings
    if spec.mrope and binding.mrope is None:
        return binding.fallback_rope(query, key, cos, sin)
    return apply_rotary_pos_emb(query, key, cos, sin)


def _varlen_runs(self: nn.Module, query, value, dropout: float, extra: dict) -> bool:
    """Whether a packed batch's attention (no cache) runs ``varlen_attention``: half precision,
    no dropout or softcap, heads flash attention takes."""
    return (
        query.dtype in (torch.float16, torch.bfloat16)
        and not dropout
        and extra.get("softcap") is None
        and self.head_dim <= 256
        and flash_head_size(query, value)
    )


def _attend(self, binding, query, key, value, attention_mask, unpadded, per_row, dropout, extra,
            kwargs):  # fmt: skip
    """transformers' attention function (``attention_interface``) over (b, heads, t, d): one
    call, or in a padding-free step one per row's real tokens (``per_row``) or one over the
    tokens padded again (then causal, unmasked); the output (b, t, heads, d) in the step's
    layout, the weights, and the shared mask (``SharedMask``) or None."""
    if per_row:
        # Each row's real tokens attend causally to themselves alone (no padding to compute),
        # the outputs one after another again.
        outputs = []
        for q, k, v in zip(*(t.split(unpadded.lengths, dim=2) for t in (query, key, value))):
            row_output, _, _ = attention_interface(
                self, binding, q, k, v, None, dropout=dropout, scaling=self.scaling, **extra,
                **kwargs,
            )  # fmt: skip
            outputs.append(row_output)
        return torch.cat(outputs, dim=1), None, None
    if unpadded is not None:  # the values padded too, for one causal sdpa call
        value = unpadded.pad(value)
        attention_mask = None
    attn_output, attn_weights, shared = attention_interface(
        self, binding, query, key, value, attention_mask,
        dropout=dropout, scaling=self.scaling, **extra, **kwargs,
    )  # fmt: skip
    if unpadded is not None:
        attn_output = unpadded.take(attn_output)
    return attn_output, attn_weights, shared


def attention_forward_for(module: nn.Module, generic: Callable = attention_forward) -> Callable:
    """``generic`` (``attention_forward``, or another generic attention forward) taking its
    arguments in the order of ``module``'s class forward
    (``surgery.patching.signature.in_signature_of``: Gemma 4 takes ``shared_kv_states`` before the
    cache, Ministral 3 ``position_ids`` between ``attention_mask`` and the cache)."""
    return in_signature_of(generic, type(module).forward)
