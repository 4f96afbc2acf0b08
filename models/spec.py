"""The declarative description of an architecture: what the generic walker and the generic forwards
need to know about one transformers causal-LM family, and nothing more."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "GATED_ACTIVATIONS",
    "GEMMA_RMS_NORM",
    "LLAMA_RMS_NORM",
    "ArchitectureSpec",
    "MiniImages",
    "MultimodalWrapper",
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


def _is_instance_of(module: object, defined_in: str, name: str) -> bool:
    return any(
        cls.__module__ == defined_in and cls.__qualname__ == name for cls in type(module).__mro__
    )


@dataclass(frozen=True)
class MiniImages:
    """How a wrapper's processor lays out one image, for the inputs of its mini models (made by
    ``surgery.convergence.multimodal.image_inputs``, which the convergence suite and the VLM
    benchmark draw their image chats from)."""

    layout: str
    """The processor's layout, one of the convergence suite's ``IMAGE_LAYOUTS``:
    ``"patch_grid"`` (flattened (t, h, w) patches of t_patch x p x p pixels and
    ``image_grid_thw``, merged ``spatial_merge_size``² to a token: the Qwen-VL family),
    ``"pixels"`` ((height, width) pixels and ``image_sizes``, patches merged
    ``spatial_merge_size``²: Pixtral), ``"square"`` (one size, the processor resizes; the config's
    ``mm_tokens_per_image`` tokens: Gemma 3), ``"shuffled_tile"`` (one tile whose patches are
    pixel-shuffled: Llama 4), ``"positioned_patches"`` ((h, w) patches at their (x, y) positions,
    padded to ``patch_budget`` at (-1, -1), pooled k x k: Gemma 4)."""
    sizes: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict, hash=False)
    """The image sizes a sample draws from, by mini size name (the convergence suite's ``SIZES``:
    ``"tiny"``, ``"full"``), in the layout's units ((t, h, w) patches, (height, width) pixels,
    (h, w) patches); none: the one size of the layout."""
    around: tuple[str, str] | None = None
    """The config arguments naming the tokens that open and close an image's tokens (Qwen:
    vision start and end), or None where the processor puts none around them (Mistral 3)."""
    token_types: str | None = None
    """The forward argument, 1 at image tokens, the processor gives besides the images (Qwen's
    ``mm_token_type_ids``); the wrapper's ``bidirectional_tokens`` are given anyway."""
    patch_budget: int | None = None
    """``"positioned_patches"``: the patches every image is padded to."""


