"""Where a packed hybrid batch leaks from one document into the next: transformers with and
without flash-linear-attention (fla), and surgery, on a tiny Qwen3.5 (fp32, random weights).

Two documents are packed in one row (position ids restarting, no attention mask, as
``DataCollatorWithFlattening`` makes them, with and without its ``cu_seq_lens_q``/``_k`` keyword
arguments). The first linear-attention layer's output at the second document's positions is
compared with the same layer's output on the second document alone. That layer's input is the
token embeddings, the same packed or alone, so any difference is the layer's own leak:

- the short convolution (window ``linear_conv_kernel_dim``, 4) reaching back across the boundary
  leaks into the document's first window - 1 positions;
- the recurrent state carried across the boundary leaks into every position.

    python benchmarks/hybrid_leak.py --out benchmarks/results   # CPU or CUDA

On CUDA with fla installed, "with fla" is fla itself (transformers binds its Gated DeltaNet to
fla's ``chunk_gated_delta_rule`` once fla imports). Elsewhere it is fla's varlen contract
computed by transformers' own PyTorch recurrence run on each ``cu_seqlens`` document alone (the
json says which).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import itertools
import json
from pathlib import Path

import torch

import surgery
from surgery.integrations import fla

DOCUMENTS = (11, 13)


def varlen_rule(pytorch):
    """transformers' PyTorch chunked rule honouring ``cu_seqlens`` as fla does: each document
    alone (what transformers' layer gets when fla is installed, off CUDA)."""

    @functools.wraps(pytorch)
    def rule(query, key, value, g, beta, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return pytorch(query, key, value, g=g, beta=beta, **kwargs)
        bounds = cu_seqlens.tolist()
        out = [
            pytorch(
                *(t[:, a:b] for t in (query, key, value)), g=g[:, a:b], beta=beta[:, a:b], **kwargs
            )[0]
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat(out, dim=1), None

    return rule


def varlen_conv(pytorch):
    """transformers' PyTorch convolution run on each document of the ``cu_seq_lens_q`` it is
    handed (transformers hands it its keyword arguments, and no kernel it binds reads them)."""

    @functools.wraps(pytorch)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            return pytorch(hidden_states, weight, bias, activation)
        bounds = cu_seqlens.tolist()
        return torch.cat(
            [pytorch(hidden_states[..., a:b], weight, bias, activation)
             for a, b in itertools.pairwise(bounds)], dim=-1,
        )  # fmt: skip

    return conv


def first_layer_output(model, **inputs) -> torch.Tensor:
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    seen = []
    handle = layer.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        model(**inputs, use_cache=False)
    handle.remove()
    return seen[0][0]


def measure(device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()
    module = importlib.import_module(type(model).__module__)
    bound = module.torch_chunk_gated_delta_rule
    pytorch = inspect.unwrap(bound)
    real_fla = bound is not pytorch and fla.linear_attention_kernels(device) is not None
    docs = [torch.randint(1, 97, (n,), device=device) for n in DOCUMENTS]
    first = DOCUMENTS[0]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n, device=device) for n in DOCUMENTS])[None]
    cu = torch.tensor([0, first, sum(DOCUMENTS)], device=device, dtype=torch.int32)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCUMENTS),
                        max_length_k=max(DOCUMENTS))  # fmt: skip

    conv = module.causal_conv1d_fn

    def leak(rule, patched=False, split_conv=False, **kwargs) -> list[float] | str:
        module.torch_chunk_gated_delta_rule = rule
        if split_conv:
            module.causal_conv1d_fn = varlen_conv(inspect.unwrap(conv))
        try:
            m = surgery.patch(model) if patched else model
            alone = first_layer_output(m, input_ids=docs[1][None])
            packed = first_layer_output(m, input_ids=ids, position_ids=positions, **kwargs)
        except ValueError as e:  # transformers refusing the batch
            return f"ValueError: {e}"
        finally:
            if patched:
                surgery.unpatch(model)
            module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn = bound, conv
        return (packed[first:] - alone).abs().amax(-1).tolist()

    # Without fla: transformers' own binding where fla is not installed (its fallback to the
    # PyTorch code, with whatever checks this release makes), else the PyTorch code itself.
    no_fla = pytorch if real_fla else bound
    fla_rule = bound if real_fla else varlen_rule(pytorch)
    rows = {
        "transformers, PyTorch path": leak(no_fla),
        "transformers, PyTorch path, cu_seq_lens_* passed": leak(no_fla, **flash_kwargs),
        "transformers with fla": leak(fla_rule),
        "transformers with fla, cu_seq_lens_* passed": leak(fla_rule, **flash_kwargs),
        "as the last, the convolution split by hand too": leak(
            fla_rule, split_conv=True, **flash_kwargs
        ),
        "surgery": leak(pytorch, patched=True),
    }
    import transformers

    return {
        "device": str(device),
        "transformers": transformers.__version__,
        "fla": "fla's kernels" if real_fla else "fla's varlen contract, PyTorch per document",
        "documents": list(DOCUMENTS),
        "conv_window": config.linear_conv_kernel_dim,
        "max_abs_diff_per_position_of_second_document": rows,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = measure(device)
    window = result["conv_window"] - 1
    print(f"{result['device']}; with fla: {result['fla']}; documents {result['documents']}")
    print(f"{'':50} {'first ' + str(window) + ' positions':>20} {'the rest':>12}")
    for name, diffs in result["max_abs_diff_per_position_of_second_document"].items():
        if isinstance(diffs, str):
            print(f"{name:50} {diffs[:80]}")
            continue
        print(f"{name:50} {max(diffs[:window]):>20.2e} {max(diffs[window:]):>12.2e}")
    if args.out is not None:
        path = args.out / f"hybrid_leak-{result['device'].split(':')[0]}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
