"""The one generic causal-LM forward every architecture shares, and the lm_head forward that takes
the loss arguments.

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
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from surgery.kernels import cross_entropy, linear_cross_entropy
from surgery.models import ArchitectureSpec

from .attention import CAUSAL_KWARG, PACKED_KWARG, packed_sequences
from .compiling import graph_break_allowed, host_read
from .options import PatchOptions
from .swap import apply_swaps, is_swapped, plan_swap

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
    "lm_head_forward",
    "moe_causal_lm_forward",
    "padding_only_behind",
]

STATE_ATTR = "_surgery_state"
LM_HEAD_ATTR = "_surgery_lm_head"


@dataclass
class CausalLMOutputWithZLoss(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``z_loss``: the z-loss term already inside ``loss`` (same
    reduction, detached, for logging); None unless ``z_loss_scale > 0`` and a loss was computed."""

    z_loss: torch.Tensor | None = None


@dataclass
class MoeCausalLMOutputWithZLoss(MoeCausalLMOutputWithPast):
    """transformers' ``MoeCausalLMOutputWithPast`` (``aux_loss``, ``router_logits``) plus
    ``z_loss``, as in ``CausalLMOutputWithZLoss``."""

    z_loss: torch.Tensor | None = None


@dataclass(frozen=True)
class PatchState:
    """Kept in the patched causal LM's ``__dict__``; the forward reads it at call time."""

    spec: ArchitectureSpec
    options: PatchOptions


def lm_head_forward(
    self: nn.Linear, input: torch.Tensor, labels: torch.Tensor | None = None, **loss
):
    """``nn.Linear.forward`` that, given ``labels``, returns the ``LossOutput`` of
    ``linear_cross_entropy`` of ``input @ self.weight.T (+ bias)`` instead of the product. Called
    through the module, so the weight is whatever the module holds during its forward (FSDP2
    unshards it there)."""
    if labels is None:
        return type(self).forward(self, input)
    return linear_cross_entropy(input, self.weight, labels, bias=self.bias, **loss)


def _is_plain_linear(module: nn.Module) -> bool:
    """``nn.Linear`` itself, not a subclass (a quantised layer, whose weight the fused loss cannot
    read), or the class FSDP2's ``fully_shard`` swaps in for it, ``FSDPLinear(FSDPModule,
    nn.Linear)``: a head sharded before ``patch`` is still fused."""
    cls = type(module)
    if cls is nn.Linear:
        return True
    if cls.__bases__[-1:] != (nn.Linear,):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return cls.__bases__ == (FSDPModule, nn.Linear)


def head_linears(lm: nn.Module) -> list[nn.Linear]:
    """The vocabulary projections under ``lm.lm_head``: the head itself (sharded by FSDP2 or not),
    or the copies inside a PEFT ``ModulesToSaveWrapper``, or the base layer inside a LoRA layer
    (whose own A/B projections have other shapes and are left alone)."""
    config = lm.config
    return [
        m
        for m in lm.lm_head.modules()
        if _is_plain_linear(m)
        and m.out_features == config.vocab_size
        and m.in_features == config.hidden_size
    ]


def head_takes_loss(head: nn.Module) -> bool:
    """Whether ``head(hidden, labels=...)`` reaches only patched lm_head Linears: every module
    under ``head`` that owns parameters is one (PEFT's ``ModulesToSaveWrapper`` dispatches to
    such copies).
    A LoRA (or any other adapter) layer on the head owns other parameters: then the loss is computed
    from the logits the wrapped head returns, so the adapter is trained, never dropped."""
    for module in head.modules():
        if module._parameters and LM_HEAD_ATTR not in module.__dict__:
            return False
    return True


