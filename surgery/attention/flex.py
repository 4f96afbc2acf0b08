"""Softcapped eager attention (Gemma 2's) through torch's flex attention.

transformers runs Gemma 2 with ``attn_implementation="eager"``, as sdpa has no attention-logit
softcap: its eager function materialises the (batch, heads, seq, seq) scores, their tanh, the mask
added and the fp32 softmax, several passes over the square per layer. With ``flex_attention`` (the
option) such an attention, where the keys are the queries' own (training, a loss call, a
prefill; not a decoding step) and no attention weights are asked for, runs
transformers' ``flex_attention_forward`` instead (imported: the softcap as flex's score modifier,
flex compiled once by transformers) over a ``BlockMask`` made from the eager mask transformers
built: the scores stay in the kernel, in fp32, and blocks the mask leaves out are skipped.

The eager mask (batch, 1, q, kv), additive with 0 where attended and the dtype's lowest value (or
-inf) elsewhere (what transformers' eager masks hold), becomes a block mask once per mask tensor,
cached on it as the shared sdpa mask is: every layer of one forward (one mask per layer type) and
its backward use the one (with a device map, a layer on another GPU than the mask gets a copy of it,
and builds its own). Its mask function reads a boolean copy of the mask (kept while the mask lives)
inside the blocks the mask cuts; blocks it leaves out are skipped. Masks of other shapes or dtypes
stay with the eager function (one it broadcasts, one per head, a boolean one, which it adds to the
scores), and so do two kinds that one read of the mask on the host per mask tells: additive values
other than those two (a bias), and a query row that attends to no key (left padding; a padded
position whose sliding window holds only padding). There the finite eager mask spreads the softmax
evenly over every key, and its gradient reaches the queries and keys through scores the forward
rounded away, where flex gives zeros: a left-padded batch trains its last padded position (it
predicts the first real token), so the attention of such a batch is transformers' eager one, bit for
bit, as without the option.
"""

from __future__ import annotations

import torch
from torch import nn

from surgery.attention.shared_mask import tensor_version

__all__ = ["flex_layer", "flex_mask", "flex_runs", "flex_softcap_attention"]

FLEX_MASK_ATTR = "_surgery_flex_mask"
BLOCK = 128
"""flex attention's default block size, to which the mask is padded."""


