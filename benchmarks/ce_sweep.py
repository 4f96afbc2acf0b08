"""The cross entropy's row sweep at the H200's bandwidth: the kernel that, for a head the fused
products do not take, reads a row of logits for its log-sum-exp (and statistics), then reads it
again to write the logits' gradient in place (``kernels/cross_entropy/kernel.py``'s
``cross_entropy_fwd_kernel`` with a gradient: the eager and kept schedules, TRL's SFT and GRPO
heads on Llama and Qwen). Two reads and a write of the logits: the only memory pass those heads
add to their three products.

    python benchmarks/ce_sweep.py --out benchmarks/results
    python benchmarks/ce_sweep.py --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes: the order check

At the Llama 3 and Qwen 2.5 heads' logits (bf16, temperature 0.7, the entropy asked for, as TRL's
GRPO head), ``triton.testing.do_bench`` medians of:

- ``copy``: ``torch.Tensor.copy_`` of the logits (a read and a write: the bandwidth the sweep's
  traffic can reach where its second read hits L2);
- ``read``: a row maximum (one read);
- ``surgery``: the repository's kernel as the heads run it;
- ``same_order`` / ``reversed``: a minimal sweep of the same work (``sweep_kernel`` below), its
  second pass in the first's order or last block first, as an A/B of the order alone (surgery's
  kernel takes the reversed order: the blocks the first pass read last are partly still in L2).

Effective bandwidth counts 2 reads and 1 write for the sweeps. ``--smoke`` checks the minimal
sweep in both orders against torch (log-sum-exp, entropy, gradient).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, environment, import_surgery, table, write_json

SHAPES = {"llama3-8b": (8192, 128256), "qwen2.5-7b": (16384, 152064)}
SMOKE = {"tiny": (5, 300)}
TEMPERATURE = 0.7

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def sweep_kernel(ptr, stride, targets, lse_ptr, entropy_ptr, V, inv_t,
                     BLOCK: tl.constexpr, REVERSED: tl.constexpr):  # fmt: skip
        """One row a program: online log-sum-exp and entropy of x = z inv_t, then the gradient of
        the row's cross entropy (softmax minus the target's one-hot, times inv_t) in place."""
        row = tl.program_id(0)
        base = ptr + tl.cast(row, tl.int64) * stride
        target = tl.load(targets + row)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        se = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
            x = tl.where(mask, x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            r = tl.exp(m - m_new)
            ex = tl.exp(x - m_new)
            shift = tl.where(s > 0.0, m - m_new, 0.0) * s
            se = (se + shift) * r + tl.sum(ex * tl.where(mask, x - m_new, 0.0), 0)
            s = s * r + tl.sum(ex, 0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        tl.store(entropy_ptr + row, tl.log(s) - se / s)
        blocks = tl.cdiv(V, BLOCK)
        for i in range(0, blocks):
            v0 = (blocks - 1 - i) * BLOCK if REVERSED else i * BLOCK
            cols = v0 + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
            g = tl.exp(x - lse)
            g = tl.where(cols == target, g - 1.0, g) * inv_t
            tl.store(base + cols, g.to(ptr.dtype.element_ty), mask=mask)


def sweep(logits, targets, reversed_order, block, num_warps):
    """``sweep_kernel`` over every row of ``logits`` (written in place); returns (lse, entropy)."""
    import torch

    n, v = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lse)
    sweep_kernel[(n,)](logits, logits.stride(0), targets, lse, entropy, v, 1.0 / TEMPERATURE,
                       BLOCK=block, REVERSED=reversed_order, num_warps=num_warps)  # fmt: skip
    return lse, entropy


def smoke() -> list[str]:
    """Both orders of the minimal sweep against torch in fp32 (CPU, interpreter)."""
    import torch

    lines = []
    for name, (n, v) in SMOKE.items():
        z = torch.randn(n, v, dtype=torch.bfloat16)
        targets = torch.randint(0, v, (n,))
        x = z.float() / TEMPERATURE
        p = x.softmax(1)
        grad = (p - torch.nn.functional.one_hot(targets, v)) / TEMPERATURE
        for order in (False, True):
            out = z.clone()
            lse, entropy = sweep(out, targets, order, block=128, num_warps=4)
            torch.testing.assert_close(lse, x.logsumexp(1), rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy, -(p * p.log()).sum(1), rtol=0, atol=1e-5)
            torch.testing.assert_close(out.float(), grad.to(torch.bfloat16).float(), rtol=0,
                                       atol=1e-2)  # fmt: skip
            lines.append(f"{name} reversed={order}: lse, entropy and gradient as torch's")
    return lines


def measure(name: str, n: int, v: int, launch) -> list[dict]:
    """The contenders at one (rows, vocabulary) shape, in bf16 on the GPU; the minimal sweep in
    the repository kernel's launch configuration."""
    import torch
    from triton.testing import do_bench

    z = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    spare = torch.empty_like(z)
    targets = torch.randint(0, v, (n,), device="cuda")
    ones, zeros = torch.ones(n, device="cuda"), torch.zeros(n, device="cuda")
    entropy = torch.empty(n, device="cuda")
    gb = n * v * z.element_size() / 1e9
    config = (launch.FWD_BLOCK_V, launch.FWD_NUM_WARPS)
    contenders = {
        "copy": (lambda: spare.copy_(z), 2),
        "read": (lambda: z.amax(1), 1),
        "surgery": (lambda: launch.cross_entropy_fwd(
            z, targets, coef_ce=ones, coef_z=zeros, grad_out=z,
            inv_temperature=1.0 / TEMPERATURE, stats={"entropy": entropy}), 3),
        "same_order": (lambda: sweep(z, targets, False, *config), 3),
        "reversed": (lambda: sweep(z, targets, True, *config), 3),
    }  # fmt: skip
    rows = []
    for who, (fn, passes) in contenders.items():
        ms = float(do_bench(fn, warmup=50, rep=300, return_mode="median"))
        rows.append({"shape": name, "rows": n, "vocab": v, "contender": who, "ms": ms,
                     "tb_per_s": passes * gb / ms})  # fmt: skip
    return rows


def run(out: Path) -> list[dict]:
    import torch

    launch = importlib.import_module(f"{import_surgery().kernels.__name__}.cross_entropy.launch")
    rows = []
    for name, (n, v) in SHAPES.items():
        rows += measure(name, n, v, launch)
        torch.cuda.empty_cache()
    write_json(out / "ce_sweep.json", {"environment": environment(), "rows": rows})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        print("\n".join(smoke()))
        return
    rows = run(args.out)
    print(table(["shape", "contender", "ms", "TB/s"],
                [[r["shape"], r["contender"], f"{r['ms']:.3f}", f"{r['tb_per_s']:.2f}"]
                 for r in rows]))  # fmt: skip


if __name__ == "__main__":
    main()