def _logits(self, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = self.lm_head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _fuse_replaced_head(lm: nn.Module) -> bool:
    """Fuse a head that was replaced after ``patch`` (``resize_token_embeddings`` and
    ``set_output_embeddings`` put a new ``nn.Linear`` there) the way ``patch`` fuses one: its
    forward is swapped for ``lm_head_forward``, undone by ``unpatch``. Not when anything else
    under the head owns parameters (an adapter: its logits are used, see ``head_takes_loss``), nor
    under ``torch.compile`` (no swapping inside a traced forward). True when the head now takes
    the loss."""
    if torch.compiler.is_compiling():
        return False
    new = [m for m in head_linears(lm) if not is_swapped(m)]
    if not new:
        return False
    for module in lm.lm_head.modules():
        if module._parameters and LM_HEAD_ATTR not in module.__dict__ and module not in new:
            return False
    swaps = [plan_swap(m, lm_head_forward, {LM_HEAD_ATTR: True}, "lm_head") for m in new]
    apply_swaps([swap for swap in swaps if swap is not None])
    return head_takes_loss(lm.lm_head)


def _warn_unfused(head: nn.Module) -> None:
    # Python's default warning filter shows it once per process.
    if torch.compiler.is_compiling():
        cause = (
            "was replaced after surgery.patch (resize_token_embeddings?) and cannot be fused "
            "inside torch.compile; call surgery.patch(model) again before compiling"
        )
    else:
        cause = (
            f"is a {type(head).__name__} holding parameters of its own (e.g. a LoRA adapter); "
            "leave lm_head out of the adapter's target_modules (use modules_to_save=['lm_head'] "
            "to train it)"
        )
    warnings.warn(
        f"surgery: lm_head {cause}. The loss is computed from its logits (correct, but not fused).",
        stacklevel=3,
    )


def padding_only_behind(
    attention_mask: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> bool:
    """Whether a (batch, seq) ``attention_mask`` is right padding only (each row: ones, then
    zeros) and every padding position's target is ``ignore_index``. Then, under causal attention,
    no position that carries a loss ever sees a padding position, nor does anything it depends
    on, and the mask can be dropped. One device-to-host read."""
    if attention_mask.dim() != 2 or targets.shape != attention_mask.shape:
        return False
    real = attention_mask.to(targets.device) != 0
    right = (real[:, 1:] <= real[:, :-1]).all()
    return bool(right & (real | (targets == ignore_index)).all())


_padding_only_behind = host_read(padding_only_behind)


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
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    per_layer_inputs: torch.Tensor | None = None,
    **kwargs,
) -> CausalLMOutputWithZLoss:
    """The causal-LM forward of every dense architecture (see the module docstring).
    ``per_layer_inputs`` (Gemma 4's precomputed per-layer input embeddings, where its causal LM
    takes them) goes to the base model like any other keyword argument."""
    if per_layer_inputs is not None:
        kwargs["per_layer_inputs"] = per_layer_inputs
    return _forward(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                    labels, use_cache, logits_to_keep, None, kwargs)  # fmt: skip


@can_return_tuple
def moe_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
) -> MoeCausalLMOutputWithZLoss:
    """The same for a mixture-of-experts architecture (``ArchitectureSpec.router_aux_loss``):
    with ``output_router_logits`` (default: the config's), transformers' load-balancing loss of
    the router logits, over the tokens of the attention mask the caller passed, is returned as
    ``aux_loss`` and, times ``router_aux_loss_coef``, added to the loss."""
    return _forward(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                    labels, use_cache, logits_to_keep, output_router_logits, kwargs)  # fmt: skip