DEVICES = ("cuda",)
"""Where flex runs: its compiled kernels are GPU kernels (on CPU the eager function is as good)."""
DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes flex runs in: in fp32 its products may take TF32, which the eager function's do not
(by default), so an fp32 model keeps the eager function."""


HEAD_DIMS = (16, 32, 64, 128, 256)
"""The head sizes flex runs: Inductor's flex kernels refuse fewer than 16; Gemma 2's are 128 and 256
(the benchmarks run 256, the GPU tests 32)."""


def flex_layer(module: nn.Module, wanted: bool, softcap: float | None) -> bool:
    """Whether an attention layer is one flex may run, whatever the call: the option asks for it
    (``wanted``, ``AttentionBinding.flex``), transformers' eager implementation, a ``softcap``, a
    head size in ``HEAD_DIMS``. The attention forward and ``describe`` both ask; what a call adds
    is ``flex_runs``."""
    return (
        wanted
        and softcap is not None
        and module.config._attn_implementation == "eager"
        and getattr(module, "head_dim", None) in HEAD_DIMS
    )


def flex_runs(query: torch.Tensor, dropout: float) -> bool:
    """Whether this call of a ``flex_layer`` runs ``flex_softcap_attention``: a tensor on one of
    ``DEVICES`` in one of ``DTYPES``, no attention dropout, no attention weights asked for
    (``output_attentions``: transformers' output collector), not while ``torch.compile`` traces
    (the mask's check reads it on the host; and dynamo drops writes to Python objects that follow
    a flex call in its graph, transformers' output collector's reset among them:
    ``test_flex_attention.py``), flex attention in torch. The caller checks that the
    keys are the queries' own (no cached ones: a decoding step keeps the eager function)."""
    return (
        query.device.type in DEVICES
        and query.dtype in DTYPES
        and not dropout
        and not _attentions_wanted()
        and not torch.compiler.is_compiling()
        and _flex_available()
    )


def _flex_available() -> bool:
    try:
        from transformers.integrations.flex_attention import flex_attention_forward  # noqa: F401
        from transformers.utils import is_torch_flex_attn_available
    except ImportError:
        return False
    return is_torch_flex_attn_available()


def _attentions_wanted() -> bool:
    """Whether the model call asked for the attention weights (``output_attentions``), which
    transformers gathers from the attention modules' outputs while its collector is active."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # no collector to ask: assume they are wanted, the eager path gives them
        return True
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def flex_mask(mask: torch.Tensor, batch: int, q_len: int, kv_len: int):
    """The ``BlockMask`` of an additive eager (batch, 1, q_len, >= kv_len) mask, built once per
    mask tensor, its version (an in-place refill builds anew) and ``kv_len``, and cached on the
    mask; None for a mask that stays with the eager function (the module docstring: a bias, a row
    attending to no key; and any other shape or dtype: a mask per head, one the eager function
    broadcasts over the batch or the queries, a boolean one, which the eager function adds to the
    scores rather than masks with). One read of the mask on the host per build."""
    if mask.dtype == torch.bool or mask.shape[:3] != (batch, 1, q_len) or mask.dim() != 4:
        return None
    key = (tensor_version(mask), kv_len)
    cached = getattr(mask, FLEX_MASK_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    sliced = mask[:, 0, :, :kv_len]
    allowed = sliced == 0
    lowest = torch.finfo(sliced.dtype).min
    masks_only = (allowed | (sliced == lowest) | (sliced == -torch.inf)).all()
    every_row = allowed.any(dim=-1).all()
    takes = bool(torch.stack([masks_only, every_row]).all())  # the one host read
    built = _block_mask(allowed) if takes else None
    setattr(mask, FLEX_MASK_ATTR, (key, built))
    return built


def _block_mask(allowed: torch.Tensor):
    """The ``BlockMask`` of a boolean (batch, q, kv) mask, read block by block: blocks with no
    attended pair are left out, blocks all attended are full (no mask function), the rest partial
    (the mask function reads the mask). Made from the mask directly (``BlockMask.from_kv_blocks``)
    rather than by ``create_block_mask``, whose evaluation of a mask function indexing a tensor
    makes a (q, kv) int64 index: 32 GiB at 65536 tokens."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, q_len, kv_len = allowed.shape
    # Padded to whole blocks (False): the mask function may be asked for positions in the last
    # blocks beyond the sequence.
    pad_q, pad_kv = -q_len % BLOCK, -kv_len % BLOCK
    padded = nn.functional.pad(allowed, (0, pad_kv, 0, pad_q), value=False).contiguous()
    blocks = padded.view(batch, padded.shape[1] // BLOCK, BLOCK, padded.shape[2] // BLOCK, BLOCK)
    some = blocks.any(dim=4).any(dim=2)  # (batch, q blocks, kv blocks)
    full = blocks.all(dim=4).all(dim=2)

    def kv_blocks(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Per query block: how many kv blocks, and their indices first, in ascending order.
        count = chosen.sum(dim=-1, dtype=torch.int32)[:, None]
        order = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True)
        return count, order.to(torch.int32)[:, None]

    def mask_mod(b, h, q, kv):
        return padded[b, q, kv]

    return BlockMask.from_kv_blocks(
        *kv_blocks(some & ~full), *kv_blocks(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )  # fmt: skip


def flex_softcap_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
) -> torch.Tensor | None:
    """The eager function's softcapped attention over (batch, heads, seq, head_dim) query, key
    and value (key and value with their own, fewer, heads) under ``attention_mask`` (None: every
    key attended, as the eager function does without one), through transformers'
    ``flex_attention_forward``: (batch, seq, heads, head_dim), the eager function's layout. None
    where the mask stays with the eager function (``flex_mask``): the caller runs that."""
    from transformers.integrations.flex_attention import flex_attention_forward

    block_mask = None
    if attention_mask is not None:
        batch, _, q_len, _ = query.shape
        block_mask = flex_mask(attention_mask, batch, q_len, key.shape[-2])
        if block_mask is None:
            return None
    output, _ = flex_attention_forward(
        module, query, key, value, block_mask, scaling=scaling, softcap=softcap
    )
    return output
