"""The one generic causal-LM forward every architecture shares (the lm_head forward that takes the
loss arguments is ``surgery.forwards.head``'s).

The causal-LM forward runs the base model (``self.model``), then either the fused loss or logits:

- training with labels (``fused_linear_cross_entropy=True``, ``return_logits=False``): the final
  hidden states go into ``linear_cross_entropy`` *through the lm_head module's call*
  (``self.lm_head(hidden, labels=...)``), so module hooks such as FSDP2's all-gather and reshard
  run around it and a tied head reads the shared weight; ``logits`` is None;
- otherwise: logits as transformers computes them (with the final softcap, if any), and when labels
  are given the loss through ``cross_entropy``.

Either way the final hidden states are first cut to ``logits_to_keep`` by transformers' own
``slice_logits_to_keep`` (an int, a 1-D tensor of positions, a 2-D tensor of positions per row or a
boolean mask), so the kept positions are the ones the unpatched model keeps.

It returns the causal LM's own output class (``causal_lm_output_class``: Gemma 4's
``Gemma4CausalLMOutputWithPast``, Llama 4's ``MoeCausalLMOutputWithPast`` in 5.23, ...) plus a
``z_loss`` field, every field filled as transformers fills it: the loss (with a router aux loss,
``aux_loss`` too) computed here, every other field the base model's output field of that name
(``router_logits``, ``shared_kv_states``, ...), as transformers' causal LMs copy them. The one
difference: ``logits`` is None where the loss is fused.

A multimodal wrapper holding lm_head (``surgery.forwards.multimodal``) runs the same forward:
``self.model`` is its multimodal model (the wrapper's own arguments, pixel values and the like, go
to it as given), its ``config.text_config`` says what the text model does, and the output is the
wrapper's class. One whose language model is the causal LM (Llama 4) runs ``delegating_forward``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass

import torch
from transformers.utils.generic import ModelOutput, can_return_tuple

from surgery.attention.forward import CAUSAL_KWARG
from surgery.attention.linear import fla_kernels
from surgery.attention.unpadding import Rolled, Unpadded
from surgery.compiling import graph_break_allowed
from surgery.forwards.batch_layout import (
    Targets,
    bidirectional,
    document_positions,
    laid_out_inputs,
    packed_inputs,
    padding_layout,
    right_padding_applies,
    whole_rows,
)
from surgery.forwards.head import (
    fuse_replaced_head,
    fused_head,
    head_logits,
    head_takes_loss,
    warn_unfused,
)
from surgery.integrations.trl import REQUEST_KWARG as TRL_REQUEST_KWARG
from surgery.integrations.trl import FusedHeadRequest, fused_head_output
from surgery.kernels import cross_entropy
from surgery.kernels.reduction import drop_crossing_targets, every_token_mask
from surgery.models import ArchitectureSpec, MultimodalWrapper
from surgery.options import PatchOptions
from surgery.outputs import (
    COMPUTED_FIELDS,
    CausalLMOutputWithZLoss,
    MoeCausalLMOutputWithZLoss,
    causal_lm_output_class,
    with_z_loss,
)
from surgery.patching.signature import CACHE, cache_argument

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # releases before the helper (5.17 among them)

    def slice_logits_to_keep(
        hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor
    ) -> torch.Tensor:
        """The slicing those releases' causal-LM forwards do inline: an int keeps the last
        ``logits_to_keep`` positions (0: all), a tensor indexes the sequence dimension."""
        indices = (
            slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        )
        return hidden_states[:, indices, :]


__all__ = [
    "CausalLMOutputWithZLoss",
    "MoeCausalLMOutputWithZLoss",
    "PatchState",
    "causal_lm_forward",
    "causal_lm_output_class",
    "moe_causal_lm_forward",
]

STATE_ATTR = "_surgery_state"


@dataclass(frozen=True)
class PatchState:
    """Kept in the patched causal LM's ``__dict__``; the forward reads it at call time."""

    spec: ArchitectureSpec
    options: PatchOptions
    wrapper: MultimodalWrapper | None = None
    """The multimodal wrapper whose forward this is (``surgery.forwards.multimodal``), or None: the
    causal LM's (or, on a text model patched on its own, no forward's)."""
    padding_free: bool = False
    """A right-padded training batch may run its real tokens only (``PatchOptions.padding_free``,
    ``surgery.attention.unpadding``): the option is on and every layer of the model allows it."""
    output: type = dataclasses.field(init=False, compare=False, repr=False)
    """The class the forward returns: the causal LM's own (``causal_lm_output_class``) plus
    ``z_loss``. Found once, when the state is made (at patch time)."""
    base_fields: tuple[str, ...] = dataclasses.field(init=False, compare=False, repr=False)
    """The fields of ``output`` the forward copies from the base model's output, as transformers'
    causal LM does (every field but ``COMPUTED_FIELDS``: the cache, hidden_states,
    attentions, router_logits, Gemma 4's shared_kv_states, ...); one the base model's output
    lacks is None."""

    router_logits_by_default: bool = dataclasses.field(init=False, compare=False, repr=False)
    """A MoE forward called without ``output_router_logits`` takes the config's: the causal LM's
    does, and a wrapper's that names the argument (transformers 5.23); a wrapper's that only
    reads it from its keyword arguments (5.17's Qwen3-VL-MoE, Qwen3.5-MoE) leaves the router
    logits and the aux loss out."""

    def __post_init__(self):
        default = self.wrapper is None or "output_router_logits" in (
            inspect.signature(self.wrapper.wrapper_class().forward).parameters
        )
        object.__setattr__(self, "router_logits_by_default", default)
        output = with_z_loss(causal_lm_output_class(self.spec, self.wrapper))
        base = tuple(f.name for f in dataclasses.fields(output) if f.name not in COMPUTED_FIELDS)
        object.__setattr__(self, "output", output)
        object.__setattr__(self, "base_fields", base)


