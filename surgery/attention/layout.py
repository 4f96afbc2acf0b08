"""What a batch's layout (its real tokens, rolled rows, packed documents) shares as it travels from
the causal-LM forward to every attention layer as a keyword argument."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

__all__ = ["BatchLayout"]


class BatchLayout:
    """Base of the frozen dataclasses that carry a batch's layout to the attention layers.

    ``to(device)`` gives the layout on ``device``: its tensors moved there, but those named in
    ``HOST_FIELDS`` (kept on the host on purpose), nested layouts moved alike, the rest as it is;
    the same object where nothing moves. A model split over devices (``device_map``) gets its
    layers' inputs moved to each layer's device by accelerate's hooks, which call ``to`` on any
    object that has one: the layout follows the hidden states from device to device."""

    HOST_FIELDS: ClassVar[tuple[str, ...]] = ()

    def to(self, device: torch.device | str, non_blocking: bool = False):
        device = torch.device(device)
        moved = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor) and field.name not in self.HOST_FIELDS:
                if value.device != device:
                    moved[field.name] = value.to(device, non_blocking=non_blocking)
            elif isinstance(value, BatchLayout):
                nested = value.to(device, non_blocking)
                if nested is not value:
                    moved[field.name] = nested
        return dataclasses.replace(self, **moved) if moved else self  # type: ignore[type-var]
