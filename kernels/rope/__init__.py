"""Position-aware rotary embedding (RoPE) in three channel layouts.

For the first r = ``rotary_dim`` channels of each head, channel pair j < r/2 is rotated by

    angle  = float32(position) * inv_freq[j]                    (fp32, exactly as transformers)
    out_a  = s (x_a cos(angle) - x_b sin(angle))
    out_b  = s (x_b cos(angle) + x_a sin(angle))                 (s = attention_scaling)

where the pair (a, b) is read and written at (``layout``):

    "half"                 read (j, j + r/2),   write (j, j + r/2)   transformers' rotate_half
    "interleaved"          read (2j, 2j + 1),   write (2j, 2j + 1)   Llama 4's complex form
    "interleaved_to_half"  read (2j, 2j + 1),   write (j, j + r/2)   Mistral 4 / DeepSeek MLA

and channels r..D-1 pass through unchanged. Multimodal RoPE (``mrope_section``, Qwen2-VL and
later) keeps all of this and changes only the position: frequency j is rotated by
``position_ids[s(j), b, t] * inv_freq[j]``, s(j) its section's row of the (3, B, T) temporal,
height and width positions, sections contiguous or interleaved over the frequencies.

The map is a scaled rotation followed by a fixed permutation, so its backward is the same kernel
with the angle negated and the read and write layouts swapped: dx = s P_in R(-angle) P_out^T dout.

``apply_rope`` computes cos/sin in the kernel from ``position_ids``, once per (token, frequency)
and reused across every head of q and k in the program, so no (B, T, D) cos/sin tensors exist,
and packed rows whose positions restart at 0 (or start at a cache offset) are rotated right.
On NVIDIA GPUs cos/sin come from the SFU after a range reduction to [-pi, pi]: absolute error
below 1e-6, invisible next to bf16/fp16 rounding (2e-3/2.4e-4) and to the fp32 rounding of the
angle itself (position * 6e-8 rad) that transformers' own path carries too.

Modules, in reading order: ``kernel`` (Triton kernels) -> ``launch`` (host launchers
``rope_fwd``, ``rope_bwd``, ``rope_cos_sin_fwd``, ``rope_cos_sin_bwd``, the launch configuration
and the PyTorch path) -> ``ops`` (torch.library ops and autograd) -> ``api`` (``apply_rope``,
``apply_rotary_pos_emb``), with the fp32 reference ``apply_rope_reference`` in ``reference``.
"""

from __future__ import annotations

from .api import apply_rope, apply_rotary_pos_emb
from .kernel import rope_cos_sin_kernel, rope_fwd_kernel
from .launch import (
    DEFAULT_LAUNCH,
    INTERPRETER_LAUNCH,
    LAYOUTS,
    RopeLaunch,
    RopeLayout,
    mrope_rows,
    rope_bwd,
    rope_cos_sin_bwd,
    rope_cos_sin_fwd,
    rope_fwd,
)
from .launch import _launch_cos_sin as _launch_cos_sin  # the FastLaunchers: test_launch.py
from .launch import _launch_rope as _launch_rope  # inspects their caches
from .reference import apply_rope_reference, multimodal_angles

__all__ = [
    "DEFAULT_LAUNCH",
    "INTERPRETER_LAUNCH",
    "LAYOUTS",
    "RopeLaunch",
    "RopeLayout",
    "apply_rope",
    "apply_rope_reference",
    "apply_rotary_pos_emb",
    "mrope_rows",
    "multimodal_angles",
    "rope_bwd",
    "rope_cos_sin_bwd",
    "rope_cos_sin_fwd",
    "rope_cos_sin_kernel",
    "rope_fwd",
    "rope_fwd_kernel",
]