def _load_balancing_loss(spec: ArchitectureSpec):
    # The model's module is imported (its classes built the model): read the function from
    # sys.modules, which torch.compile traces, rather than through importlib.import_module
    # (``spec.load_balancing_loss()``), a graph break.
    module = sys.modules.get(spec.module)
    return spec.load_balancing_loss() if module is None else module.load_balancing_loss_func


@can_return_tuple
def causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    per_layer_inputs: torch.Tensor | None = None,
    **kwargs,
) -> ModelOutput:
    """The causal-LM forward of every dense architecture (see the module docstring).
    ``per_layer_inputs`` (Gemma 4's precomputed per-layer input embeddings, where its causal LM
    takes them) goes to the base model like any other keyword argument."""
    if per_layer_inputs is not None:
        kwargs["per_layer_inputs"] = per_layer_inputs
    return _forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds,
                    labels, use_cache, logits_to_keep, None, kwargs)  # fmt: skip


@can_return_tuple
def moe_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
) -> ModelOutput:
    """The same for a mixture-of-experts architecture (``ArchitectureSpec.router_aux_loss``):
    with ``output_router_logits`` (default: the config's), transformers' load-balancing loss of
    the router logits, over the tokens of the attention mask the caller passed, is returned as
    ``aux_loss`` and, times ``router_aux_loss_coef``, added to the loss."""
    return _forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds,
                    labels, use_cache, logits_to_keep, output_router_logits, kwargs)  # fmt: skip


