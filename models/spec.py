"""The declarative description of an architecture: what the generic walker and the generic forwards
need to know about one transformers causal-LM family, and nothing more."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .mini import MiniConfig

__all__ = [
    "GATED_ACTIVATIONS",
    "GEMMA_RMS_NORM",
    "LLAMA_RMS_NORM",
    "ArchitectureSpec",
    "RMSNormStyle",
]

# transformers' activation names (ACT2FN keys) that ``surgery.kernels.gated_activation`` computes,
# and its name for each. Any other activation leaves the MLPs with their own forward.
GATED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


@dataclass(frozen=True)
class RMSNormStyle:
    """What an architecture's RMSNorm computes, in the terms of ``surgery.kernels.rms_norm``."""

    eps_attr: str
    """Attribute of the norm module holding epsilon, read at call time."""
    offset: float
    """The scale is ``offset + weight``: 0.0, or 1.0 for Gemma's zero-centred weights."""
    casting: str
    """``"llama"``: ``weight * normed.to(input_dtype)``; ``"gemma"``: ``(normed * (1 +
    weight.float())).type_as(x)`` (see ``rms_norm``)."""


LLAMA_RMS_NORM = RMSNormStyle(eps_attr="variance_epsilon", offset=0.0, casting="llama")
GEMMA_RMS_NORM = RMSNormStyle(eps_attr="eps", offset=1.0, casting="gemma")


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
    mini_config: MiniConfig
    """How to build the architecture's mini models from transformers' own config class: the tests'
    tiny models and the convergence suite's models are all made from it."""
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
    router_aux_loss: bool = False
    """A mixture-of-experts causal LM: its forward takes ``output_router_logits`` and, when they
    are output, adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits,
    num_experts, num_experts_per_tok, attention_mask)`` (transformers' own function of
    ``module``, the causal LM's own attributes) to the loss, returning transformers'
    ``MoeCausalLMOutputWithPast`` fields. The experts keep transformers' own implementation."""
    tied_lm_head: bool = False
    """The architecture's config ties ``lm_head.weight`` to ``embed_tokens.weight`` by default. The
    loss always reads the head's own ``weight`` through its module call, so a tied head trains the
    embedding through both uses."""
    rms_norm: str | None = None
    """RMSNorm class whose instances (every norm of the model, q/k norms included) get the fused
    ``rms_norm`` forward; None: none."""
    rms_norm_style: RMSNormStyle = LLAMA_RMS_NORM
    mlp: str | None = None
    """Gated MLP class (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) whose instances get the
    forward with the fused ``gated_activation``; None: none."""
    mlp_activation_attr: str = "hidden_act"
    """Config attribute naming the MLP's activation (an ACT2FN key)."""

    @property
    def name(self) -> str:
        """Short name: ``model_type`` without ``_text`` (``gemma3``); ``apply_<name>`` and the
        convergence suite's ``--model`` use it."""
        return self.model_type.removesuffix("_text")

    @property
    def apply_name(self) -> str:
        """Name of the class-level entry point, e.g. ``apply_llama``."""
        return "apply_" + self.name

    def _resolve(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def is_instance(self, module: object, name: str) -> bool:
        """Whether ``module`` is an instance of transformers' own class ``name`` of ``module``
        (or of a subclass), matched by where the class was defined, not by what the module-level
        name points to now: other libraries rebind those names (Liger-Kernel's class-level
        patches put their own classes there)."""
        return any(
            cls.__module__ == self.module and cls.__qualname__ == name
            for cls in type(module).__mro__
        )

    def rebound_functions(self) -> dict[str, object]:
        """transformers' functions the generic forwards call (``apply_rotary_pos_emb``,
        ``eager_attention_forward``) whose name in ``module`` now points to a function defined
        elsewhere (another library rebound it), with that function. Rebound class names do not
        matter: modules are matched with ``is_instance``."""
        found = {}
        for name in ("apply_rotary_pos_emb", "eager_attention_forward"):
            obj = self._resolve(name)
            if getattr(obj, "__module__", None) != self.module:
                found[name] = obj
        return found

    def causal_lm_class(self) -> type:
        return self._resolve(self.causal_lm)

    def attention_class(self) -> type:
        return self._resolve(self.attention)

    def rms_norm_class(self) -> type:
        return self._resolve(self.rms_norm)

    def mlp_class(self) -> type:
        return self._resolve(self.mlp)

    def gated_activation(self, config) -> str | None:
        """The ``gated_activation`` name of the MLP activation ``config`` asks for, or None when
        there is no fused kernel for it."""
        return GATED_ACTIVATIONS.get(getattr(config, self.mlp_activation_attr, None))

    def rotary_pos_emb(self):
        """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` of this module."""
        return self._resolve("apply_rotary_pos_emb")

    def load_balancing_loss(self):
        """transformers' ``load_balancing_loss_func`` of this module (MoE architectures)."""
        return self._resolve("load_balancing_loss_func")

    def eager_attention(self):
        """The module's own eager attention (Gemma2's applies the attention-logit softcap)."""
        return self._resolve("eager_attention_forward")
