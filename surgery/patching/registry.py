"""Which architectures are supported, and finding the transformers model inside whatever was passed
(a bare model, a PEFT wrapper, any module that contains one)."""

from __future__ import annotations

from torch import nn

from surgery.models import MULTIMODAL_ONLY_SPECS, SPECS, ArchitectureSpec

__all__ = [
    "SupportMatrix",
    "UnsupportedModelError",
    "find_causal_lm",
    "kernels_applied",
    "supported",
]


class UnsupportedModelError(ValueError):
    """The model holds no causal LM of a supported architecture."""


def kernels_applied(spec: ArchitectureSpec) -> list[str]:
    """What ``patch`` swaps in a model of ``spec`` with every option on (``describe`` says what
    it did to one model, and why anything was left)."""
    kernels = ["fused loss", "mla" if spec.latent_attention else "mrope" if spec.mrope else "rope"]
    if spec.rms_norm is not None:
        kernels.append("rms_norm")
    if spec.mlp is not None:
        kernels.append("gated_mlp")
    if spec.router_aux_loss or spec.batched_experts is not None:
        kernels.append("experts")
    if spec.linear_attention is not None:
        kernels.append("linear attention per document")
    return kernels


class SupportMatrix(dict):
    """``config.model_type`` -> ``ArchitectureSpec`` (a dict), printed as a table: the causal-LM
    class, the name ``apply_<name>`` and the convergence suite's ``--model`` take, what is
    fused, and the multimodal wrappers patched around the text model."""

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        rows = [
            (
                spec.model_type,
                spec.name,
                spec.causal_lm,
                ", ".join(kernels_applied(spec)),
                ", ".join(w.wrapper for w in spec.multimodal) or "-",
            )
            for spec in self.values()
        ]
        for spec in MULTIMODAL_ONLY_SPECS:  # a text model with no causal LM of its own
            for w in spec.multimodal:
                kernels = ", ".join(kernels_applied(spec))
                rows.append((w.model_type, w.model_type, "-", kernels, w.wrapper))
        return rows

    def __str__(self) -> str:
        header = ("model_type", "name", "causal LM", "kernels", "multimodal wrappers")
        rows = [header, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows
        ]
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__


def supported() -> SupportMatrix:
    """``config.model_type`` -> spec, for every supported architecture; ``print`` shows a table
    (``SupportMatrix``)."""
    return SupportMatrix((spec.model_type, spec) for spec in SPECS)


def _text_specs() -> dict[str, ArchitectureSpec]:
    """``model_type`` -> spec of every text architecture, those without a causal LM of their own
    (``MULTIMODAL_ONLY_SPECS``) included."""
    return {spec.model_type: spec for spec in SPECS + MULTIMODAL_ONLY_SPECS}


def _spec_of(module: nn.Module) -> ArchitectureSpec | None:
    """The spec of a supported causal LM, or of the text model of a supported multimodal wrapper
    (``ArchitectureSpec.multimodal``)."""
    config = getattr(module, "config", None)
    spec = supported().get(getattr(config, "model_type", None))
    if spec is not None and spec.is_instance(module, spec.causal_lm):
        return spec
    text_type = getattr(getattr(config, "text_config", None), "model_type", None)
    spec = _text_specs().get(text_type)
    if spec is not None and spec.wrapper_of(module) is not None:
        return spec
    return None


def is_text_model(module: nn.Module, spec: ArchitectureSpec) -> bool:
    """Whether ``module`` is the text base model of ``spec`` (what its causal LM holds as
    ``model``, a multimodal wrapper as its language model): a transformers model of the spec's
    module and ``model_type`` that is its own base model and holds the rotary module."""
    config = getattr(module, "config", None)
    return (
        getattr(config, "model_type", None) == spec.model_type
        and type(module).__module__ == spec.module
        and getattr(module, "base_model", None) is module
        and hasattr(module, spec.rotary_attr)
    )


def _text_model_spec(model: nn.Module) -> ArchitectureSpec | None:
    # The outermost transformers model only: a registered text model inside another model
    # (a classifier, a multimodal wrapper outside the registry) is not patched on its own.
    from transformers import PreTrainedModel

    outer = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    spec = _text_specs().get(getattr(getattr(outer, "config", None), "model_type", None))
    return spec if spec is not None and is_text_model(outer, spec) else None


def _refuse_bidirectional(lm: nn.Module, spec: ArchitectureSpec) -> None:
    config = lm.config if spec.wrapper_of(lm) is None else lm.config.text_config
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    # Gemma 4's "vision" makes only image tokens bidirectional, through the multimodal model's
    # mask (see MultimodalWrapper.bidirectional_tokens); True (Gemma 3) or "all" is every token.
    if bidirectional and bidirectional != "vision":
        raise UnsupportedModelError(
            f"surgery does not support {type(lm).__name__} with use_bidirectional_attention="
            f"{bidirectional!r} (an encoder: every token attends to every other); surgery's "
            "attention shortcuts (varlen_attention, causal_right_padding) are causal"
        )


def find_causal_lm(model: nn.Module) -> tuple[nn.Module, ArchitectureSpec]:
    """The outermost supported causal LM in ``model`` (``model`` itself, or the transformers model
    inside a ``PeftModel``), or multimodal wrapper of one (``ArchitectureSpec.multimodal``), with
    its spec; else, when the outermost transformers model in ``model`` is a supported text base
    model (a wrapper's language model, passed on its own), that model. Raises
    ``UnsupportedModelError`` naming the supported architectures, or for a text model that
    attends in both directions (``use_bidirectional_attention``)."""
    for module in model.modules():
        spec = _spec_of(module)
        if spec is not None:
            _refuse_bidirectional(module, spec)
            return module, spec
    spec = _text_model_spec(model)
    if spec is not None:
        lm = next(m for m in model.modules() if is_text_model(m, spec))
        _refuse_bidirectional(lm, spec)
        return lm, spec
    config = getattr(model, "config", None)
    names = ", ".join(f"{s.causal_lm} ({s.model_type})" for s in SPECS)
    raise UnsupportedModelError(
        f"surgery does not support {type(model).__name__}"
        + (f" (model_type={config.model_type!r})" if hasattr(config, "model_type") else "")
        + f"; supported architectures: {names}"
    )
