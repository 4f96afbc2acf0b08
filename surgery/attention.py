"""The one generic attention forward: q/k/v projections, optional q/k norm, RoPE through
``apply_rope`` from the position ids, the KV cache, and transformers' attention interface.

The model's rotary module still runs once per forward (it applies dynamic RoPE updates to its
frequencies); the attention reads the frequencies from it at call time instead of using the cos/sin
tables it produced.

With ``share_attention_mask`` (the default), a boolean 4-D mask bound for sdpa is converted to an
additive one (0 where attended, the dtype's lowest finite value elsewhere, in the query dtype) once
per forward, and every layer gets that one tensor. sdpa converts a boolean mask itself on every
call, and its masked backends (cuDNN on sm90, memory-efficient elsewhere) keep the converted copy
for the backward: one (batch, 1, seq, seq) tensor per layer, 64 MiB per layer at 2 x 4096 in bf16
(1 GiB for a 16-layer model). The lowest finite value rather than -inf, as transformers' own eager
masks and sdpa's cuDNN conversion use, so that no backend meets a row of -inf: every query row
with at least one attended key gets exactly the weights it gets with -inf (exp underflows to 0).
A query row that attends to no key (every left-pad position; a pad position whose sliding window
holds only padding) is where the two differ: sdpa's convention (torch >= 2.5) gives it zeros, and
its query, key and value no gradient from it, while the finite mask gives it an even spread over
every key on some backends (math, and on CPU). So the rows that attend to nothing are found once
per forward too, and each layer sets them in o_proj's output to what o_proj makes of a zero row
(zeros, or its bias): the forward and every gradient are then those of sdpa's convention on every
backend. (torch 2.11 hands cuDNN a boolean mask with -65504 for False, so that there, on the
boolean mask itself, such a row attends to every key.) Both are cached on the boolean mask tensor
itself, so they live exactly as long as the mask transformers built for this forward (and any
autograd graph that saved it).

With ``eager_attention_recompute`` (the default), ``attn_implementation="eager"`` (Gemma 2's, for
its attention-logit softcap) runs ``lean_eager_attention``: transformers' eager chain, op for op,
but the fp32 softmax output is not kept for the backward. transformers keeps, per layer, the tanh
output (softcap), the fp32 probabilities and their half-precision copy; here only the tanh output
(or, with no softcap, the scores) and the half-precision copy, and the backward recomputes the
softmax from them with the same ops, so gradients are bit for bit transformers'. That is 4 bytes
per attention score less per layer (2 bytes with no softcap): 1 GiB per layer for Gemma-2-2B at
2 x 4096.

With ``varlen_attention`` (the default), a packed batch on sdpa (rows holding several documents,
``position_ids`` restarting at each; see ``surgery.forward``) runs every layer's attention through
torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``) over the
documents, given as cumulative lengths over the flattened (batch * seq) tokens: each document
attends causally to itself only, exactly what transformers' block-diagonal mask allows, but the
kernel skips every block outside the documents and needs no mask and no key/value repeat for GQA
(sdpa with a mask takes a masked kernel that computes the whole (seq x seq) square). A layer that
varlen cannot serve (fp32, attention dropout in training, an attention-logit softcap, head_dim
over 256) takes the mask transformers built as usual. Under ``torch.compile`` too: the boundaries
then come from an op at run time (``packed_sequences``), so the graph holds no host read.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from surgery.kernels import apply_rope
from surgery.kernels.reduction import host_cu_seqlens
from surgery.kernels.rope import mrope_rows
from surgery.models import ArchitectureSpec

from . import recompute
from .chunked_attention import POSITIONS_KWARG, after_rope, chunked_layer_mask, is_chunked_layer
from .compiling import host_read
from .linear_attention import DOCUMENTS_KWARG
from .recompute import RECOMPUTE_ATTR
from .signature import in_signature_of

__all__ = [
    "AttentionBinding",
    "PackedSequences",
    "SharedMask",
    "attention_forward",
    "attention_forward_for",
    "attention_interface",
    "flash_head_size",
    "lean_eager_attention",
    "mrope_layout",
    "packed_sequences",
    "position_query_scale",
    "shared_sdpa_mask",
    "varlen_attention",
]


@dataclass(frozen=True)
class AttentionBinding:
    """What one patched attention module needs besides itself. Kept in the module's ``__dict__``
    (not as a submodule), so ``state_dict`` and ``named_modules`` are unchanged, while ``deepcopy``
    (PEFT's ``modules_to_save``, reference models) maps ``rotary`` to the copy's rotary module."""

    spec: ArchitectureSpec
    rotary: nn.Module
    eager_attention: Callable
    fallback_rope: Callable | None
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``, for a caller that passes no
    position ids (the decoder layers of every supported model do, or their base model: see
    ``ArchitectureSpec.positions_to_attention``)."""
    share_mask: bool = True
    """Hand sdpa one additive mask shared by all layers instead of the boolean one."""
    mrope: tuple[tuple[int, int, int], bool] | None = None
    """Multimodal RoPE (``ArchitectureSpec.mrope``): ``apply_rope``'s ``mrope_section`` and
    ``mrope_interleaved``, read from the rotary module (``mrope_layout``); None: plain RoPE, or
    (an ``mrope`` spec whose rotary module's layout was not recognised) transformers' cos/sin."""
    lean_eager: bool = True
    """Run the eager implementation through ``lean_eager_attention``."""


BINDING_ATTR = "_surgery_attention"
SHARED_MASK_ATTR = "_surgery_shared_mask"
PACKED_KWARG = "surgery_packed_sequences"
"""The keyword argument that carries ``PackedSequences`` from the causal-LM forward through the
base model and its decoder layers (which pass their keyword arguments on) to the attention."""
MROPE_POSITIONS_KWARG = "surgery_mrope_positions"
"""The keyword argument, passed the same way from the base model (``surgery.base_model``), that
carries the positions a multimodal-RoPE model's rotary module takes: (3, batch, seq) temporal,
height and width rows, or (batch, seq) for the same position in all three (text)."""
CAUSAL_KWARG = "surgery_causal"
"""The keyword argument, passed the same way, saying the causal-LM forward dropped the padding mask
(``PatchOptions.causal_right_padding``): layers without a sliding window then run sdpa causal and
unmasked whatever mask the base model built (transformers builds a plain causal mask under
``torch.compile`` before torch 2.14 instead of letting sdpa's ``is_causal`` take it)."""


@dataclass(frozen=True)
class PackedSequences:
    """The documents of a packed batch, over its flattened (batch * seq) tokens."""

    cu_seqlens: torch.Tensor
    """int32 (documents + 1,): where each document starts, then the token count; on the device."""
    max_length: int
    """The longest document's length."""
    kernel: Callable
    """``varlen_attn``'s signature (see ``varlen_kernel``)."""


def packed_sequences(
    position_ids: torch.Tensor,
    shape: tuple[int, int],
    device: torch.device,
    read_on_host: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> PackedSequences | None:
    """``PackedSequences`` of a (batch, seq) batch on ``device`` from its position ids, or None
    when every row holds one document (causal attention over the row is then already exact) or
    ``device`` has no varlen kernel.

    A document starts at each row's first token and wherever the position does not continue
    (``pos[t] != pos[t - 1] + 1``): transformers' rule for its packed mask, and the loss's
    (``surgery.kernels.reduction.sequence_starts``). Labels play no part: a run of ignored labels
    (a masked prompt) is not a boundary. One device-to-host copy of the position ids.

    Under ``torch.compile`` the row length stands for the longest document (flash attention only
    sizes its grid from it: an upper bound is exact, blocks past a document's end return at once),
    so no graph depends on it, and the boundaries are read (see ``surgery.compiling``):
    ``read_on_host`` (graph breaks allowed): on the host, as one graph break, their count a dynamic
    size of the rest of the forward; otherwise from an op at run time (their count an unbacked
    size) and every row is taken as packed (varlen over rows of one document each is exact too).

    ``cu_seqlens``: the batch's ``host_cu_seqlens``, where the caller has read them already for
    another use (a hybrid model's documents): not read again. Eager only.
    """
    kernel = varlen_kernel(device)
    if kernel is None:
        return None
    if torch.compiler.is_compiling():
        if read_on_host:
            cu_seqlens = _read_cu_seqlens(position_ids, shape, device)
            return None if cu_seqlens is None else PackedSequences(cu_seqlens, shape[1], kernel)
        cu_seqlens = _packed_cu_seqlens_op(position_ids, shape[0], shape[1])
        return PackedSequences(cu_seqlens, shape[1], kernel)
    if cu_seqlens is None:
        cu_seqlens = host_cu_seqlens(position_ids, shape)
    if cu_seqlens.numel() == shape[0] + 1:
        return None
    max_length = int(cu_seqlens.diff().max())
    return PackedSequences(cu_seqlens.to(device=device, dtype=torch.int32), max_length, kernel)


@host_read
def _read_cu_seqlens(
    position_ids: torch.Tensor, shape: tuple[int, int], device: torch.device
) -> torch.Tensor | None:
    # Eager inside a compiled forward; the count of documents is marked dynamic, so that batches
    # with other counts reuse the graph compiled after this read.
    cu_seqlens = host_cu_seqlens(position_ids, shape)
    if cu_seqlens.numel() == shape[0] + 1:
        return None
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    return cu_seqlens


@torch.library.custom_op("surgery::packed_cu_seqlens", mutates_args=())
def _packed_cu_seqlens_op(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """``PackedSequences.cu_seqlens`` of a (batch, seq) batch, on the position ids' device."""
    cu_seqlens = host_cu_seqlens(position_ids, (batch, seq))
    return cu_seqlens.to(device=position_ids.device, dtype=torch.int32)


@_packed_cu_seqlens_op.register_fake
def _(position_ids, batch, seq):
    # documents + 1 entries, at least one document per row (the bound must be a plain int: with
    # dynamic shapes the batch may not be).
    least = batch + 1 if isinstance(batch, int) else 2
    size = torch.library.get_ctx().new_dynamic_size(min=least)
    return position_ids.new_empty(size, dtype=torch.int32)


def varlen_kernel(device: torch.device) -> Callable | None:
    """torch's ``varlen_attn`` when it can run on ``device`` (CUDA, flash attention: sm80+,
    torch 2.10+), else None. torch.compile traces it: the kernel is resolved at import, and the
    device check runs as a constant of the device (whose tensors' guards hold it)."""
    if _VARLEN_ATTN is None or device.type != "cuda" or not _flash_capable(device):
        return None
    return _VARLEN_ATTN


@torch.compiler.assume_constant_result
def _flash_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params:  # torch 2.10 had only is_causal
        return None
    # torch 2.13 asks for enable_gqa=True when key/value have fewer heads; earlier releases hand
    # them to flash attention (which groups the heads itself) without the flag.
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    return functools.partial(varlen_attn, **gqa)


_VARLEN_ATTN = _varlen_attn()


def flash_head_size(*tensors: torch.Tensor) -> bool:
    """Whether flash attention's varlen kernel takes heads of these tensors' last size: whole
    16-byte vectors (8 bf16/fp16 channels). Callers take the masked path otherwise."""
    return all(x.shape[-1] * x.element_size() % 16 == 0 for x in tensors)


def _flash_layout(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where flash attention would read it at a misaligned address:
    its kernels load 16-byte vectors, so besides the head size every stride but the last (which
    must be 1) and the start must be whole vectors. Projections' views always are; a slice such
    as MLA's values (a part of ``kv_b_proj``'s output) may not be (on the H100: "misaligned
    address" on a tiny Mistral 4)."""
    if torch.compiler.is_compiling():
        # The start is not traceable (``storage_offset``); a copy only where not contiguous.
        return x.contiguous()
    vector = 16 // x.element_size()
    aligned = (
        x.stride(-1) == 1
        and all(s % vector == 0 for s in x.stride()[:-1])
        and x.storage_offset() % vector == 0
    )
    return x if aligned else x.contiguous()


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedSequences,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention within each document of ``packed``. query (B, Hq, T, D), key and value
    (B, Hk, T, D), any strides; returns (B, T, Hq, D) like transformers' attention functions.

    ``sliding_window`` has transformers' meaning: a query attends to the keys less than
    ``sliding_window`` positions before it (flash attention's left window is one less).
    """
    B, H, T, D = query.shape
    # (B, H, T, D) views of (B, T, H, D) projections: these reshapes are free.
    q, k, v = (
        _flash_layout(x.transpose(1, 2).reshape(B * T, x.shape[1], D)) for x in (query, key, value)
    )
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    cu, n = packed.cu_seqlens, packed.max_length
    out = packed.kernel(q, k, v, cu, cu, n, n, scale=scaling, window_size=window)
    return out.view(B, T, H, D)


@dataclass(frozen=True)
class SharedMask:
    """A boolean attention mask in the form every sdpa layer of one forward is given."""

    additive: torch.Tensor
    """(batch, 1, q, kv) in the query dtype: 0 where the boolean mask is True, the dtype's lowest
    finite value where it is False."""
    unattended: torch.Tensor
    """bool (batch, q, 1): the query rows that attend to no key, laid out like o_proj's output."""


def shared_sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> SharedMask | None:
    """The ``SharedMask`` of a boolean (batch, 1, q, kv) attention mask, built once per mask tensor
    and ``dtype`` and cached on the mask; None for anything else (no mask, an additive one, one
    mask per head), which goes to sdpa as is, and under ``torch.compile`` (the compiler sees the
    whole graph).

    With ``additive`` in place of the boolean mask, sdpa gives every row that attends to some key
    the same attention, bit for bit (the masked weights underflow to exactly 0); the rows in
    ``unattended`` are finite there, where the boolean mask gives zeros
    (``zero_unattended_rows`` makes them so).
    """
    if (
        mask is None
        or mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[1] != 1
        or torch.compiler.is_compiling()
    ):
        return None
    shared = getattr(mask, SHARED_MASK_ATTR, None)
    if shared is None or shared.additive.dtype != dtype:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive.masked_fill_(mask.logical_not(), torch.finfo(dtype).min)
        unattended = mask.any(dim=-1).logical_not_().transpose(1, 2)
        shared = SharedMask(additive, unattended)
        setattr(mask, SHARED_MASK_ATTR, shared)
    return shared


def zero_unattended_rows(
    output: torch.Tensor, unattended: torch.Tensor, o_proj: nn.Module
) -> torch.Tensor:
    """o_proj's ``output`` (batch, q, hidden) with the ``unattended`` rows set to what o_proj
    gives a zero row: zeros, or o_proj's bias. What sdpa gives those rows on the boolean mask,
    forward and backward: the rows pass no gradient back, so the attention's query, key and value
    get none from them, and o_proj's weight none either (as from a zero input row).

    Set here rather than on o_proj's input, because o_proj keeps its input for the backward and
    sdpa its output: a changed copy of the input would be one more (batch, q, hidden) tensor kept
    per layer, as large as the mask copy the shared mask saves when seq is near hidden. With a
    bias, the bias's gradient sums the same terms in another order (the unattended rows' apart).
    """
    bias = getattr(o_proj, "bias", None)
    # torch.where rather than masked_fill: a third less time forward and backward on CUDA.
    return torch.where(unattended, 0.0 if bias is None else bias.to(output.dtype), output)


def _read_path(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _probabilities(kept: torch.Tensor, mask: torch.Tensor | None, softcap: float | None):
    # transformers' eager chain after the tanh (softcap) or from the scaled scores (no softcap).
    x = kept * softcap if softcap is not None else kept
    if mask is not None:
        x = x + mask
    return F.softmax(x, dim=-1, dtype=torch.float32).to(kept.dtype)


class _LeanProbabilities(torch.autograd.Function):
    """``softmax(softcap(scores) + mask)`` in fp32, rounded to the scores' dtype, keeping only
    ``tanh(scores / softcap)`` (or the scores) for the backward, which rebuilds the rest with the
    same ops and differentiates them with autograd: the gradient is transformers', bit for bit."""

    @staticmethod
    def forward(ctx, scores, mask, softcap):
        kept = torch.tanh(scores / softcap) if softcap is not None else scores
        ctx.softcap = softcap
        ctx.save_for_backward(kept, mask)
        return _probabilities(kept, mask, softcap)

    @staticmethod
    def backward(ctx, grad):
        kept, mask = ctx.saved_tensors
        with torch.enable_grad():
            leaf = kept.detach().requires_grad_()
            (grad_kept,) = torch.autograd.grad(_probabilities(leaf, mask, ctx.softcap), leaf, grad)
        if ctx.softcap is None:
            return grad_kept, None, None
        # transformers' TanhBackward0 then DivBackward0 (scores / softcap).
        return torch.ops.aten.tanh_backward(grad_kept, kept) / ctx.softcap, None, None


def lean_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``eager_attention_forward`` (GQA repeat, scaling, optional softcap, additive
    mask, fp32 softmax), keeping less for the backward (see the module docstring). Without
    gradients or with attention dropout in training, the model's own eager function runs instead.
    Under ``torch.compile`` the probabilities are an activation-checkpoint region of their own
    (``surgery.recompute.compiled_recompute``; the autograd.Function's backward cannot be
    traced): the compiled graph keeps the tanh output (or the scores) alone, and rebuilds both
    probability tensors in the backward with one softmax, as the eager backward does."""
    if not torch.is_grad_enabled() or (dropout and module.training):
        eager = module.__dict__[BINDING_ATTR].eager_attention
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     softcap=softcap, **kwargs)  # fmt: skip
    if scaling is None:  # as the models' eager functions do; attention_forward always passes it
        scaling = module.head_dim**-0.5
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if recompute.compiling_with_grad():
        kept = torch.tanh(scores / softcap) if softcap is not None else scores
        probs = recompute.compiled_recompute(_probabilities, kept, attention_mask, softcap)
    else:
        probs = _LeanProbabilities.apply(scores, attention_mask, softcap)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


def mrope_layout(rotary: nn.Module) -> tuple[tuple[int, int, int], bool] | None:
    """The multimodal-RoPE sections of a transformers rotary module, as ``apply_rope`` takes them
    (``mrope_section``, ``mrope_interleaved``): which position row (temporal, height, width) each
    frequency reads, found by running the module's own ``recomposition_frequencies`` (the step
    that picks each frequency's row when it builds cos/sin) on rows holding 0, 1 and 2, so that
    the layout is the rotary class's, whatever its config says. None when the module has no
    such step or its layout is neither of ``apply_rope``'s (contiguous, interleaved)."""
    half = rotary.inv_freq.shape[-1]
    probe = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).repeat(1, 1, 1, half)
    try:
        with torch.no_grad():
            rows = rotary.recomposition_frequencies(probe)[..., :half].reshape(-1)
    except (AttributeError, RuntimeError, IndexError, ValueError):
        return None
    rows = [int(r) for r in rows.round().tolist()]
    section = (rows.count(0), rows.count(1), rows.count(2))
    for interleaved in (False, True):
        if list(mrope_rows(half, section, interleaved)) == rows:
            return section, interleaved
    return None


def rope_frequencies(module: nn.Module, binding: AttentionBinding) -> tuple[torch.Tensor, float]:
    rotary = binding.rotary
    if binding.spec.rope_per_layer_type:
        layer_type = module.layer_type
        return (
            getattr(rotary, f"{layer_type}_inv_freq"),
            getattr(rotary, f"{layer_type}_attention_scaling"),
        )
    return rotary.inv_freq, rotary.attention_scaling


def position_query_scale(
    module: nn.Module, spec: ArchitectureSpec, position_ids: torch.Tensor
) -> torch.Tensor:
    """The query scale of ``ArchitectureSpec.position_query_scale`` at (batch, seq) or (1, seq)
    ``position_ids``: transformers' ``get_llama_4_attn_scale`` of ``spec.module`` (imported: its
    classes built ``module``), (batch, 1, seq, 1) in fp32."""
    rope = module.config.rope_parameters
    scale = sys.modules[spec.module].get_llama_4_attn_scale
    return scale(
        position_ids, rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    )


def _shared_kv_key(module: nn.Module, reading: bool):
    """Where ``module`` reads (or stores) keys and values in ``shared_kv_states``: under its layer
    type; transformers 5.17's Gemma 3n keyed them by layer index (``kv_shared_layer_index`` of the
    storing layer)."""
    if hasattr(module, "kv_shared_layer_index"):
        return module.kv_shared_layer_index if reading else module.layer_idx
    return module.layer_type


def attention_interface(
    self: nn.Module,
    binding: AttentionBinding,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None, SharedMask | None]:
    """transformers' attention interface of the module's implementation on (B, H, T, D) query,
    key and value, with ``kwargs`` (dropout, scaling, ...) passed on: sdpa gets the one additive
    mask shared by every layer (``share_mask``), eager runs ``lean_eager_attention``
    (``lean_eager``). Returns its (output, weights) and the shared mask, if any, whose
    ``unattended`` rows the caller sets in o_proj's output (``zero_unattended_rows``)."""
    implementation = self.config._attn_implementation
    shared = None
    if binding.share_mask and implementation == "sdpa":
        # Under autocast sdpa runs in the autocast dtype whatever the queries' (fp32 queries come
        # from an fp32 q_norm): a mask built in fp32 would become -inf in fp16.
        device = query.device.type
        autocast = torch.is_autocast_enabled(device)
        mask_dtype = torch.get_autocast_dtype(device) if autocast else query.dtype
        shared = shared_sdpa_mask(attention_mask, mask_dtype)
        if shared is not None:
            attention_mask = shared.additive
    if implementation == "eager" and binding.lean_eager:
        interface = lean_eager_attention
    else:
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, binding.eager_attention)
    attn_output, attn_weights = interface(self, query, key, value, attention_mask, **kwargs)
    return attn_output, attn_weights, shared


def attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    shared_kv_states=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    binding: AttentionBinding = self.__dict__[BINDING_ATTR]
    spec = binding.spec
    # A layer reusing an earlier layer's keys and values (spec.kv_sharing) has no k/v of its own.
    kv_shared = spec.kv_sharing and self.is_kv_shared_layer
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    # The projections save hidden_states, the input norm's output: rebuilt in the backward when
    # the norm registered it (surgery.recompute).
    plan = self.__dict__.get(RECOMPUTE_ATTR)
    gate = None
    with recompute.saved_tensor_scope(plan is not None and plan.norm_output):
        if spec.attention_output_gate:  # per head: the query, then its output gate
            query_and_gate = self.q_proj(hidden_states).view(*input_shape, -1, 2 * self.head_dim)
            query, gate = query_and_gate.chunk(2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
        else:
            query = self.q_proj(hidden_states).view(hidden_shape)
        if kv_shared:  # no key heads: RoPE below rotates the query alone
            key = value = query[..., :0, :]
        else:
            key = self.k_proj(hidden_states).view(hidden_shape)
            # No v_proj (Gemma 4's attention_k_eq_v): the values are the key projection.
            value = key if self.v_proj is None else self.v_proj(hidden_states).view(hidden_shape)
    if spec.v_norm and not kv_shared:
        value = self.v_norm(value)
    value = value.transpose(1, 2)
    if spec.qk_norm:  # RMSNorm over the head dim: the same before or after the transpose
        query = self.q_norm(query)
        key = key if kv_shared else self.k_norm(key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)

    # Llama 4's decoder layers pass no position_ids: its base model hands them on (spec field
    # positions_to_attention); on its layers without RoPE nothing is rotated.
    position_ids = kwargs.get("position_ids", kwargs.pop(POSITIONS_KWARG, None))
    rotated = spec.rope_layer_attr is None or bool(getattr(self, spec.rope_layer_attr))
    # Multimodal RoPE: the positions of the rotary module (3-D over images), not the text ones
    # the decoder layers pass (or None where only 3-D ones exist).
    rope_positions = kwargs.pop(MROPE_POSITIONS_KWARG, None)
    if not spec.mrope:
        rope_positions = position_ids
    elif binding.mrope is None:  # a layout apply_rope does not know: transformers' cos/sin
        rope_positions = None
    if rope_positions is not None and rotated:
        if rope_positions.dim() == 1:
            rope_positions = rope_positions.unsqueeze(0)
        inv_freq, scaling = rope_frequencies(self, binding)
        if inv_freq.device != query.device:
            # A device map (accelerate's hooks) put the rotary module on another GPU than this
            # layer; unpatched, its cos/sin would be moved here with the layer's inputs.
            inv_freq = inv_freq.to(query.device)
        rotary_dim = 2 * inv_freq.shape[-1]
        section, interleaved = binding.mrope if binding.mrope is not None else (None, False)
        query, key = apply_rope(
            query,
            key,
            rope_positions,
            inv_freq,
            attention_scaling=scaling,
            rotary_dim=None if rotary_dim == self.head_dim else rotary_dim,
            layout=spec.rope_layout,
            mrope_section=section,
            mrope_interleaved=interleaved,
        )
    elif rotated:
        cos, sin = position_embeddings
        query, key = binding.fallback_rope(query, key, cos, sin)
    query, key = after_rope(self, spec, query, key, position_ids, rotated)
    if spec.position_query_scale:
        query = query * position_query_scale(self, spec, position_ids).to(query.dtype)

    if kv_shared:
        key, value = shared_kv_states[_shared_kv_key(self, reading=True)]
        key, value = key.to(query.device), value.to(query.device)  # a device map's other GPU
    elif past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    if spec.kv_sharing and self.store_full_length_kv:
        shared_kv_states[_shared_kv_key(self, reading=False)] = key, value

    dropout = self.attention_dropout if self.training else 0.0
    extra = {name: _read_path(self, path) for name, path in spec.attention_kwargs}
    packed: PackedSequences | None = kwargs.pop(PACKED_KWARG, None)
    chunked = is_chunked_layer(self, spec)  # Llama 4: a packed batch's chunks come with it
    attention_mask = chunked_layer_mask(chunked, attention_mask, past_key_values, kwargs)
    if kwargs.pop(CAUSAL_KWARG, False) and extra.get("sliding_window") is None and not chunked:
        attention_mask = None
    kwargs.pop(DOCUMENTS_KWARG, None)  # for the linear-attention layers of a hybrid model
    if (
        packed is not None
        # TODO: chunked layers through varlen too, cu_seqlens split where a document's position
        # crosses a multiple of the chunk size; needs a GPU test against the masked path.
        and not chunked
        and query.dtype in (torch.float16, torch.bfloat16)
        and not dropout
        and extra.get("softcap") is None
        and self.head_dim <= 256
        and flash_head_size(query, value)
        and past_key_values is None
    ):
        attn_output = varlen_attention(
            query, key, value, packed, self.scaling, extra.get("sliding_window")
        )
        attn_output = attn_output.reshape(*input_shape, -1)
        if gate is not None:
            attn_output = attn_output * torch.sigmoid(gate)
        return self.o_proj(attn_output), None

    attn_output, attn_weights, shared = attention_interface(
        self, binding, query, key, value, attention_mask,
        dropout=dropout, scaling=self.scaling, **extra, **kwargs,
    )  # fmt: skip
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        attn_output = attn_output * torch.sigmoid(gate)
    output = self.o_proj(attn_output)
    if shared is not None:
        output = zero_unattended_rows(output, shared.unattended, self.o_proj)
    return output, attn_weights


def attention_forward_for(module: nn.Module, generic: Callable = attention_forward) -> Callable:
    """``generic`` (``attention_forward``, or another generic attention forward) taking its
    arguments in the order of ``module``'s class forward (``surgery.signature.in_signature_of``:
    Gemma 4 takes ``shared_kv_states`` before ``past_key_values``, Ministral 3 ``position_ids``
    between ``attention_mask`` and ``past_key_values``)."""
    return in_signature_of(generic, type(module).forward)
