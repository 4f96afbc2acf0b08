"""Multimodal wrappers (``...ForConditionalGeneration``: a vision tower, a projector, a language
model and lm_head) whose language model is a registered text architecture
(``ArchitectureSpec.multimodal``), and text models patched on their own.

What ``patch`` does to a wrapper:

- the language model's attention, norms and MLPs are patched as for its text sibling (the causal
  LM of the same spec); the vision tower and the projector keep transformers' forwards (nothing
  is looked for outside the language model);
- a wrapper holding lm_head (Mistral 3, Gemma 3, Gemma 4) gets the generic causal-LM forward
  (``surgery.forward``), taking the wrapper's arguments in the wrapper's order
  (``surgery.signature.in_signature_of``): every argument that is not the causal LM's (pixel
  values, image sizes and grids, token types, video inputs) goes to the wrapper's own
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
batch. A text config with ``use_bidirectional_attention`` on every token is refused
(``surgery.registry``).

A text base model passed on its own (``surgery.patch(vlm.model.language_model)``) gets its layers
patched (no loss: it has no head), its forward wrapped only to carry the patch state
(``surgery.base_model``).
"""

from __future__ import annotations

from torch import nn

from surgery.models import ArchitectureSpec, MultimodalWrapper

__all__ = ["language_model", "text_model"]


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