def _forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
             use_cache, logits_to_keep, output_router_logits, kwargs):  # fmt: skip
    """The causal-LM forward (the module docstring), in three steps: the batch's layout (the
    cache rules, a packed step's documents, a right-padded step's real tokens), the base model,
    then the head (``_head_output``)."""
    cache = cache_argument(cache, kwargs)
    state: PatchState = self.__dict__[STATE_ATTR]
    options, wrapper = state.options, state.wrapper
    # A multimodal wrapper's config holds the text model's as text_config.
    config = self.config if wrapper is None else self.config.text_config
    request, trl_request, targets = _pop_requests(kwargs, labels)
    if trl_request is not None:
        use_cache = False
    if state.spec.router_aux_loss:
        output_router_logits = _router_logits(state, config, output_router_logits, trl_request)
        if output_router_logits is not None:
            kwargs["output_router_logits"] = output_router_logits
    labels = targets.labels
    tokens = input_ids if input_ids is not None else inputs_embeds
    position_ids = _beside_embeddings(self, position_ids)
    text_positions = document_positions(position_ids)
    step = labels is not None or self.training
    packed_step = cache is None and attention_mask is None and text_positions is not None and step
    if packed_step or _fla_step(state, cache, use_cache, step, tokens):  # why: _fla_step
        use_cache = False
    plain_sdpa = config._attn_implementation == "sdpa" and not kwargs.get(
        "output_attentions", config.output_attentions
    )
    # The shortcuts below read the batch on the host; under torch.compile that is one graph
    # break before the model, taken only where the caller allows breaks (surgery.compiling).
    host_reads = not torch.compiler.is_compiling() or graph_break_allowed()
    # Tokens that transformers lets attend both ways (Gemma 3's images) rule out the causal
    # shortcuts: the attention then runs the mask the multimodal model built.
    causal = wrapper is None or not bidirectional(wrapper, kwargs, host_reads, config)
    # The load-balancing loss counts the tokens of the caller's mask, also when the attention
    # runs without it (causal_right_padding).
    model_mask = router_mask = attention_mask
    if packed_step:
        varlen = options.varlen_attention and options.rope and plain_sdpa and causal
        types = None if causal else kwargs[wrapper.bidirectional_tokens]
        model_mask, layout = packed_inputs(self, state, config, text_positions, tokens, types,
                                            varlen, host_reads)  # fmt: skip
        kwargs.update(layout)
    fused = labels is not None and self.training and options.fused_linear_cross_entropy
    fused = fused and not options.return_logits
    head_fused = fused and (head_takes_loss(self.lm_head) or fuse_replaced_head(self))
    right_padded, padded_layout = False, None
    if (
        head_fused and causal and host_reads and plain_sdpa and cache is None
        and right_padding_applies(options, config, kwargs, attention_mask, position_ids)
    ):  # fmt: skip
        # TRL's per-token outputs keep the batch's layout: the real tokens are not gathered.
        unpad = state.padding_free and whole_rows(logits_to_keep) and trl_request is None
        verdict = padding_layout(attention_mask, targets, tokens, unpad)
        right_padded, padded_layout = verdict.right_padded, verdict.layout
        if not verdict.padding and (config.use_cache if use_cache is None else use_cache):
            # A mask of ones is the batch without one, which transformers reads nothing of when
            # the step makes a cache (without one it reads the positions, checking for packing).
            model_mask = None
    # Without a mask, position ids or cache the batch is causal as it stands: said outright, as
    # transformers does not say it while compiling (it builds a causal mask there before torch
    # 2.14, which keeps sdpa off its flash kernel). No host read: fullgraph takes it too.
    unmasked = attention_mask is None and position_ids is None and cache is None
    if right_padded or padded_layout is not None or (unmasked and causal and plain_sdpa):
        kwargs[CAUSAL_KWARG] = True  # the attention layers without a sliding window: no mask
    if padded_layout is not None:  # the real tokens alone, or the rows rolled
        laid_out = laid_out_inputs(padded_layout, input_ids, inputs_embeds, targets)
        input_ids, inputs_embeds, targets, name = laid_out
        # A cache of the step's own layout would mislead the caller: none.
        kwargs[name], model_mask, use_cache = padded_layout, None, False
        if isinstance(padded_layout, Unpadded):
            text_positions, router_mask = padded_layout.positions, None
    outputs = self.model(input_ids=input_ids, attention_mask=model_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **{CACHE: cache},
                         **kwargs)  # fmt: skip
    if isinstance(padded_layout, Rolled) and getattr(outputs, "router_logits", None) is not None:
        outputs.router_logits = padded_layout.restore(outputs.router_logits)
    aux = None
    if state.spec.router_aux_loss and output_router_logits:
        tokens = input_ids if input_ids is not None else inputs_embeds
        aux = _aux_loss(self, state, config, outputs, tokens, router_mask)
    if isinstance(padded_layout, Unpadded) and getattr(outputs, "router_logits", None) is not None:
        # The load-balancing loss took the real tokens alone; the caller gets the batch's rows.
        outputs.router_logits = padded_layout.restore(outputs.router_logits)
    if trl_request is not None:  # TRL's head ignores logits_to_keep: every position's outputs
        logits_to_keep = 0
    if whole_rows(logits_to_keep):
        # Sequence boundaries: for "sequence", and so that the prediction of a sequence's first
        # token from the previous sequence's last token is never trained on packed rows.
        targets = targets._replace(position_ids=text_positions,
                                   cu_seqlens=kwargs.get("cu_seq_lens_q"))  # fmt: skip
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    output = _head_output(self, state, config, outputs, hidden, targets, fused, head_fused,
                          aux, trl_request)  # fmt: skip
    if request is not None and isinstance(output, state.output):  # not TRL's per-token outputs
        request.output = output
    return output


