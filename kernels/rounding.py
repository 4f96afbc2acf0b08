"""fp32 -> storage dtype conversion rounding to nearest even everywhere, the interpreter included.

GPUs round fp32 -> bf16 to nearest even, and so does torch. Triton's interpreter truncates instead
(tests/utils.py measures it), which on CPU CI would double a bf16 kernel's rounding error and, for a
kernel that must reproduce transformers' intermediate bf16 rounding (RMSNorm's Llama casting), turn
bit-equal results into one-ulp differences. Under the interpreter the bits are rounded first.
"""

from __future__ import annotations

from .dispatch import triton_available

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch paths
    triton = None

__all__ = ["round_to"]


if triton is not None:

    @triton.jit
    def round_to(x, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):
        """``x`` (fp32) converted to ``out_ty`` with round-to-nearest-even on every backend."""
        if INTERPRETED and out_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(out_ty)
