"""Which architectures are supported, and finding the transformers model inside whatever was passed
(a bare model, a PEFT wrapper, any module that contains one)."""

from __future__ import annotations

from torch import nn

from surgery.models import SPECS, ArchitectureSpec

__all__ = ["UnsupportedModelError", "find_causal_lm", "supported"]


class UnsupportedModelError(ValueError):
    """The model holds no causal LM of a supported architecture."""


def supported() -> dict[str, ArchitectureSpec]:
    """``config.model_type`` -> spec, for every supported architecture."""
    return {spec.model_type: spec for spec in SPECS}


def _spec_of(module: nn.Module) -> ArchitectureSpec | None:
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    spec = supported().get(model_type)
    if spec is not None and spec.is_instance(module, spec.causal_lm):
        return spec
    return None


def find_causal_lm(model: nn.Module) -> tuple[nn.Module, ArchitectureSpec]:
    """The outermost supported causal LM in ``model`` (``model`` itself, or the transformers model
    inside a ``PeftModel``), with its spec. Raises ``UnsupportedModelError`` naming the supported
    architectures."""
    for module in model.modules():
        spec = _spec_of(module)
        if spec is not None:
            return module, spec
    config = getattr(model, "config", None)
    names = ", ".join(f"{s.causal_lm} ({s.model_type})" for s in SPECS)
    raise UnsupportedModelError(
        f"surgery does not support {type(model).__name__}"
        + (f" (model_type={config.model_type!r})" if hasattr(config, "model_type") else "")
        + f"; supported architectures: {names}"
    )
