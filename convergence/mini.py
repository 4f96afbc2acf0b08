"""Mini models of an architecture, built from transformers' own config class.

The tests' tiny models and the convergence suite's tiny and full ones all come from an
architecture's ``MiniConfig`` (``surgery.convergence.minis``, by ``model_type``): the caller picks
the shape (``MiniSize``), the mini config says what makes the architecture differ from Llama
(sliding windows, softcaps, layer types, RoPE parameters, ...) and which attention implementation
it needs. An architecture without an entry there gets transformers' config class at the size
alone, so a new spec is tested and proven with no other edit.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "MINI_VISION_TOWER",
    "MiniConfig",
    "MiniMultimodalConfig",
    "MiniSize",
    "alternating_layer_types",
    "from_size",
    "text_hidden_size",
]


@dataclass(frozen=True)
class MiniSize:
    """The shape of a mini model, chosen by its user (tests/models/tiny.py, the convergence suite's
    ``SIZES``); every field but ``sliding_window`` is passed to every config class."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int
    """The window of the architectures that have one (their arguments ask for it with
    ``from_size("sliding_window")``); set it shorter than the sequences, so that it clips."""

    def config_kwargs(self) -> dict[str, int]:
        # MiniSize's own fields only: a user's subclass may add fields of its own (the
        # convergence suite's batch shape).
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(MiniSize)
            if f.name != "sliding_window"
        }


@dataclass(frozen=True)
class _FromSize:
    name: str

    def __call__(self, size: MiniSize) -> Any:
        return getattr(size, self.name)


def from_size(name: str) -> Callable[[MiniSize], Any]:
    """A config argument whose value is the field ``name`` of the mini model's size."""
    if name not in {f.name for f in dataclasses.fields(MiniSize)}:
        raise ValueError(f"MiniSize has no field {name!r}")
    return _FromSize(name)


def alternating_layer_types(size: MiniSize) -> list[str]:
    """Sliding and full attention layers in turn, sliding first: even two layers have both kinds."""
    return [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(size.num_hidden_layers)
    ]


@dataclass(frozen=True)
class MiniConfig:
    """How to build the config of an architecture's mini model (see the module docstring)."""

    config_class: str
    """transformers' config class, a name in the ``transformers`` namespace (resolved lazily)."""
    arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Config arguments that make the architecture differ from Llama, each kept as strict as the
    patch needs: a softcap small enough to bite, a window that clips, both layer types present. A
    callable value is called with the ``MiniSize``: ``from_size`` or a module-level function such as
    ``alternating_layer_types``. Read only; ``build`` copies the values."""
    attn_implementation: str | None = None
    """The attention implementation the architecture needs (Gemma2: ``"eager"``; sdpa cannot apply
    its attention-logit softcap), or None: the caller's choice."""

    def attention(self, requested: str = "sdpa") -> str:
        """The attention implementation to build with: the one the architecture needs, if any,
        else ``requested``."""
        return self.attn_implementation or requested

    def build(self, size: MiniSize, **overrides: Any) -> PretrainedConfig:
        """A new config: ``size``, then ``arguments``, then ``overrides`` (the caller's token ids,
        ``use_cache``, ...). Values are copied, so that no two configs share a nested dict."""
        import transformers

        kwargs: dict[str, Any] = size.config_kwargs()
        for name, value in self.arguments.items():
            kwargs[name] = value(size) if callable(value) else copy.deepcopy(value)
        kwargs.update(copy.deepcopy(overrides))
        return getattr(transformers, self.config_class)(**kwargs)


@dataclass(frozen=True)
class MiniMultimodalConfig:
    """How to build the config of a multimodal wrapper's mini model around a text mini config: a
    vision tower of its own tiny size, and the special tokens (image, begin/end of image, ...) at
    the end of the text vocabulary, so that the rest of the vocabulary is text."""

    config_class: str
    """transformers' config class of the wrapper (``Gemma3Config``)."""
    vision_config_class: str
    vision_arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The vision config's arguments: a tiny tower (one layer, a few patches per image). A
    callable value (a module-level function, as in ``MiniConfig``) is called with the text
    config (``text_hidden_size``)."""
    special_tokens: tuple[str, ...] = ()
    """Config arguments naming special token ids, the image token's first: given the last ids of
    the text vocabulary, in this order (``vocab_size - 1`` first)."""
    arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Any other argument of the wrapper's config (how many tokens an image becomes, ...);
    callables as in ``vision_arguments``."""
    text_arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Arguments the text mini config takes inside this wrapper, on top of its own (Qwen's
    multimodal RoPE sections, sized to the mini head): the caller builds the text config with
    them (``tests/models/test_multimodal.py``)."""

    def text_vocabulary(self, text_config: PretrainedConfig) -> int:
        """Token ids below this are text: the special tokens take the rest."""
        return text_config.vocab_size - len(self.special_tokens)

    def build(self, text_config: PretrainedConfig, **overrides: Any) -> PretrainedConfig:
        """A new config around ``text_config`` (copied); ``overrides`` replace any argument."""
        import transformers

        def values(arguments: Mapping[str, Any]) -> dict[str, Any]:
            return {
                name: value(text_config) if callable(value) else copy.deepcopy(value)
                for name, value in arguments.items()
            }

        vision = getattr(transformers, self.vision_config_class)(**values(self.vision_arguments))
        tokens = {
            name: text_config.vocab_size - 1 - i for i, name in enumerate(self.special_tokens)
        }
        kwargs = {**tokens, **values(self.arguments), **copy.deepcopy(overrides)}
        return getattr(transformers, self.config_class)(
            text_config=copy.deepcopy(text_config), vision_config=vision, **kwargs
        )


# The multimodal wrappers' vision towers in small: one layer of width 16, two heads. Each wrapper
# adds its patches and what else its vision config asks for (``MiniMultimodalConfig``).
MINI_VISION_TOWER = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def text_hidden_size(text_config: PretrainedConfig) -> int:
    """A vision argument: the text model's hidden size (a tower that projects into it)."""
    return text_config.hidden_size
