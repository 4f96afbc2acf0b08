"""What a compiled patched training step saves for its backward, by the forward op that made it.

    python benchmarks/saved_activations.py --model qwen3_moe --layers 2 [--scenario padded]

Builds ``train_step``'s model (``train_step.build_model``: ``--layers`` of its layers, bf16,
CUDA; CPU in fp32 without a GPU), patches it with surgery's defaults, compiles it with AOT
autograd and the min-cut partitioner (what Inductor partitions with) and runs one step on
``train_step``'s 2 x ``--seq`` batch. For each
forward graph it prints the tensors handed to the backward, grouped by the op that computed them
(views and ``getitem`` followed back to it): count and MiB. ``placeholder`` rows are the graph's
inputs (parameters among them).

The memory-peak reports (``memory_peak``) label a block by the code that allocated it; Inductor
reuses a dead buffer for a later tensor, so a compiled step's blocks do not say what they hold.
This says what the graph keeps.
"""

from __future__ import annotations

import argparse
import operator
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


# Views whose schema says they return a new tensor.
_VIEWS_BY_NAME = {"aten._unsafe_view.default", "aten.reshape.default"}


def _is_view(target) -> bool:
    """``getitem``, or an op whose output aliases its input (a view, ``t``, ``detach``, ...)."""
    if target is operator.getitem or str(target) in _VIEWS_BY_NAME:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def producer(node):
    """The op that computed ``node``'s value, through views and tuple items."""
    while node.op == "call_function" and _is_view(node.target):
        node = node.args[0]
    return str(node.target) if node.op == "call_function" else node.op


def saved_by_op(gm) -> list[tuple[str, int, float]]:
    """(op, tensors, MiB) of what forward graph ``gm`` returns for the backward, largest first."""
    import torch

    count, size = Counter(), Counter()
    for out in list(gm.graph.nodes)[-1].args[0]:
        if not isinstance(out, torch.fx.Node):
            continue
        key, val = producer(out), out.meta.get("val")
        count[key] += 1
        size[key] += val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
    return [(k, count[k], size[k] / 2**20) for k, _ in size.most_common()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_moe")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--scenario", default="padded", choices=["padded", "packed"])
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args(argv)

    import torch
    import train_step
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = train_step.build_model(args.model, False, device, dtype, layers=args.layers)
    train_step.apply_contender(model, "surgery")
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=keep,
        bw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
    )
    vocab = model.config.get_text_config().vocab_size
    data, _ = train_step.make_batch(args.scenario, 2, args.seq, vocab, device, 0)
    with torch.no_grad():
        model(**data)  # transformers' output-capturing hooks, installed eagerly
    model.compile(backend=backend)
    model(**data).loss.backward()
    for i, gm in enumerate(graphs):
        print(f"forward graph {i}: what the backward gets, by the op that made it")
        for op, n, mib in saved_by_op(gm):
            print(f"  {mib:>10,.1f} MiB {n:>4}  {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
