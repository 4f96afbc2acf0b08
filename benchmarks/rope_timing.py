"""The machinery bench_rope.py runs for each RoPE variant: contenders, the fp32 correctness gate,
do_bench / CUDA-graph / host timings, one case's figures and the launch sweep.

A variant (text RoPE in bench_rope.py, multimodal RoPE in bench_mrope.py) is a ``Mode``: its
shapes, transformers' rotary module and rotation, its position ids and Liger's entry point.
Inputs are made as (B, T, H, D) and viewed ``.transpose(1, 2)``, the layout transformers hands
over; every contender is checked against the fp32 reference before it is timed.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DTYPE = torch.bfloat16
DEVICE = "cuda"
# Correctness gate before timing: the error budget of tests/utils.py TOLERANCES[bf16] (a contender
# may exceed transformers' own bf16 error against the fp32 reference by 1.5x + 2e-3).
BUDGET_FACTOR, BUDGET_FLOOR = 1.5, 2e-3
TARGET_FRACTION_OF_COPY = 0.75
TARGET_FRACTION_OF_LIGER = 0.5
HOST_TOKENS = 16  # the GPU work is negligible next to the host's


@dataclass(frozen=True)
class Mode:
    """One RoPE variant to benchmark: what differs between text RoPE and multimodal RoPE."""

    name: str  # the stem of the output files
    title: str  # the plot's title
    shapes: list  # (B, Hq, Hk, T, D) per case
    build_rotary: Callable  # (head_dim, device) -> transformers' rotary module
    positions: Callable  # (B, T, device) -> position ids as the model hands them over
    hf_apply: str  # module.function of transformers' rotation
    liger: tuple[str, str]  # Liger's entry point (module, function)
    liger_cos_sin: Callable | None  # (module, x, pos) -> Liger's cos/sin; None: the module's
    rope_kwargs: dict = field(default_factory=dict)  # apply_rope's extra arguments
    rope_parameters: dict = field(default_factory=dict)
    positions_doc: str = ""


def rotary_module(config_cls, rotary_cls, n_heads, n_kv_heads, head_dim, max_positions,
                  rope_parameters, device):  # fmt: skip
    """transformers' rotary module built from a one-layer ``config_cls`` with these heads: only
    the heads, ``head_dim``, ``max_positions`` and ``rope_parameters`` reach the module."""
    cfg = config_cls(
        hidden_size=n_heads * head_dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=64,
        rope_parameters=dict(rope_parameters),
    )
    return rotary_cls(cfg).to(device)


def import_liger(module_name, fn_name):
    from importlib import metadata

    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except Exception as e:  # missing wheel or a broken import: recorded, never fatal
        return None, {"missing": f"{type(e).__name__}: {e}"}
    try:
        version = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return fn, {"version": version, "function": f"{module_name}.{fn_name}"}


def rel_err(x, ref):
    x64, r64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return float((x64 - r64).norm() / r64.norm())


def contenders(mode, module, liger_fn, compile_peer, q0, pos0):
    """name -> (forward, including the cos/sin its caller computes; the rotation alone given
    cos/sin computed once from ``q0`` and ``pos0``, or None)."""
    from surgery.kernels import apply_rope, apply_rotary_pos_emb

    hf_module, hf_name = mode.hf_apply.rsplit(".", 1)
    hf_apply = getattr(importlib.import_module(hf_module), hf_name)
    module_cos_sin = lambda x, pos: module(x, pos)

    def with_cos_sin(cos_sin, apply):
        def fwd(q, k, pos):
            return apply(q, k, *cos_sin(q, pos))

        cos, sin = cos_sin(q0, pos0)
        return fwd, lambda q, k, pos: apply(q, k, cos, sin)

    def surgery(q, k, pos):
        return apply_rope(q, k, pos, module.inv_freq, module.attention_scaling, **mode.rope_kwargs)

    out = {
        "surgery": (surgery, None),
        "surgery_cos_sin": with_cos_sin(module_cos_sin, apply_rotary_pos_emb),
        "hf_eager": with_cos_sin(module_cos_sin, hf_apply),
    }
    if compile_peer:
        compiled = with_cos_sin(module_cos_sin, torch.compile(hf_apply))[1]
        out["torch_compile"] = (torch.compile(out["hf_eager"][0]), compiled)
    if liger_fn is not None:
        extra = [mode.rope_kwargs["mrope_section"]] if mode.liger_cos_sin else []
        cos_sin = module_cos_sin
        if mode.liger_cos_sin is not None:
            cos_sin = lambda x, pos: mode.liger_cos_sin(module, x, pos)

        def liger_apply(q, k, cos, sin):
            return tuple(liger_fn(q, k, cos, sin, *extra)[:2])

        out["liger"] = with_cos_sin(cos_sin, liger_apply)
    return out


class _NoOpRope(torch.autograd.Function):
    """The host-time floor of any autograd.Function RoPE: new outputs, no kernel."""

    @staticmethod
    def forward(ctx, q, k):
        return torch.empty_like(q), torch.empty_like(k)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        return torch.empty_like(grad_q), torch.empty_like(grad_k)


def autograd_floor(bench, q_base, k_base, pos, upstream):
    """do_bench ms of forward and forward+backward through ``_NoOpRope``: what the timing loop,
    autograd and the allocator cost with no GPU work; below it no eager contender can go."""
    leaves = [x.detach().clone().requires_grad_() for x in (q_base, k_base)]

    def fwd(q, k, pos):
        return _NoOpRope.apply(q, k)

    return {
        "fwd_ms": bench(lambda: run_pass(fwd, *leaves, pos, upstream, False)),
        "fwd_bwd_ms": bench(lambda: run_pass(fwd, *leaves, pos, upstream, True), leaves),
    }


def make_inputs(mode, B, Hq, Hk, T, D, device):
    # Leaves in transformers' storage layout (B, T, H, D); the contenders see .transpose(1, 2).
    q_base = torch.randn(B, T, Hq, D, device=device, dtype=DTYPE)
    k_base = torch.randn(B, T, Hk, D, device=device, dtype=DTYPE)
    gq = torch.randn(B, T, Hq, D, device=device, dtype=DTYPE).transpose(1, 2)
    gk = torch.randn(B, T, Hk, D, device=device, dtype=DTYPE).transpose(1, 2)
    return q_base, k_base, (gq, gk), mode.positions(B, T, device)


def run_pass(fwd, q_base, k_base, pos, upstream, backward):
    q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
    outs = fwd(q, k, pos)
    if backward:
        torch.autograd.backward(outs, upstream)
    return outs


def fp32_reference(mode, module, q_base, k_base, pos, upstream):
    from surgery.kernels import apply_rope_reference

    q = q_base.detach().float().requires_grad_()
    k = k_base.detach().float().requires_grad_()
    rq, rk = apply_rope_reference(
        q.transpose(1, 2), k.transpose(1, 2), pos, module.inv_freq, module.attention_scaling,
        **mode.rope_kwargs,
    )  # fmt: skip
    torch.autograd.backward((rq, rk), tuple(u.float() for u in upstream))
    return rq.detach(), rk.detach(), q.grad.transpose(1, 2), k.grad.transpose(1, 2)


def verify(fwd, q_base, k_base, pos, upstream, reference):
    # Fresh copies: Liger rotates its inputs (and the upstream gradients) in place.
    qb = q_base.detach().clone().requires_grad_()
    kb = k_base.detach().clone().requires_grad_()
    oq, ok = run_pass(fwd, qb, kb, pos, tuple(u.clone() for u in upstream), backward=True)
    rq, rk, rgq, rgk = reference
    return {
        "q": rel_err(oq, rq),
        "k": rel_err(ok, rk),
        "grad_q": rel_err(qb.grad.transpose(1, 2), rgq),
        "grad_k": rel_err(kb.grad.transpose(1, 2), rgk),
    }


def time_contender(bench, fwd, apply_only, q_base, k_base, pos, upstream):
    """Forward and forward+backward ms; for cos/sin peers also the rotation alone."""
    # Own copies of inputs and upstream grads: Liger writes both in place on every call.
    leaves = [x.detach().clone().requires_grad_() for x in (q_base, k_base)]
    up = tuple(u.clone() for u in upstream)  # clone keeps the transposed layout
    times = {}
    variants = {"": fwd}
    if apply_only is not None:
        variants["_apply_only"] = apply_only
    for suffix, fn in variants.items():
        times[f"fwd{suffix}_ms"] = bench(lambda fn=fn: run_pass(fn, *leaves, pos, up, False))
        times[f"fwd_bwd{suffix}_ms"] = bench(
            lambda fn=fn: run_pass(fn, *leaves, pos, up, True), grad_to_none=leaves
        )
    for key, backward in (("fwd", False), ("fwd_bwd", True)):
        try:
            times[f"{key}_graph_ms"] = graph_ms(
                bench, lambda backward=backward: run_pass(fwd, *leaves, pos, up, backward), leaves
            )
        except Exception as e:  # not every peer can be captured; recorded, not fatal
            times[f"{key}_graph_error"] = f"{type(e).__name__}: {e}"
    return times


def host_us(mode, shape, fwd, device, calls=500):
    """Host (CPU) time per call in microseconds, forward and forward+backward, at the case's heads
    and 16 tokens, whose kernels take a few microseconds: a loop of calls without
    synchronisation, then one synchronisation. What a model step pays per layer beside the GPU
    work, and what decides the do_bench times when a pass is shorter on the GPU than on the
    host."""
    _, Hq, Hk, _, D = shape
    q_base, k_base, upstream, pos = make_inputs(mode, 1, Hq, Hk, HOST_TOKENS, D, device)
    leaves = [x.requires_grad_() for x in (q_base, k_base)]
    out = {}
    for key, backward in (("host_fwd_us", False), ("host_fwd_bwd_us", True)):
        for _ in range(20):
            run_pass(fwd, *leaves, pos, upstream, backward)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            for leaf in leaves:
                leaf.grad = None
            run_pass(fwd, *leaves, pos, upstream, backward)
        torch.cuda.synchronize()
        out[key] = (time.perf_counter() - t0) / calls * 1e6
    return out


def graph_ms(bench, fn, leaves):
    """GPU time alone: ``fn`` captured in a CUDA graph and replayed, so that host overhead
    (Python, autograd, launches) cannot leave the GPU idle between kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, allocator)
        for _ in range(3):
            for leaf in leaves:
                leaf.grad = None
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None  # the captured backward writes .grad instead of accumulating into it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench(graph.replay)
    for leaf in leaves:
        leaf.grad = None
    del graph
    return ms


