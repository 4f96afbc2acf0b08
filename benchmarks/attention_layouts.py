"""Causal attention forward and forward+backward at Llama ~1B's shapes (2 x 4096 tokens, 32 query
heads, 8 key/value heads, head dim 64, bf16) through sdpa's cuDNN and flash kernels over the padded
(batch, seq) layout, and through flash attention's variable-length kernel
(``torch.nn.attention.varlen.varlen_attn``) over the same rows as one packed row, whole (8192
tokens) and with 512 padding tokens left out (7680). Why ``surgery.attention.unpadding`` keeps the
attention in the padded layout.

    python benchmarks/attention_layouts.py > benchmarks/results/padding_free_attention.txt
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, S, H, HK, D = 2, 4096, 32, 8, 64
LAYERS = 16


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("attention_layouts: needs a CUDA device (run it on the GPU machine)")
    from torch.nn.attention.varlen import varlen_attn
    from triton.testing import do_bench

    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    rows = []
    q, k, v = leaf(B, H, S, D), leaf(B, HK, S, D), leaf(B, HK, S, D)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip

        def fwd(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def step(fwd=fwd):
            fwd().backward(dout)

        with torch.no_grad():
            forward = do_bench(fwd)
        rows.append((f"{name}, padded {B}x{S}", forward, do_bench(step)))
    for tokens, bounds in ((B * S, [0, S, 2 * S]), (B * S - 512, [0, S, 2 * S - 512])):
        qv, kv, vv = leaf(tokens, H, D), leaf(tokens, HK, D), leaf(tokens, HK, D)
        dv = torch.randn(tokens, H, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)

        def fwd(qv=qv, kv=kv, vv=vv, cu=cu):
            return varlen_attn(qv, kv, vv, cu, cu, S, S, window_size=(-1, 0), **gqa)

        def step(fwd=fwd, dv=dv):
            fwd().backward(dv)

        with torch.no_grad():
            forward = do_bench(fwd)
        rows.append((f"varlen_attn, one row of {tokens}", forward, do_bench(step)))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, do_bench medians")
    print(f"{'contender':36s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {f'x{LAYERS} layers':>12s}")
    for name, forward, both in rows:
        print(f"{name:36s} {forward:8.3f} {both:11.3f} {LAYERS * both:12.1f}")


if __name__ == "__main__":
    main()
