"""RoPE on one GPU: surgery's kernels beside transformers' eager path, torch.compile and Liger.

    python benchmarks/bench_rope.py --out benchmarks/results/rope [--sweep] [--mrope]

Shapes (bf16, Llama-3-8B heads): q (4, 32, 2048, 128) / k (4, 8, 2048, 128) and q (1, 32, 8192, 128)
/ k (1, 8, 8192, 128), both made as (B, T, H, D) and viewed ``.transpose(1, 2)``: the layout
transformers hands over. Every contender is first checked against the fp32 reference at these
shapes (output and both gradients), then timed with ``triton.testing.do_bench`` (median). Achieved
bandwidth counts the bytes that must move (q and k read once and written once per pass) and is
compared with a plain copy of q + k timed in the same run. Writes ``rope.json`` and ``rope.png``
to ``--out`` and prints a table last. ``--sweep`` also times other launch configurations of the
surgery kernel (to check the fixed default). ``--rounds`` (default 3) repeats the timings over all
contenders in turn and keeps each figure's median: the GPU machine's host is shared, and host-bound
figures (forward+backward in eager mode) move by up to 2x between minutes of one run.

``--mrope`` times multimodal RoPE instead (writes ``rope_mrope.json`` / ``.png``): Qwen2.5-VL-7B's
heads, q (4, 28, 2048, 128) / k (4, 4, 2048, 128) and q (1, 28, 8192, 128) / k (1, 4, 8192, 128),
``mrope_section`` [16, 24, 24] (contiguous), rope_theta 1e6, (3, B, T) position ids from
transformers' ``Qwen2_5_VLModel.get_rope_index`` on rows of text, images and videos. Peers:
transformers' eager path (``Qwen2_5_VLRotaryEmbedding`` + ``apply_rotary_pos_emb``), its
torch.compile, Liger's ``liger_multimodal_rotary_pos_emb`` (which takes cos/sin of all three
position rows, (3, B, T, D), computed here the way transformers' Qwen2-VL module did before it
recomposed them itself), and surgery's cos/sin drop-in on the module's recomposed cos/sin.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SHAPES = [(4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128)]  # (B, Hq, Hk, T, D)
MROPE_SHAPES = [(4, 28, 4, 2048, 128), (1, 28, 4, 8192, 128)]  # Qwen2.5-VL-7B's heads
# Qwen2.5-VL-7B's text rotary configuration.
MROPE_ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
DTYPE = torch.bfloat16
# Llama-3.1-8B's rotary configuration.
ROPE_PARAMETERS = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Correctness gate before timing: the error budget of tests/utils.py TOLERANCES[bf16] (a contender
# may exceed transformers' own bf16 error against the fp32 reference by 1.5x + 2e-3).
BUDGET_FACTOR, BUDGET_FLOOR = 1.5, 2e-3
TARGET_FRACTION_OF_COPY = 0.75
TARGET_FRACTION_OF_LIGER = 0.5
DEVICE = "cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for rope.json and rope.png")
    p.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    p.add_argument(
        "--mrope", action="store_true", help="multimodal RoPE at Qwen2.5-VL-7B's heads instead"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument(
        "--rounds", type=int, default=3, help="timing rounds over all contenders (median kept)"
    )
    return p.parse_args(argv)


def import_liger(module_name, fn_name):
    import importlib
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


def build_rotary(head_dim, device):
    """Llama-3.1-8B's rotary module (the text benchmark)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=32 * head_dim,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=head_dim,
        max_position_embeddings=131072,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=64,
        rope_parameters=dict(ROPE_PARAMETERS),
    )
    return LlamaRotaryEmbedding(cfg).to(device)


def text_positions(B, T, device):
    return torch.arange(T, device=device)[None]  # what transformers builds for an unpacked batch


def build_mrope_rotary(head_dim, device):
    """Qwen2.5-VL-7B's text rotary module (the --mrope benchmark)."""
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    cfg = Qwen2_5_VLTextConfig(
        hidden_size=28 * head_dim,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=128000,
        rope_parameters=dict(MROPE_ROPE_PARAMETERS),
    )
    return Qwen2_5_VLRotaryEmbedding(cfg).to(device)


# One row of the multimodal batch, repeated while it fits and then filled with text: text, an
# image of 48 x 64 patches (24 x 32 tokens after the 2 x 2 merge), text, a video of 4 temporal
# patches of 24 x 32 (4 x 12 x 16 tokens), as (modality, t, h, w) with 1 image and 2 video.
MROPE_ROW = (64, (1, 1, 48, 64), 32, (2, 4, 24, 32), 16)


