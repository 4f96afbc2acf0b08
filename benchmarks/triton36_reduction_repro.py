"""Triton 3.6 fails to compile this kernel for Hopper; 3.9 compiles it (issue 38).

The smallest form of the kernel Inductor (torch 2.11) made of a compiled Qwen3-MoE step on a
packed batch when surgery handed transformers' load-balancing loss a mask of ones built in the
graph: one persistent reduction summing a loaded row (the loss's token weights) beside a
broadcast constant (the mask's token count), a scalar made of both before two stores.

    $ python benchmarks/triton36_reduction_repro.py     # no GPU needed: compiles for sm_90
    triton 3.6.0, sm_90: FAILED: PassManager::run failed
      ... error: operand #0 does not dominate this use
      ... Pipeline failed while executing [`TritonGPURemoveLayoutConversions` ...]
    triton 3.9.0, sm_90: compiled

Computing ``total`` after the first store compiles on 3.6. In the model, surgery's workaround
(``surgery.kernels.reduction.every_token_mask``) hands the loss an int64 mask from an op, the
graph of a caller's own attention mask of ones, which compiled on the H200 where a constant mask
and an fp32 one did not; tests/surgery/test_compile.py pins it on the GPU (every MoE model,
compiled, packed) and on the CPU (the op in the graph).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget


@triton.jit
def two_reductions(io_ptr, x_ptr, out_ptr, XBLOCK: tl.constexpr):
    R: tl.constexpr = 1024
    r = tl.arange(0, R)[None, :]
    mask = r < 558
    x = tl.load(x_ptr + r, mask, other=0.0)
    one = tl.full([1, 1], 1.0, tl.float32)
    a = tl.sum(tl.where(mask, tl.broadcast_to(x, [XBLOCK, R]), 0), 1)[:, None]
    n = tl.sum(tl.where(mask, tl.broadcast_to(one, [XBLOCK, R]), 0), 1)[:, None]
    b = 2.0 / n
    total = a + b
    tl.store(out_ptr + tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1), b, None)
    tl.store(io_ptr + tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1), total, None)


def main() -> None:
    signature = {"io_ptr": "*fp32", "x_ptr": "*fp32", "out_ptr": "*fp32", "XBLOCK": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    source = triton.compiler.ASTSource(
        fn=two_reductions, signature=signature, constexprs={"XBLOCK": 1}, attrs=aligned
    )
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        verdict = "compiled"
    except Exception as err:  # Triton raises RuntimeError from its MLIR pass manager
        verdict = f"FAILED: {str(err).splitlines()[0]}"
    print(f"triton {triton.__version__}, sm_90: {verdict}")


if __name__ == "__main__":
    main()