def bench_case(mode, shape, bench, liger_fn, compile_peer, device, n_rounds=3):
    B, Hq, Hk, T, D = shape
    name = f"q({B},{Hq},{T},{D}) k({B},{Hk},{T},{D})"
    module = mode.build_rotary(D, device)
    q_base, k_base, upstream, pos = make_inputs(mode, B, Hq, Hk, T, D, device)
    n_elems = q_base.numel() + k_base.numel()
    fwd_bytes = 2 * n_elems * q_base.element_size()  # read q, k once + write them once

    flat = torch.randn(n_elems, device=device, dtype=DTYPE)
    copy_ms = bench(lambda: flat.clone())
    copy_gbps = fwd_bytes / copy_ms / 1e6
    reference = fp32_reference(mode, module, q_base, k_base, pos, upstream)

    case = {
        "name": name,
        "shape": dict(zip(["B", "Hq", "Hk", "T", "D"], shape)),
        "copy": {"ms": copy_ms, "GBps": copy_gbps},
        "contenders": {},
    }
    peers = contenders(mode, module, liger_fn, compile_peer, q_base.transpose(1, 2), pos)
    rounds: dict[str, list[dict]] = {cname: [] for cname in peers}
    for cname, (fwd, _) in peers.items():
        entry = case["contenders"][cname] = {}
        try:
            entry["rel_err"] = verify(fwd, q_base, k_base, pos, upstream, reference)
        except Exception as e:  # a peer that breaks is recorded, not fatal
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"[{name}] {cname}: {entry['error']}", file=sys.stderr)
    # Rounds over all contenders in turn: load on the machine that varies in time weighs on all
    # of them alike; each figure is the median over the rounds.
    for _ in range(n_rounds):
        for cname, (fwd, apply_only) in peers.items():
            entry = case["contenders"][cname]
            if "error" in entry:
                continue
            try:
                args = (q_base, k_base, pos, upstream)
                times = time_contender(bench, fwd, apply_only, *args)
                times.update(host_us(mode, shape, fwd, device))
                rounds[cname].append(times)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                print(f"[{name}] {cname}: {entry['error']}", file=sys.stderr)
    floors = [autograd_floor(bench, q_base, k_base, pos, upstream) for _ in range(n_rounds)]
    case["autograd_floor"] = {
        key: statistics.median(f[key] for f in floors) for key in ("fwd_ms", "fwd_bwd_ms")
    }
    for cname, entry in case["contenders"].items():
        if "error" in entry or not rounds[cname]:
            continue
        for key in rounds[cname][0]:
            values = [r[key] for r in rounds[cname] if isinstance(r.get(key), float)]
            entry[key] = statistics.median(values) if values else rounds[cname][0][key]
        entry["rounds"] = rounds[cname]
        for key, n_bytes in (("fwd", fwd_bytes), ("fwd_bwd", 2 * fwd_bytes)):
            for kind in ("", "_graph"):
                if f"{key}{kind}_ms" in entry:
                    gbps = n_bytes / entry[f"{key}{kind}_ms"] / 1e6
                    entry[f"{key}{kind}_GBps"] = gbps
                    entry[f"{key}{kind}_frac_copy"] = gbps / copy_gbps

    hf_err = case["contenders"]["hf_eager"].get("rel_err")
    for entry in case["contenders"].values():
        if "rel_err" in entry and hf_err:
            entry["correct"] = all(
                err <= BUDGET_FACTOR * hf_err[key] + BUDGET_FLOOR
                for key, err in entry["rel_err"].items()
            )
    ours, liger = case["contenders"]["surgery"], case["contenders"].get("liger", {})
    for kind in ("", "_graph"):
        targets = {}
        for key in ("fwd", "fwd_bwd"):
            frac = ours.get(f"{key}{kind}_frac_copy", 0.0)
            targets[f"{key}_frac_copy>={TARGET_FRACTION_OF_COPY}"] = frac >= TARGET_FRACTION_OF_COPY
            met = None  # None: Liger missing or broken
            if f"{key}{kind}_ms" in liger and f"{key}{kind}_ms" in ours:
                met = ours[f"{key}{kind}_ms"] <= TARGET_FRACTION_OF_LIGER * liger[f"{key}{kind}_ms"]
            targets[f"{key}<={TARGET_FRACTION_OF_LIGER}x_liger"] = met
        case[f"targets_met{kind}"] = targets
    return case, (q_base, k_base, pos, module, copy_gbps)


