"""Triton kernels of the gated activation (the map and its derivative are stated in
``surgery.kernels.gated_activation``).

Two layouts, each with a forward and a backward kernel:

    split   gate and up are two contiguous tensors of one shape, walked as flat arrays, one
            program per BLOCK elements (``gated_activation_fwd_kernel``, ``..._bwd_kernel``).
    merged  gate and up are the two halves of one contiguous (rows, 2 width) tensor, gate in its
            first ``width`` columns; one program per BLOCK_M x BLOCK_N tile of the (rows, width)
            output (``gated_activation_merged_fwd_kernel``, ``..._bwd_kernel``). The merged
            backward writes dgate and dup into one (rows, 2 width) tensor laid out the same way.

Every kernel loads in its storage dtype, computes in fp32 and rounds once on store
(``_store_rounded``); the math is shared by all four (``_gated_product``, ``_gated_grads``), only
the addressing differs.
The ACTIVATION constexpr is ``ACTIVATIONS[name]`` of ``launch``: 0 silu, 1 gelu_tanh.
"""

from __future__ import annotations

from ..dispatch import triton_available
from ..rounding import round_to

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    triton = None

__all__ = [
    "gated_activation_bwd_kernel",
    "gated_activation_fwd_kernel",
    "gated_activation_merged_bwd_kernel",
    "gated_activation_merged_fwd_kernel",
]


if triton is not None:

    @triton.jit
    def _act_and_gate(g, ACTIVATION: tl.constexpr):
        # (act(g), sigmoid factor s with act(g) = g * s)
        if ACTIVATION == 0:
            s = tl.sigmoid(g)
        else:
            t = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            s = tl.sigmoid(2.0 * t)
        return g * s, s

    @triton.jit
    def _gated_product(g, u, ACTIVATION: tl.constexpr):
        # act(g) * u in fp32 from fp32 g, u.
        a, _ = _act_and_gate(g, ACTIVATION)
        return a * u

    @triton.jit
    def _gated_grads(dout, g, u, ACTIVATION: tl.constexpr):
        # (dgate, dup) in fp32 from fp32 dout, g, u, recomputing act(g) and act'(g).
        a, s = _act_and_gate(g, ACTIVATION)
        if ACTIVATION == 0:
            da = s * (1.0 + g * (1.0 - s))
        else:
            dt = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
            da = s + 2.0 * a * (1.0 - s) * dt
        return dout * u * da, dout * a

    @triton.jit
    def _load_fp32(g_ptrs, u_ptrs, mask):
        # (g, u) in fp32, masked-off lanes 0.
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        return g, tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _store_rounded(ptrs, x, mask, INTERPRETED: tl.constexpr):
        # fp32 x rounded once to the pointee dtype of ptrs, then stored.
        tl.store(ptrs, round_to(x, ptrs.dtype.element_ty, INTERPRETED), mask=mask)

    @triton.jit
    def _flat_block(numel, BLOCK: tl.constexpr):
        # (offsets, mask) of this program's BLOCK contiguous elements; int64 offsets.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        return offs, offs < numel

    @triton.jit
    def _merged_tile(rows, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # (out_offs, gate_offs, mask) of this program's BLOCK_M x BLOCK_N tile of the (rows,
        # width) output: out rows ``width`` apart, gate_up rows ``2 width`` apart (up at
        # gate_offs + width); int64 row offsets.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm < rows)[:, None] & (rn < width)[None, :]
        row = rm.to(tl.int64)[:, None]
        return row * width + rn[None, :], row * (2 * width) + rn[None, :], mask

    @triton.jit
    def gated_activation_fwd_kernel(
        g_ptr,
        u_ptr,
        out_ptr,
        numel,
        BLOCK: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """out = act(g) * u over ``numel`` contiguous elements; one program per BLOCK."""
        offs, mask = _flat_block(numel, BLOCK)
        g, u = _load_fp32(g_ptr + offs, u_ptr + offs, mask)
        _store_rounded(out_ptr + offs, _gated_product(g, u, ACTIVATION), mask, INTERPRETED)

    @triton.jit
    def gated_activation_bwd_kernel(
        dout_ptr,
        g_ptr,
        u_ptr,
        dg_ptr,
        du_ptr,
        out_ptr,
        numel,
        BLOCK: tl.constexpr,
        ACTIVATION: tl.constexpr,
        STORE_OUT: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """dg and du from dout, recomputing act(g); with STORE_OUT also the forward's output
        act(g) * u (the same bits), for a caller that needs it again (``gated_linear``'s weight
        gradient); one program per BLOCK elements."""
        offs, mask = _flat_block(numel, BLOCK)
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g, u = _load_fp32(g_ptr + offs, u_ptr + offs, mask)
        dg, du = _gated_grads(dout, g, u, ACTIVATION)
        _store_rounded(dg_ptr + offs, dg, mask, INTERPRETED)
        _store_rounded(du_ptr + offs, du, mask, INTERPRETED)
        if STORE_OUT:
            _store_rounded(out_ptr + offs, _gated_product(g, u, ACTIVATION), mask, INTERPRETED)

    @triton.jit
    def gated_activation_merged_fwd_kernel(
        gate_up_ptr,
        out_ptr,
        rows,
        width,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """out[r, c] = act(gate_up[r, c]) * gate_up[r, width + c]; one program per
        BLOCK_M x BLOCK_N tile of out (rows x width), gate_up rows 2 * width apart."""
        o_offs, g_offs, mask = _merged_tile(rows, width, BLOCK_M, BLOCK_N)
        g, u = _load_fp32(gate_up_ptr + g_offs, gate_up_ptr + g_offs + width, mask)
        _store_rounded(out_ptr + o_offs, _gated_product(g, u, ACTIVATION), mask, INTERPRETED)

    @triton.jit
    def gated_activation_merged_bwd_kernel(
        dout_ptr,
        gate_up_ptr,
        dgate_up_ptr,
        rows,
        width,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACTIVATION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """dgate_up (rows x 2 width: dgate then dup) from dout (rows x width), recomputing
        act(gate); one program per BLOCK_M x BLOCK_N tile of dout."""
        o_offs, g_offs, mask = _merged_tile(rows, width, BLOCK_M, BLOCK_N)
        dout = tl.load(dout_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
        g, u = _load_fp32(gate_up_ptr + g_offs, gate_up_ptr + g_offs + width, mask)
        dg, du = _gated_grads(dout, g, u, ACTIVATION)
        _store_rounded(dgate_up_ptr + g_offs, dg, mask, INTERPRETED)
        _store_rounded(dgate_up_ptr + g_offs + width, du, mask, INTERPRETED)

else:  # pragma: no cover - CPU installs without triton use the PyTorch path
    gated_activation_fwd_kernel = gated_activation_bwd_kernel = None
    gated_activation_merged_fwd_kernel = gated_activation_merged_bwd_kernel = None
