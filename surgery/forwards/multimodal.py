"""Multimodal wrappers (``...ForConditionalGeneration``: a vision tower, a projector, a language
model and lm_head) whose language model is a registered text architecture
(``ArchitectureSpec.multimodal``), and text models patched on their own.

What ``patch`` does to a wrapper:

- the language model's attention, norms and MLPs are patched as for its text sibling (the causal
  LM of the same spec); the vision tower and the projector keep transformers' forwards, but for
  the Qwen-VL towers' attention (``MultimodalWrapper.vision_attention``), whose per-segment
  calls become one varlen call (``surgery.attention.vision``);
- a wrapper holding lm_head (Mistral 3, Gemma 3, Gemma 4) gets the generic causal-LM forward
  (``surgery.forwards.causal_lm``), taking the wrapper's arguments in the wrapper's order
  (``surgery.patching.signature.in_signature_of``): every argument that is not the causal LM's
  (pixel values, image sizes and grids, token types, video inputs) goes to the wrapper's own
  ``self.model`` as given; the final hidden states go into the fused loss through the wrapper's
  lm_head call; the output is the wrapper's own class plus ``z_loss``, every other field
  (``image_hidden_states``, ``rope_deltas``, ...) copied from ``self.model``'s output as the
  wrapper copies it. The text config (``config.text_config``) says what the text model does: its
  attention implementation, its final softcap where the wrapper applies it
  (``MultimodalWrapper.logit_softcap``);
- a wrapper whose language model is the causal LM itself (Llama 4) keeps its own forward, called
  without labels: the labels go down to the patched causal LM (``delegating_forward``).

Attention over image tokens in both directions (Gemma 3, ``MultimodalWrapper.bidirectional_tokens``)
runs the mask the multimodal model built; surgery's causal shortcuts are not taken for such a
batch. A packed row of such a batch (position ids restarting, no mask) gets its masks from
``packed_bidirectional_masks``: transformers' own masks of each conversation alone, placed
block-diagonally. transformers' mask of the packed row itself lets text tokens of the sliding
layers attend to later tokens (Gemma 3, transformers 5.23: a token sees the next window's tokens
of its conversation). A text config with ``use_bidirectional_attention`` on every token is
refused (``surgery.patching.registry``).

A text base model passed on its own (``surgery.patch(vlm.model.language_model)``) gets its layers
patched (no loss: it has no head), its forward wrapped only to carry the patch state
(``surgery.forwards.base_model``).
"""

from __future__ import annotations

import itertools
import sys

import torch
from torch import nn

from surgery.kernels.reduction import host_cu_seqlens
from surgery.models import ArchitectureSpec, MultimodalWrapper
from surgery.patching.signature import CACHE

__all__ = ["language_model", "packed_bidirectional_masks", "text_model"]


def _resolve(module: nn.Module, path: str) -> nn.Module:
    for name in path.split("."):
        module = getattr(module, name)
    return module


def language_model(lm: nn.Module, wrapper: MultimodalWrapper) -> nn.Module:
    """The wrapper's language model (``MultimodalWrapper.language_model``)."""
    return _resolve(lm, wrapper.language_model)


def text_model(lm: nn.Module, spec: ArchitectureSpec) -> tuple[nn.Module, str]:
    """The text base model whose layers ``patch`` swaps, and its name under ``lm``: a causal LM's
    ``model``, a wrapper's language model, or ``lm`` itself (a text model patched on its own)."""
    wrapper = spec.wrapper_of(lm)
    if wrapper is not None:
        return language_model(lm, wrapper), wrapper.language_model
    if spec.is_instance(lm, spec.causal_lm):
        return lm.model, "model"
    return lm, ""


def packed_bidirectional_masks(
    base_model: nn.Module, text_positions: torch.Tensor, token_types: torch.Tensor, dtype
) -> dict[str, torch.Tensor] | None:
    """The attention masks, by layer type, of a packed (batch, seq) row whose image tokens attend
    both ways (``MultimodalWrapper.bidirectional_tokens``): for each conversation (its text
    positions restarting at 0), the mask transformers' multimodal model builds for it alone
    (its module's ``create_masks_for_vision_model``), placed on the diagonal; no token attends
    to another conversation's. What ``base_model``'s forward takes as ``attention_mask`` (a dict
    is used as given). One device-to-host copy of the position ids.

    transformers builds them in one call, for the conversations as the rows of a right-padded
    batch (each row's tokens first, its padding masked): a conversation's own block of that mask
    is its mask alone (padding is masked as keys only, and a query's positions, windows and
    image blocks are those of its row). One call instead of one per conversation: the mask
    functions run under ``torch.vmap``, whose host time per call would otherwise hold the GPU
    idle at every step (``benchmarks/results/profile_gemma3_surgery_packed-before-mask-
    batching.txt``).

    None (transformers' own mask, then) where its module has no such function or its attention
    implementation takes no mask tensor (sdpa and eager do)."""
    module = sys.modules[type(base_model).__module__]
    make = getattr(module, "create_masks_for_vision_model", None)
    blocks = getattr(module, "get_block_sequence_ids_for_mask", None)
    config = base_model.config.get_text_config()
    if make is None or blocks is None or config._attn_implementation not in ("sdpa", "eager"):
        return None
    batch, seq = token_types.shape
    device = token_types.device
    cu_seqlens = host_cu_seqlens(text_positions, (batch, seq)).tolist()
    # (row, first token, length) of each conversation
    documents = [(a // seq, a % seq, b - a) for a, b in itertools.pairwise(cu_seqlens)]
    longest = max(n for _, _, n in documents)
    types = token_types.new_zeros(len(documents), longest)
    present = torch.zeros(len(documents), longest, dtype=torch.long, device=device)
    for d, (row, first, n) in enumerate(documents):
        types[d, :n] = token_types[row, first : first + n]
        present[d, :n] = 1
    alone = make(
        config=config,
        inputs_embeds=torch.empty((len(documents), longest, 0), dtype=dtype, device=device),
        attention_mask=present,
        **{CACHE: None},
        position_ids=torch.arange(longest, device=device).expand(len(documents), -1),
        block_sequence_ids=blocks(types, device=device),
    )
    masks: dict[str, torch.Tensor] = {}
    for layer_type, mask in alone.items():
        if mask is None:  # sdpa's causal shortcut: transformers found nothing to mask
            mask = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()[None, None]
        empty = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        out = torch.full((batch, 1, seq, seq), empty, dtype=mask.dtype, device=device)
        for d, (row, first, n) in enumerate(documents):
            own = mask[d if mask.shape[0] > 1 else 0, :, :n, :n]
            out[row, :, first : first + n, first : first + n] = own
        masks[layer_type] = out
    return masks