def sweep(mode, shape, q_base, k_base, pos, module, copy_gbps, bench):
    from surgery.kernels.rope import DEFAULT_LAUNCH, RopeLaunch, rope_bwd, rope_fwd

    D = shape[-1]
    q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
    launch_kwargs = {}
    if "mrope_section" in mode.rope_kwargs:  # the launchers take the section as a tuple
        launch_kwargs["mrope_section"] = tuple(mode.rope_kwargs["mrope_section"])
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    rows = []
    for block_t in (2, 4, 8, 16):
        for tile_elems in (1024, 2048, 4096):
            for num_warps in (2, 4, 8):
                launch = RopeLaunch(block_t=block_t, tile_elems=tile_elems, num_warps=num_warps)
                args = (pos, module.inv_freq, module.attention_scaling, D)
                kw = dict(launch=launch, **launch_kwargs)
                f = bench(lambda kw=kw, args=args: rope_fwd(q, k, *args, **kw))
                b = bench(lambda kw=kw, args=args: rope_bwd(q, k, *args, **kw))
                rows.append({
                    "block_t": block_t, "tile_elems": tile_elems, "num_warps": num_warps,
                    "head_groups": launch.head_groups, "default": launch == DEFAULT_LAUNCH,
                    "fwd_kernel_ms": f, "bwd_kernel_ms": b,
                    "fwd_frac_copy": nbytes / f / 1e6 / copy_gbps,
                })  # fmt: skip
    rows.sort(key=lambda r: r["fwd_kernel_ms"] + r["bwd_kernel_ms"])
    return rows
