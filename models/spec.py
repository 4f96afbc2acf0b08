"""The declarative description of an architecture: what the generic walker and the generic forwards
need to know about one transformers causal-LM family, and nothing more."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["ArchitectureSpec"]


@dataclass(frozen=True)
class ArchitectureSpec:
    """One causal-LM architecture of transformers 5.x.

    Class names are strings, resolved lazily in ``module``, so importing the specs never imports a
    transformers modeling file.
    """

    model_type: str
    """``config.model_type`` of the causal LM (the key of ``surgery.supported()``)."""
    module: str
    """The transformers module defining the classes below (and its ``eager_attention_forward``)."""
    causal_lm: str
    """Class whose instances get the generic causal-LM forward."""
    attention: str
    """Class whose instances get the generic attention forward (RoPE through ``apply_rope``)."""
    rotary_attr: str = "rotary_emb"
    """Attribute of the base model (``model.model``) holding the rotary module. Frequencies are
    read from it at call time: dynamic RoPE types rewrite them in its forward, which runs before
    the layers."""
    rope_per_layer_type: bool = False
    """True when the rotary module keeps one frequency set per attention layer type, as
    ``<layer_type>_inv_freq`` / ``<layer_type>_attention_scaling`` (Gemma3: local and global RoPE);
    the attention module's ``layer_type`` picks its set."""
    qk_norm: bool = False
    """``q_norm`` / ``k_norm`` (RMSNorm over the head dim) are applied to q and k before RoPE."""
    attention_kwargs: tuple[tuple[str, str], ...] = ()
    """Extra keyword arguments the attention passes to the attention interface, each with the dotted
    attribute path on the attention module it is read from (a missing attribute reads as None)."""
    logit_softcap: str | None = None
    """Config attribute of the final logit softcap (``cap * tanh(logits / cap)``), if any."""
    tied_lm_head: bool = False
    """The architecture's config ties ``lm_head.weight`` to ``embed_tokens.weight`` by default. The
    loss always reads the head's own ``weight`` through its module call, so a tied head trains the
    embedding through both uses."""

    @property
    def apply_name(self) -> str:
        """Name of the class-level entry point, e.g. ``apply_llama``."""
        return "apply_" + self.model_type.removesuffix("_text")

    def _resolve(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def causal_lm_class(self) -> type:
        return self._resolve(self.causal_lm)

    def attention_class(self) -> type:
        return self._resolve(self.attention)

    def rotary_pos_emb(self):
        """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` of this module."""
        return self._resolve("apply_rotary_pos_emb")

    def eager_attention(self):
        """The module's own eager attention (Gemma2's applies the attention-logit softcap)."""
        return self._resolve("eager_attention_forward")