MROPE_TOKEN_IDS = {"image": 60, "video": 61, "start": 62, "end": 63}


@functools.cache
def tiny_qwen2_5_vl():
    """A tiny Qwen2.5-VL whose ``get_rope_index`` makes the position ids: only its merge size
    (2) and tokens per second matter."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    ids = MROPE_TOKEN_IDS
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=1, intermediate_size=8, vocab_size=64,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, out_hidden_size=32, intermediate_size=16,
                           num_heads=2, spatial_merge_size=2, tokens_per_second=2),
        image_token_id=ids["image"], video_token_id=ids["video"],
        vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
    )  # fmt: skip
    return Qwen2_5_VLModel(cfg)


def mrope_positions(B, T, device):
    """(3, B, T) position ids from transformers' own ``get_rope_index`` for B rows of
    ``MROPE_ROW``s (as many as fit in T), the rest text."""
    image, video, start, end = (MROPE_TOKEN_IDS[n] for n in ("image", "video", "start", "end"))
    ids, types, images, videos = [], [], [], []
    row_len = sum(p if isinstance(p, int) else 2 + p[1] * p[2] * p[3] // 4 for p in MROPE_ROW)
    for _ in range(T // row_len):
        for part in MROPE_ROW:
            if isinstance(part, int):
                ids += [1] * part
                types += [0] * part
                continue
            kind, t, h, w = part
            n = t * h * w // 4
            ids += [start] + [image if kind == 1 else video] * n + [end]
            types += [0] + [kind] * n + [0]
            (images if kind == 1 else videos).append([t, h, w])
    ids += [1] * (T - len(ids))
    types += [0] * (T - len(types))
    grid = lambda g: torch.tensor(g * B) if g else None
    pos, _ = tiny_qwen2_5_vl().get_rope_index(
        torch.tensor([ids] * B), torch.tensor([types] * B), image_grid_thw=grid(images),
        video_grid_thw=grid(videos), second_per_grid_ts=torch.ones(len(videos) * B),
    )  # fmt: skip
    return pos.to(device)


def mrope_cos_sin_3rows(module, x, pos):
    """cos/sin of every position row, (3, B, T, D), as Liger's multimodal RoPE takes them (what
    transformers' Qwen2-VL rotary module returned before it recomposed the rows itself)."""
    freqs = pos[..., None].float() * module.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = module.attention_scaling
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


@dataclass(frozen=True)
class Mode:
    """What differs between the text benchmark and ``--mrope``."""

    name: str  # the stem of the output files
    shapes: list
    build_rotary: Callable  # (head_dim, device) -> transformers' rotary module
    positions: Callable  # (B, T, device) -> position ids as the model hands them over
    hf_apply: str  # module.function of transformers' rotation
    liger: tuple[str, str]  # Liger's entry point (module, function)
    liger_cos_sin: Callable | None  # (module, x, pos) -> Liger's cos/sin; None: the module's
    rope_kwargs: dict = field(default_factory=dict)  # apply_rope's extra arguments
    rope_parameters: dict = field(default_factory=dict)
    positions_doc: str = ""


TEXT = Mode(
    "rope", SHAPES, build_rotary, text_positions,
    "transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
    ("liger_kernel.transformers.rope", "liger_rotary_pos_emb"), None,
    rope_parameters=ROPE_PARAMETERS,
    positions_doc="(1, T) arange, as transformers builds for an unpacked batch",
)  # fmt: skip
MROPE = Mode(
    "rope_mrope", MROPE_SHAPES, build_mrope_rotary, mrope_positions,
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.apply_rotary_pos_emb",
    ("liger_kernel.transformers.qwen2vl_mrope", "liger_multimodal_rotary_pos_emb"),
    mrope_cos_sin_3rows,
    rope_kwargs={"mrope_section": MROPE_ROPE_PARAMETERS["mrope_section"]},
    rope_parameters=MROPE_ROPE_PARAMETERS,
    positions_doc=(
        "(3, B, T) from transformers' Qwen2_5_VLModel.get_rope_index, rows of text, an image "
        f"and a video {MROPE_ROW} repeated, then text"
    ),
)  # fmt: skip


def contenders(mode, module, liger_fn, compile_peer, q0, pos0):
    """name -> (forward, including the cos/sin its caller computes; the rotation alone given
    cos/sin computed once from ``q0`` and ``pos0``, or None)."""
    import importlib

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