@dataclass(frozen=True)
class MultimodalWrapper:
    """A transformers multimodal model (``...ForConditionalGeneration``: vision tower, projector,
    language model, lm_head) whose language model is the text model of the spec that lists it
    (``ArchitectureSpec.multimodal``; matched at patch time by its ``config.text_config``'s
    ``model_type``). The language model is patched as that spec says, the vision tower and the
    projector are left to transformers (but for ``vision_attention``), and the wrapper's forward
    gets the fused loss with the wrapper's own output class (``surgery.forwards.multimodal``)."""

    model_type: str
    """``config.model_type`` of the wrapper (``gemma3``)."""
    module: str
    """The transformers module defining ``wrapper``."""
    wrapper: str
    """The multimodal class (``Gemma3ForConditionalGeneration``)."""
    language_model: str = "model.language_model"
    """Dotted path from the wrapper to its language model: a text base model (the wrapper holds
    lm_head, and its forward runs ``self.model`` then lm_head), or the text spec's causal LM
    holding lm_head itself (Llama 4's ``language_model``: the wrapper's forward hands it the
    labels)."""
    logit_softcap: bool = False
    """The wrapper caps its logits with the text config's ``ArchitectureSpec.logit_softcap``
    (Gemma 4's does; Gemma 3's wrapper does not, whatever its text config says)."""
    bidirectional_tokens: str | None = None
    """The wrapper's forward argument whose nonzero entries mark tokens (images) that transformers
    may let attend to each other in both directions (Gemma 3's ``token_type_ids``, Gemma 4's
    ``mm_token_type_ids``): when a batch has any, the attention runs the mask transformers built
    (a packed row: ``surgery.forwards.multimodal.packed_bidirectional_masks``), never one of
    surgery's causal shortcuts (``causal_right_padding``, ``varlen_attention``)."""
    bidirectional_when: tuple[str, object] | None = None
    """The text config's (attribute, value) under which transformers lets ``bidirectional_tokens``
    attend both ways (Gemma 4: ``("use_bidirectional_attention", "vision")``); None: whenever the
    wrapper is given them (Gemma 3)."""

    vision_attention: str | None = None
    """The vision tower's attention class (in ``module``) whose forward takes the tower's
    ``cu_seqlens`` and, without flash attention, calls the attention once per image, frame or
    window (the Qwen-VL family): with ``varlen_attention`` it runs them all in one varlen call
    (``surgery.attention.vision``). None: the vision tower is left as it is."""
    images: MiniImages | None = None
    """How its processor lays out an image (the convergence suite's image chats, the tests'
    images); None: the suite has no image inputs for it and says so."""

    @property
    def name(self) -> str:
        return self.model_type

    def is_instance(self, module: object) -> bool:
        """Whether ``module`` is an instance of transformers' ``wrapper`` (see
        ``ArchitectureSpec.is_instance``)."""
        return _is_instance_of(module, self.module, self.wrapper)

    def is_vision_attention(self, module: object) -> bool:
        """Whether ``module`` is an instance of transformers' ``vision_attention``."""
        return self.vision_attention is not None and _is_instance_of(
            module, self.module, self.vision_attention
        )

    def wrapper_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.wrapper)


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
    causal_lm: str | None
    """Class whose instances get the generic causal-LM forward; None for a text architecture
    that exists only as the language model of multimodal models (``multimodal``; Qwen2-VL's: its
    spec is in ``MULTIMODAL_ONLY_SPECS``, not ``SPECS``)."""
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
    router_aux_loss: bool = False
    """A mixture-of-experts causal LM: its forward takes ``output_router_logits`` and, when they
    are output, adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits,
    num_experts, num_experts_per_tok, attention_mask)`` (transformers' own function of
    ``module``, the causal LM's own attributes) to the loss, returning transformers'
    ``MoeCausalLMOutputWithPast`` fields. The routed experts run through transformers' experts
    implementations, surgery's own (``surgery.forwards.experts``) by default where it can fuse
    them."""
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
    batched_experts: str | None = None
    """Routed-experts class that is not dispatched through transformers' experts implementations
    and runs every token through every expert as two batched GEMMs (Llama 4's
    ``Llama4TextExperts``: ``forward(hidden_states)`` of (experts x tokens, hidden), each expert's
    tokens already scaled by its routing weight; ``bmm`` with ``gate_up_proj`` (experts, hidden,
    2 I), gate then up; ``act_fn(gate) * up``; ``bmm`` with ``down_proj`` (experts, I, hidden)).
    Its instances get ``surgery.forwards.experts.batched_experts_forward``, the activation fused
    between the GEMMs, when ``experts_implementation`` asks for surgery's experts; None: none."""
    attention_output_gate: bool = False
    """``q_proj`` yields, per head, the query then an output gate of the same size (its output
    viewed as ``(..., heads, 2 * head_dim)`` and split in halves); the attention output is
    multiplied by ``sigmoid(gate)`` before ``o_proj`` (Qwen3-Next, Qwen3.5)."""
    linear_attention: str | None = None
    """Linear-attention (recurrent) layer class of a hybrid model, left to transformers' own math
    but given the documents of a packed batch: its instances run each document as one row of a
    right-padded batch, so that neither its recurrent state nor its convolution window crosses a
    document boundary (``surgery.attention.linear``); None: none."""
    kv_sharing: bool = False
    """Later layers reuse the keys and values of an earlier layer of their type (Gemma 3n, Gemma
    4): the attention takes transformers' ``shared_kv_states``; a module whose
    ``is_kv_shared_layer`` is set reads its keys and values there (no projections, norms, RoPE or
    cache update of its own), one whose ``store_full_length_kv`` is set stores them there after its
    cache update. A module without ``v_proj`` (Gemma 4's ``attention_k_eq_v``) takes its values
    from the key projection, before ``k_norm``."""
    v_norm: bool = False
    """``v_norm`` (an RMSNorm over the head dim, Gemma 3n/4's without a scale) is applied to the
    values."""
    mlp_sparsity_attr: str | None = None
    """Attribute of the MLP module holding its activation sparsity (Gemma 3n: where nonzero, a
    Gaussian top-k cut of the gate before the activation): those MLPs keep their own forward; the
    others (zero) get the fused one. None: every MLP is plain gated."""
    rope_layout: str = "half"
    """Where the two channels RoPE rotates together live (``apply_rope``'s ``layout``): ``"half"``,
    channels j and j + D/2 (transformers' ``rotate_half``), or ``"interleaved"``, channels 2j and
    2j + 1 (Llama 4's complex form)."""
    rope_layer_attr: str | None = None
    """Attribute of the attention module that is False on a layer without RoPE (Llama 4's
    ``use_rope``, from ``config.no_rope_layers``); None: every layer rotates q and k."""
    post_rope_qk_norm: str | None = None
    """Attribute of the attention module holding a norm applied to q and k after RoPE (Llama 4's
    ``qk_norm``, an L2 norm without a scale, on its RoPE layers only); a module without it has
    none. None: no such norm."""
    attention_temperature: bool = False
    """On a layer without RoPE whose module sets ``attn_temperature_tuning`` (Llama 4), the query
    is multiplied by ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))`` (the module's
    attributes), each token's position read from the position ids
    (``surgery.attention.chunked``)."""
    chunked_attention: bool = False
    """The layers whose ``config.layer_types`` entry is ``"chunked_attention"`` attend causally
    within chunks of ``config.attention_chunk_size`` positions (Llama 4's RoPE layers); on a packed
    batch the chunks follow each document's own positions (``surgery.attention.chunked``)."""
    positions_to_attention: bool = False
    """The decoder layers do not pass ``position_ids`` on to the attention (Llama 4): the base
    model's forward is wrapped to hand them to it under a keyword of surgery's own
    (``surgery.forwards.base_model``)."""
    eager_softmax_fp32: bool = True
    """transformers' eager attention of ``module`` takes its softmax in fp32, as
    ``lean_eager_attention`` does; False (Llama 4: in the scores' dtype): the eager
    implementation runs the module's own function."""
    position_query_scale: bool = False
    """After RoPE the query is multiplied by transformers' ``get_llama_4_attn_scale`` of
    ``module``, ``1 + beta * log(1 + floor(position / original))`` with ``llama_4_scaling_beta``
    and ``original_max_position_embeddings`` of the config's ``rope_parameters`` (Ministral 3,
    Mistral 4), each token's position read from the position ids: a packed document restarting
    at 0 gets its own."""
    latent_attention: bool = False
    """The attention is multi-head latent attention (Mistral 4's MLA: low-rank query, one
    compressed key/value latent per token, a rotary key part shared by all heads): its instances
    get ``surgery.attention.mla.mla_attention_forward`` in place of the generic attention
    forward."""
    mrope: bool = False
    """Multimodal RoPE (Qwen2-VL and later): the rotary module takes (3, batch, seq) temporal,
    height and width positions and gives each frequency the angle of one of them (its
    ``mrope_section``). The base model hands the attention the positions its rotary module takes
    (``surgery.forwards.base_model``), and ``apply_rope`` rotates with the sections, their layout
    (contiguous or interleaved) read from the rotary module's own ``recomposition_frequencies``
    at patch time (``surgery.attention.forward.mrope_layout``)."""
    multimodal: tuple[MultimodalWrapper, ...] = ()
    """The multimodal models whose language model can be this architecture's text model (Gemma
    3's ``Gemma3ForConditionalGeneration``; Mistral 3's wraps a Mistral or a Ministral 3)."""

    @property
    def name(self) -> str:
        """Short name: ``model_type`` without ``_text`` (``gemma3``); ``apply_<name>`` and the
        convergence suite's ``--model`` use it."""
        return self.model_type.removesuffix("_text")

    @property
    def apply_name(self) -> str:
        """Name of the class-level entry point, e.g. ``apply_llama``."""
        return "apply_" + self.name

    @property
    def row_layout_free(self) -> bool:
        """Whether nothing of the architecture but its attention reads where a token sits in its
        row (``PatchOptions.padding_free`` runs the real tokens of a padded batch as one row):
        no linear attention (a recurrent state along the row), shared keys and values, latent
        attention, multimodal RoPE, chunked attention, Llama 4's positions, query scale,
        temperature and RoPE-less layers, or RoPE per layer type. A model's sliding windows and
        RoPE type are its config's, read at patch time (``surgery.api``)."""
        return not (
            self.linear_attention is not None
            or self.kv_sharing
            or self.latent_attention
            or self.mrope
            or self.chunked_attention
            or self.positions_to_attention
            or self.position_query_scale
            or self.attention_temperature
            or self.rope_layer_attr is not None
            or self.rope_per_layer_type
        )

    def _resolve(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def mlp_sparsity(self, mlp: object) -> float:
        """The activation sparsity of the MLP module ``mlp`` (``mlp_sparsity_attr``): 0 for a
        plain gated MLP, which the fused activation computes; nonzero, its own forward stays."""
        if self.mlp_sparsity_attr is None:
            return 0.0
        return getattr(mlp, self.mlp_sparsity_attr, 0.0) or 0.0

    def is_instance(self, module: object, name: str) -> bool:
        """Whether ``module`` is an instance of transformers' own class ``name`` of ``module``
        (or of a subclass), matched by where the class was defined, not by what the module-level
        name points to now: other libraries rebind those names (Liger-Kernel's class-level
        patches put their own classes there)."""
        return _is_instance_of(module, self.module, name)

    def wrapper_of(self, module: object) -> MultimodalWrapper | None:
        """The ``multimodal`` wrapper ``module`` is an instance of, when its text config is this
        architecture's; else None."""
        text = getattr(getattr(module, "config", None), "text_config", None)
        if getattr(text, "model_type", None) != self.model_type:
            return None
        return next((w for w in self.multimodal if w.is_instance(module)), None)

    def rebound_functions(self) -> dict[str, object]:
        """transformers' functions the generic forwards call (``apply_rotary_pos_emb``,
        ``eager_attention_forward``) whose name in ``module`` now points to a function defined
        elsewhere (another library rebound it), with that function. Rebound class names do not
        matter: modules are matched with ``is_instance``."""
        found = {}
        for name in ("apply_rotary_pos_emb", "eager_attention_forward"):
            obj = getattr(importlib.import_module(self.module), name, None)  # Llama 4: no rotary
            if obj is not None and getattr(obj, "__module__", None) != self.module:
                found[name] = obj
        return found

    def causal_lm_class(self) -> type:
        return self._resolve(self.causal_lm)

    def rms_norm_class(self) -> type:
        return self._resolve(self.rms_norm)

    def gated_activation(self, config) -> str | None:
        """The ``gated_activation`` name of the MLP activation ``config`` asks for, or None when
        there is no fused kernel for it."""
        return GATED_ACTIVATIONS.get(getattr(config, self.mlp_activation_attr, None))

    def rotary_pos_emb(self):
        """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` of this module, or None where
        it has none (Llama 4, whose attention always gets position ids)."""
        return getattr(importlib.import_module(self.module), "apply_rotary_pos_emb", None)

    def load_balancing_loss(self):
        """transformers' ``load_balancing_loss_func`` of this module (MoE architectures)."""
        return self._resolve("load_balancing_loss_func")

    def eager_attention(self):
        """The module's own eager attention (Gemma2's applies the attention-logit softcap)."""
        return self._resolve("eager_attention_forward")
