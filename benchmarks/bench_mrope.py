"""Multimodal RoPE cases of bench_rope.py (``--mrope``): Qwen2.5-VL-7B's heads and position ids.

    python benchmarks/bench_rope.py --mrope --out benchmarks/results/rope
    python benchmarks/bench_mrope.py --out benchmarks/results/rope           # the same run

Shapes (bf16): q (4, 28, 2048, 128) / k (4, 4, 2048, 128) and q (1, 28, 8192, 128) /
k (1, 4, 8192, 128), ``mrope_section`` [16, 24, 24] (contiguous), rope_theta 1e6, (3, B, T)
position ids from transformers' ``Qwen2_5_VLModel.get_rope_index`` on rows of text, images and
videos. Peers: transformers' eager path (``Qwen2_5_VLRotaryEmbedding`` + ``apply_rotary_pos_emb``),
its torch.compile, Liger's ``liger_multimodal_rotary_pos_emb`` (which takes cos/sin of all three
position rows, (3, B, T, D), computed here the way transformers' Qwen2-VL module did before it
recomposed them itself), and surgery's cos/sin drop-in on the module's recomposed cos/sin. Writes
``rope_mrope.json`` / ``.png``; the timing, correctness gate and report are bench_rope.py's.
"""

from __future__ import annotations

import functools
import sys

import torch
from rope_timing import Mode, rotary_module

MROPE_SHAPES = [(4, 28, 4, 2048, 128), (1, 28, 4, 8192, 128)]  # (B, Hq, Hk, T, D)
# Qwen2.5-VL-7B's text rotary configuration.
MROPE_ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
# One row of the multimodal batch, repeated while it fits and then filled with text: text, an
# image of 48 x 64 patches (24 x 32 tokens after the 2 x 2 merge), text, a video of 4 temporal
# patches of 24 x 32 (4 x 12 x 16 tokens), as (modality, t, h, w) with 1 image and 2 video.
MROPE_ROW = (64, (1, 1, 48, 64), 32, (2, 4, 24, 32), 16)
MROPE_TOKEN_IDS = {"image": 60, "video": 61, "start": 62, "end": 63}


def build_mrope_rotary(head_dim, device):
    """Qwen2.5-VL-7B's text rotary module."""
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    return rotary_module(Qwen2_5_VLTextConfig, Qwen2_5_VLRotaryEmbedding, 28, 4, head_dim,
                         128000, MROPE_ROPE_PARAMETERS, device)  # fmt: skip


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


MROPE = Mode(
    "rope_mrope", "mrope", MROPE_SHAPES, build_mrope_rotary, mrope_positions,
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


if __name__ == "__main__":
    import bench_rope

    bench_rope.main(["--mrope", *sys.argv[1:]])
