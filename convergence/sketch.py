"""Count sketches: fixed random linear maps that shrink a tensor of any size to a few thousand
numbers and keep distances, so that two runs which never hold their tensors at the same time can
still be compared tensor against tensor.

A count sketch ``S`` adds element i of the tensor named ``k`` into bucket ``h_k(i)`` with sign
``s_k(i)``, both drawn from a generator seeded by ``k`` (and the sketch's seed), so every run maps
the same element to the same bucket with the same sign: ``(S x)_b = Σ_{h(i)=b} s(i) x_i``. It is
linear, ``S x − S y = S (x − y)``, and keeps squared norms in expectation, ``E ‖S x‖² = ‖x‖²``.
For a vector spread over many elements ``‖S x‖ / ‖x‖`` is 1 to within about ``(2 · width)^-1/2``
(one standard deviation: 0.55% at the default width 2^14), so a relative error
``‖x − y‖ / ‖y‖`` read off two sketches is the tensors' own to within about 1%; a vector whose
mass sits in a few elements is kept exactly unless two of them share a bucket. The sum is taken
in fp64, so the sketch itself adds no rounding that matters beside fp32's.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

__all__ = ["SKETCH_WIDTH", "CountSketch"]

SKETCH_WIDTH = 1 << 14
# Elements hashed at a time: bounds the int64 bucket indices held at once (32 MiB).
_CHUNK = 1 << 22


class CountSketch:
    """``sketch([(name, tensor), ...])``: one fp64 CPU vector of ``width`` numbers for all the
    named tensors together (each element in its own random bucket), e.g. every parameter's
    gradient as one vector. ``sketch.one(name, tensor)`` sketches one tensor, and keeps it whole
    (flattened, fp64) when it has no more than ``width`` elements: exact, and no larger.

    The buckets come from the tensor's device's generator, so compare sketches made on one
    device. None stands for a missing tensor (a gradient that was never computed): ``one``
    returns None, the sum skips it.
    """

    def __init__(self, width: int = SKETCH_WIDTH, *, seed: int = 0):
        if width < 2 or width & (width - 1):
            raise ValueError(f"width must be a power of two, got {width}")
        self.width = width
        self.seed = seed
        self._bits = width.bit_length() - 1

    def _add(self, out: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.detach().reshape(-1)
        for chunk, start in enumerate(range(0, flat.numel(), _CHUNK)):
            x = flat[start : start + _CHUNK].to(torch.float64)
            g = torch.Generator(device=x.device)
            g.manual_seed((self.seed << 32) ^ zlib.crc32(f"{name}#{chunk}".encode()))
            # One draw gives both the bucket (low bits) and the sign (the bit above them).
            r = torch.randint(0, 2 * self.width, (x.numel(),), generator=g, device=x.device)
            out.index_add_(0, r & (self.width - 1), torch.where(r >> self._bits == 1, -x, x))

    def __call__(self, named: Iterable[tuple[str, torch.Tensor | None]]) -> torch.Tensor:
        out = None
        for name, tensor in named:
            if tensor is None:
                continue
            if out is None:
                out = torch.zeros(self.width, dtype=torch.float64, device=tensor.device)
            self._add(out, name, tensor)
        return torch.zeros(self.width, dtype=torch.float64) if out is None else out.cpu()

    def one(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if tensor.numel() <= self.width:
            return tensor.detach().reshape(-1).to("cpu", torch.float64)
        return self(((name, tensor),))