HOST_TOKENS = 16  # the GPU work is negligible next to the host's


def host_us(mode, shape, fwd, device, calls=500):
    """Host (CPU) time per call in microseconds, forward and forward+backward, at the case's heads
    and 16 tokens, whose kernels take a few microseconds: a loop of calls without
    synchronisation, then one synchronisation. What a model step pays per layer beside the GPU
    work, and what decides the do_bench times when a pass is shorter on the GPU than on the
    host."""
    import time

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


def plot(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, case in zip(axes[0], results):
        names = list(case["contenders"])
        names = [n for n in names if "fwd_bwd_ms" in case["contenders"][n]]
        fwd = [case["contenders"][n]["fwd_ms"] for n in names]
        both = [case["contenders"][n]["fwd_bwd_ms"] for n in names]
        x = range(len(names))
        bars_f = ax.bar([i - 0.2 for i in x], fwd, width=0.4, label="forward")
        bars_b = ax.bar([i + 0.2 for i in x], both, width=0.4, label="forward + backward")
        ax.bar_label(bars_f, fmt="%.3f", fontsize=7)
        ax.bar_label(bars_b, fmt="%.3f", fontsize=7)
        copy_ms = case["copy"]["ms"]
        ax.axhline(copy_ms, color="k", ls="--", lw=1, label="copy of q+k (forward floor)")
        ax.axhline(2 * copy_ms, color="gray", ls=":", lw=1, label="2x copy (fwd+bwd floor)")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("ms (median)")
        ax.set_title(case["name"])
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}, bf16, transformers layout; cos/sin computation included for peers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_rope.py: no CUDA device found; this benchmark times GPU kernels only.")
    # Measure the checkout beside this script, never another surgery on sys.path (a wheel in
    # PYTHONPATH): later ``from surgery.kernels import ...`` find this one in sys.modules.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import import_surgery

    surgery_from = os.path.dirname(os.path.dirname(import_surgery().__file__))
    import transformers
    import triton
    from triton.testing import do_bench

    os.makedirs(args.out, exist_ok=True)
    device = torch.device(DEVICE)
    torch.manual_seed(0)
    mode = MROPE if args.mrope else TEXT
    liger_fn, liger_info = import_liger(*mode.liger)

    def bench(fn, grad_to_none=None):
        return do_bench(
            fn, warmup=args.warmup, rep=args.rep, grad_to_none=grad_to_none, return_mode="median"
        )

    results = []
    for shape in mode.shapes:
        case, sweep_inputs = bench_case(
            mode, shape, bench, liger_fn, not args.no_compile, device, args.rounds
        )
        if args.sweep:
            case["sweep"] = sweep(mode, shape, *sweep_inputs, bench)
        results.append(case)
        del sweep_inputs
        torch.cuda.empty_cache()

    report = {
        "benchmark": mode.name,
        "surgery_loaded_from": surgery_from,
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
        },
        "liger": liger_info,
        "dtype": "bfloat16",
        "layout": "q, k made as (B, T, H, D) and viewed .transpose(1, 2), as transformers does",
        "rope_parameters": mode.rope_parameters,
        "positions": mode.positions_doc,
        "transformers_rotation": mode.hf_apply,
        "timing": (
            "triton.testing.do_bench median in ms, L2 flushed between runs. Inputs require grad. "
            "fwd: the forward alone; fwd_bwd: forward + autograd.backward with fixed upstream "
            "grads in transformers' layout, .grad reset between runs. *_graph_ms: the same pass "
            "captured in a CUDA graph and replayed (GPU time alone, no host overhead); "
            "targets_met uses the do_bench times, targets_met_graph the graph times. "
            "host_*_us: host (CPU) time per call at q (1, 32, 16, 128) / k (1, 8, 16, 128), "
            "where the GPU work is negligible: a loop of calls, synchronised once. Every figure "
            "is the median over `rounds` rounds of all contenders in turn (each round's values "
            "in contenders.*.rounds). autograd_floor: the same do_bench loops through an "
            "autograd.Function whose forward and backward only allocate their outputs (no GPU "
            "work): the host-time floor of any eager autograd implementation."
        ),
        "rounds": args.rounds,
        "cos_sin": (
            "hf_eager, torch_compile, liger and surgery_cos_sin are timed INCLUDING the cos/sin "
            "computation by transformers' rotary module (part of their cost in a model; for "
            "Liger's multimodal RoPE, the cos/sin of all three position rows, (3, B, T, D)); "
            "the *_apply_only fields time the rotation alone with cos/sin precomputed. surgery "
            "computes cos/sin inside its kernel from position_ids and inv_freq."
        ),
        "bytes": (
            "must-move bytes: forward reads q and k once and writes them once, "
            "2 * (|q| + |k|) * 2 B; forward + backward twice that. *_frac_copy = achieved "
            "bandwidth / copy bandwidth."
        ),
        "copy": "clone of one contiguous bf16 buffer of |q| + |k| elements (reads + writes)",
        "correctness": (
            "before timing, each contender's output and q/k gradients vs the fp32 reference at "
            f"the benchmark shape; correct if rel err <= {BUDGET_FACTOR} x hf_eager's + "
            f"{BUDGET_FLOOR}"
        ),
        "targets": {
            "fraction_of_copy_bandwidth": TARGET_FRACTION_OF_COPY,
            "fraction_of_liger_time": TARGET_FRACTION_OF_LIGER,
        },
        "cases": results,
    }
    json_path = os.path.join(args.out, f"{mode.name}.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot(results, os.path.join(args.out, f"{mode.name}.png"), "RoPE" if mode is TEXT else "mrope")
    print_table(report, json_path)
    if not all(case["contenders"]["surgery"].get("correct") for case in results):
        sys.exit("bench_rope.py: surgery's kernel failed the correctness check (see rope.json)")


def print_table(report, json_path):
    print(f"\n{report['benchmark']} on {report['device']} (bf16); peers include cos/sin; liger: "
          f"{report['liger']}")  # fmt: skip
    for case in report["cases"]:
        sweep = case.get("sweep", [])
        for row in sweep[:3] + [r for r in sweep[3:] if r["default"]]:
            print(f"sweep {case['name']}: block_t={row['block_t']} tile={row['tile_elems']} "
                  f"warps={row['num_warps']}{' (default)' if row['default'] else ''}: fwd "
                  f"{row['fwd_kernel_ms']:.4f} ms ({100 * row['fwd_frac_copy']:.0f}% copy), bwd "
                  f"{row['bwd_kernel_ms']:.4f} ms")  # fmt: skip
    for case in report["cases"]:
        copy = case["copy"]
        print(f"\n{case['name']}   copy of q+k: {copy['ms']:.4f} ms = {copy['GBps']:.0f} GB/s")
        print(f"{'contender':<16}{'fwd ms':>9}{'%copy':>6}{'fwd+bwd ms':>12}{'%copy':>6}"
              f"{'graph f/fb ms':>17}{'apply-only f/fb':>17}{'host f/fb us':>14}{'max err':>9}"
              f"{'ok':>6}")  # fmt: skip
        for name, e in case["contenders"].items():
            if "error" in e:
                print(f"{name:<16} error: {e['error'][:90]}")
                continue
            ao = (f"{e['fwd_apply_only_ms']:.3f}/{e['fwd_bwd_apply_only_ms']:.3f}"
                  if "fwd_apply_only_ms" in e else "-")  # fmt: skip
            gr = "/".join(
                f"{e[k]:.3f}" if k in e else "-" for k in ("fwd_graph_ms", "fwd_bwd_graph_ms")
            )
            host = "/".join(
                f"{e[k]:.0f}" if k in e else "-" for k in ("host_fwd_us", "host_fwd_bwd_us")
            )
            print(f"{name:<16}{e['fwd_ms']:>9.4f}{100 * e['fwd_frac_copy']:>5.0f}%"
                  f"{e['fwd_bwd_ms']:>12.4f}{100 * e['fwd_bwd_frac_copy']:>5.0f}%{gr:>17}{ao:>17}"
                  f"{host:>14}{max(e['rel_err'].values()):>9.1e}"
                  f"{e.get('correct', '?')!s:>6}")  # fmt: skip
        floor = case["autograd_floor"]
        print(f"{'no-op Function':<16}{floor['fwd_ms']:>9.4f}{'':>6}{floor['fwd_bwd_ms']:>12.4f}"
              "   (autograd + timing floor, no GPU work)")  # fmt: skip
        for kind in ("", "_graph"):
            met = ", ".join(f"{k}: {v}" for k, v in case[f"targets_met{kind}"].items())
            print(f"targets ({'do_bench' if not kind else 'CUDA graph'}): {met}")
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