def _forward(
    self,
    input_ids,
    attention_mask,
    position_ids,
    past_key_values,
    inputs_embeds,
    labels,
    use_cache,
    logits_to_keep,
    output_router_logits,
    kwargs,
):
    state: PatchState = self.__dict__[STATE_ATTR]
    options = state.options
    moe = state.spec.router_aux_loss
    if moe:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        kwargs["output_router_logits"] = output_router_logits
    # The load-balancing loss counts the tokens of the caller's mask, also when the attention
    # runs without it (causal_right_padding).
    router_mask = attention_mask
    # transformers' loss kwargs: the base model has no use for them.
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)

    # A packed batch (position ids, no mask, no cache yet) in a training or loss call:
    # transformers only builds its block-diagonal packed mask (sdpa, eager, flex) when no KV cache
    # exists, and with use_cache on it creates one first, so tokens would attend across sequences.
    # A loss call has no use for the cache; without it every sequence sees only itself (flash
    # attention reads the boundaries from position_ids / cu_seq_lens either way).
    packed_step = (
        past_key_values is None
        and attention_mask is None
        and position_ids is not None
        and (labels is not None or self.training)
    )
    if packed_step:
        use_cache = False
    output_attentions = kwargs.get("output_attentions", self.config.output_attentions)
    sdpa = self.config._attn_implementation == "sdpa"
    # Both shortcuts below read the batch on the host; under torch.compile that is one graph
    # break before the model, taken only where the caller allows breaks (surgery.compiling).
    host_reads = not torch.compiler.is_compiling() or graph_break_allowed()
    if packed_step and options.varlen_attention and options.rope and sdpa and not output_attentions:
        tokens = input_ids if input_ids is not None else inputs_embeds
        packed = packed_sequences(position_ids, tuple(tokens.shape[:2]), tokens.device, host_reads)
        if packed is not None:  # see PatchOptions.varlen_attention
            kwargs[PACKED_KWARG] = packed

    fused = (
        labels is not None
        and self.training
        and options.fused_linear_cross_entropy
        and not options.return_logits
    )
    head_fused = fused and (head_takes_loss(self.lm_head) or _fuse_replaced_head(self))
    if (
        options.causal_right_padding
        and head_fused
        and attention_mask is not None
        and past_key_values is None
        and position_ids is None
        and sdpa
        and not kwargs.get("output_hidden_states", self.config.output_hidden_states)
        and not output_attentions
        and host_reads
        and _padding_only_behind(
            attention_mask, labels if shift_labels is None else shift_labels, ignore_index
        )
    ):
        attention_mask = None  # see PatchOptions.causal_right_padding
        kwargs[CAUSAL_KWARG] = True

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    softcap = (
        getattr(self.config, state.spec.logit_softcap, None) if state.spec.logit_softcap else None
    )

    loss = z_loss = logits = None
    if labels is None:
        logits = _logits(self, hidden, softcap)
    else:
        targets, shift = (shift_labels, False) if shift_labels is not None else (labels, True)
        targets = targets.to(hidden.device)
        # Sequence boundaries: for "sequence", and so that the prediction of a sequence's first
        # token from the previous sequence's last token is never trained on packed rows.
        whole_rows = isinstance(logits_to_keep, int) and logits_to_keep == 0
        sequence = options.loss_reduction == "sequence"
        loss_options = dict(
            ignore_index=ignore_index,
            reduction=options.loss_reduction,
            # num_items_in_batch counts tokens; a per-sequence mean has no use for it (the model
            # says accepts_loss_kwargs=False instead, see api.patch).
            num_items_in_batch=None if sequence else num_items_in_batch,
            position_ids=position_ids if whole_rows else None,
            cu_seqlens=kwargs.get("cu_seq_lens_q") if whole_rows else None,
            z_loss_scale=options.z_loss_scale,
            label_smoothing=options.label_smoothing,
            shift=shift,
        )
        if head_fused:
            out = self.lm_head(
                hidden,
                labels=targets,
                softcap=softcap,
                low_memory=options.loss_low_memory,
                chunk_bytes=options.loss_chunk_bytes,
                **loss_options,
            )
        else:
            if fused:
                _warn_unfused(self.lm_head)
            logits = _logits(self, hidden, softcap)
            out = cross_entropy(logits, targets, **loss_options)
        loss = out.loss
        if options.z_loss_scale > 0:
            z_loss = out.z_loss.detach()

    if not moe:
        return CausalLMOutputWithZLoss(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            z_loss=z_loss,
        )
    aux_loss = None
    if output_router_logits:
        aux_loss = _load_balancing_loss(state.spec)(
            outputs.router_logits, self.num_experts, self.num_experts_per_tok, router_mask
        )
        if loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithZLoss(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
        z_loss=z_loss,
    )