def _beside_embeddings(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``position_ids`` on the device of the input embeddings' weight. Over a device map
    accelerate's top-level hook moves every input to the model's main device, which need not hold
    the embeddings, and transformers' mask builder indexes a mask made from the position ids with
    indices made beside the embeddings: a packed batch (position ids, no mask) failed there across
    two devices, patched or not (``tests/surgery/test_device_map_gpu.py``). Left where it is while
    the weight is offloaded (on the meta device) or absent."""
    if position_ids is None:
        return None
    embeddings = self.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if weight is None or weight.device.type == "meta" or weight.device == position_ids.device:
        return position_ids
    return position_ids.to(weight.device)


def _pop_requests(kwargs: dict, labels):
    """What the forward takes out of its keyword arguments before the base model sees them: a
    multimodal wrapper's ``LossRequest`` (its labels replace ``labels``), TRL's fused-head
    request (surgery.integrations.trl: per-token outputs in TRL's output class), and
    transformers' loss kwargs, as ``Targets`` (boundaries not yet known)."""
    request: LossRequest | None = kwargs.pop(LOSS_REQUEST_KWARG, None)
    if request is not None:  # the labels of a multimodal wrapper around this causal LM
        labels = request.labels
    trl_request: FusedHeadRequest | None = kwargs.pop(TRL_REQUEST_KWARG, None)
    targets = Targets(
        labels,
        kwargs.pop("shift_labels", None),
        kwargs.pop("ignore_index", -100),
        kwargs.pop("num_items_in_batch", None),
    )
    return request, trl_request, targets


def _router_logits(state, config, output_router_logits, trl_request):
    """A MoE forward's ``output_router_logits``: the caller's, else the config's where the
    forward takes it by default (``PatchState.router_logits_by_default``) or TRL asks."""
    if output_router_logits is None and (state.router_logits_by_default or trl_request):
        return getattr(config, "output_router_logits", False)
    return output_router_logits


def _fla_step(state: PatchState, cache, use_cache, step: bool, tokens: torch.Tensor) -> bool:
    """Whether a hybrid's training or loss step (``step``) makes no KV cache from the config's
    ``use_cache``: where fla runs its linear-attention layers (``surgery.attention.linear``),
    as a packed or padding-free step makes none (with one, the layers would run transformers'
    forward). A ``use_cache=True`` passed is kept.

    A packed step (position ids, no mask, no cache yet) makes none either, in ``_forward``:
    transformers only builds its block-diagonal packed mask (sdpa, eager, flex) when no KV cache
    exists, and with use_cache on it creates one first, so tokens would attend across sequences.
    A loss call has no use for the cache; without it every sequence sees only itself (flash
    attention reads the boundaries from position_ids / cu_seq_lens either way)."""
    return (
        state.spec.linear_attention is not None
        and cache is None
        and use_cache is None
        and step
        and fla_kernels(tokens.device) is not None
    )


def _head_output(self, state, config, outputs, hidden, targets, fused, head_fused, aux,
                 trl_request):  # fmt: skip
    """The output of the forward from the base model's: logits, or the loss through the fused
    head (``head_fused``) or through ``cross_entropy`` of the logits, plus the router aux loss
    ``aux`` (loss, coefficient) of a MoE; or TRL's per-token outputs where it asked."""
    options = state.options
    wrapper = state.wrapper
    capped = state.spec.logit_softcap and (wrapper is None or wrapper.logit_softcap)
    softcap = getattr(config, state.spec.logit_softcap, None) if capped else None
    aux_loss, aux_coef = (None, None) if aux is None else aux
    # The fused head's kernel settings, for the loss and for TRL's per-token outputs alike.
    head_options = dict(
        chunk_bytes=options.loss_chunk_bytes,
        low_memory=options.loss_low_memory,
        skip_ignored=options.loss_skip_ignored,
    )
    labels, shift_labels = targets.labels, targets.shift_labels
    sequence = options.loss_reduction == "sequence"
    loss_options = dict(
        ignore_index=targets.ignore_index,
        reduction=options.loss_reduction,
        # num_items_in_batch counts tokens; a per-sequence mean has no use for it (the model
        # says accepts_loss_kwargs=False instead, see api.patch).
        num_items_in_batch=None if sequence else targets.num_items_in_batch,
        position_ids=targets.position_ids,
        cu_seqlens=targets.cu_seqlens,
        z_loss_scale=options.z_loss_scale,
        label_smoothing=options.label_smoothing,
    )
    if trl_request is not None and (labels is not None or shift_labels is not None):
        return fused_head_output(self, trl_request, hidden, labels, shift_labels,
                                 targets.num_items_in_batch, head_options, aux_loss,
                                 aux_coef, loss_options, softcap)  # fmt: skip
    loss = z_loss = logits = None
    if labels is None:
        logits = head_logits(self, hidden, softcap)
    else:
        given, shift = (shift_labels, False) if shift_labels is not None else (labels, True)
        given = given.to(hidden.device)
        if not shift:  # the loss shifts no labels: the packed boundaries dropped here
            given = drop_crossing_targets(given, targets.ignore_index, targets.position_ids,
                                          targets.cu_seqlens)  # fmt: skip
        loss_options["shift"] = shift
        if head_fused:
            out = fused_head(self)(hidden, labels=given, softcap=softcap, **head_options,
                                   **loss_options)  # fmt: skip
        else:
            if fused:
                warn_unfused(self.lm_head)
            logits = head_logits(self, hidden, softcap)
            out = cross_entropy(logits, given, **loss_options)
        loss = out.loss
        if options.z_loss_scale > 0:
            z_loss = out.z_loss.detach()
    fields = {name: getattr(outputs, name, None) for name in state.base_fields}
    if state.spec.router_aux_loss:
        if aux_loss is not None and loss is not None:
            loss = loss + aux_coef * aux_loss.to(loss.device)
        fields["aux_loss"] = aux_loss
    return state.output(loss=loss, logits=logits, z_loss=z_loss, **fields)


def _aux_loss(self, state, config, outputs, tokens, router_mask):
    """transformers' load-balancing loss of the router logits over the tokens of
    ``router_mask``, and its weight in the loss (``router_aux_loss_coef``)."""
    # The causal LM's attributes, or the text config of a wrapper (its forward reads them there).
    moe_args = self if state.wrapper is None else config
    if router_mask is None:
        # Every row counts: a mask of ones says so. Without a mask, transformers up to 5.17
        # counts each layer's experts with bincount, a device-to-host read (under compile a graph
        # break, the GPU idle while the host catches up); with one the counts are sums of ones
        # (exact), the same value without the read.
        router_mask = every_token_mask(*tokens.shape[:2], tokens.device)
    aux_loss = _load_balancing_loss(state.spec)(
        outputs.router_logits,
        moe_args.num_experts,
        moe_args.num_experts_per_tok,
        router_mask,
    )
    return aux_loss, moe_args.router_aux_loss_coef


@dataclass
class LossRequest:
    """The labels a multimodal wrapper whose language model is the causal LM (Llama 4) hands it
    through its forward's keyword arguments (``LOSS_REQUEST_KWARG``), and the causal LM's output
    (loss, z_loss, logits), set by the causal LM's patched forward."""

    labels: torch.Tensor
    output: ModelOutput | None = None


LOSS_REQUEST_KWARG = "surgery_loss_request"


@can_return_tuple
def delegating_forward(self, labels: torch.LongTensor | None = None, **kwargs) -> ModelOutput:
    """The forward of a multimodal wrapper whose language model is a patched causal LM holding
    lm_head (Llama 4): transformers' own forward of the wrapper (vision tower, projector, merging
    the image features into the embeddings) runs with no labels of its own, and the labels go
    down to the causal LM, whose patched forward computes the loss (fused in training) and
    leaves its output in the request; the wrapper's output (its own class plus ``z_loss``) gets
    that loss and those logits, every other field as the wrapper filled it."""
    state: PatchState = self.__dict__[STATE_ATTR]
    request = None if labels is None else LossRequest(labels)
    if request is not None:
        kwargs[LOSS_REQUEST_KWARG] = request
    out = type(self).forward(self, labels=None, return_dict=True, **kwargs)
    fields = {name: getattr(out, name, None) for name in state.base_fields}
    if request is None:
        return state.output(loss=out.loss, logits=out.logits, **fields)
    if request.output is None:
        raise RuntimeError(
            f"surgery: {type(self).__name__}'s forward did not pass the labels on to its language "
            "model (a transformers release whose multimodal forward changed?)"
        )
    inner = request.output
    return state.output(loss=inner.loss, logits=inner.logits, z_loss=inner.z_loss, **fields)
