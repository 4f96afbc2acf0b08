"""What ``surgery.patch`` can be asked to do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["LOSS_REDUCTIONS", "PatchOptions"]

LOSS_REDUCTIONS = ("mean", "sequence")


@dataclass(frozen=True)
class PatchOptions:
    """Options of one patch; read by the patched forwards at call time.

    - ``rope``: apply RoPE with ``apply_rope`` from the position ids (swaps the attention forward).
    - ``fused_linear_cross_entropy``: in training with labels, feed hidden states straight into
      ``linear_cross_entropy`` through the lm_head module; logits are never materialised.
    - ``loss_reduction``: ``"mean"`` (transformers' token mean, honouring ``num_items_in_batch``) or
      ``"sequence"`` (mean over each sequence's tokens, then over sequences: packing-aware).
    - ``z_loss_scale``: weight of ``logsumexp(logits)**2`` added to the loss (reported in
      ``z_loss``).
    - ``label_smoothing``: as in ``torch.nn.functional.cross_entropy``.
    - ``return_logits``: also return logits in training (then the loss is computed from them).
    - ``rms_norm``: every RMSNorm (q/k norms included) through the fused ``rms_norm`` kernel, with
      the architecture's cast points (swaps the norm forwards).
    - ``gated_mlp``: the MLP's ``act(gate) * up`` through the fused ``gated_activation`` kernel
      (swaps the MLP forwards; left alone for an activation without a kernel).
    - ``embedding_backward``: the text model's input embedding (a plain ``nn.Embedding``, without
      ``max_norm`` or sparse gradients) computes its weight gradient in one op,
      ``surgery::embedding_backward``: PyTorch's own eager kernel, so the gradient is bit for bit
      the unpatched eager one, and a compiled model keeps that kernel instead of Inductor's
      decomposition, which holds an fp32 copy of the whole table (1.2 GB at Qwen3's vocabulary in
      bf16) at the end of the backward (``surgery.kernels.embedding``). Eager, nothing changes.
    - ``recompute_mlp_product``: with ``gated_mlp``, the product ``act(gate) * up`` is not kept
      for ``down_proj``'s weight gradient; the backward rebuilds it, bit for bit, from gate and up
      (kept anyway): one (tokens x intermediate) tensor less per layer. Where ``down_proj`` is a
      plain bias-free ``nn.Linear`` (no hooks, adapters or partitioned weight) the product and the
      down projection are one step (``surgery.kernels.gated_activation.gated_linear``) and the
      activation's backward kernel writes the product as it goes: no cost but that write;
      elsewhere the forward's kernel runs again (one elementwise pass).
    - ``recompute_norm_output``: with ``rms_norm``, an RMSNorm's output is not kept for the
      projections after it (q/k/v, gate/up; needs ``rope`` and ``gated_mlp`` respectively, whose
      forwards run those projections); the backward rebuilds it from the norm's input and weight
      (kept anyway) with the forward's kernel: two (tokens x hidden) tensors less per layer.
      Under ``torch.compile`` both rebuild through one-op activation-checkpoint regions (the
      compiled graph keeps what eager keeps), and behind q/k norms (Qwen3, Gemma 3) the rotated
      queries and keys are rebuilt too, from the projections the q/k norms keep (on the H100 the
      compiled Qwen3-MoE step peaks 0.5 GiB lower for about 3% of its speed); both are skipped
      (activations kept as usual) under activation checkpointing and other saved-tensor hooks;
      see ``surgery.recompute``.
    - ``loss_low_memory``: the fused loss keeps no logits chunk and no gradient from the forward to
      the backward; the backward recomputes the logits in vocabulary slices (a fourth matrix
      product: about 1.4x the loss's time) — ``linear_cross_entropy(low_memory=True)``.
    - ``loss_chunk_bytes``: the fused loss's chunk budget (``linear_cross_entropy(chunk_bytes=)``;
      None: its default).
    - ``loss_skip_ignored``: the fused loss's matrix products run over the tokens with a label
      only (``linear_cross_entropy(skip_ignored=True)``): exact; an SFT batch whose prompts and
      images are masked costs that much less of the loss's three products and of its logits
      buffer, for one host read of the count per call (which waits for the forward to finish on
      the GPU; none while a CUDA graph is captured). On by default: on the H100 it lifted an
      image-chat Gemma 3 step (half its tokens masked) from 31.8k to 37.0k tokens/s and 23.8 to
      21.8 GiB, and cost nothing measurable on fully labelled Llama and Qwen3-MoE steps
      (``benchmarks/results/train_step-skip-ignored.*``). False keeps the fused loss free of any
      host read.
    - ``share_attention_mask``: with ``rope`` (whose attention forward runs the attention) and
      ``attn_implementation="sdpa"``, a boolean 4-D mask is turned into an additive one once per
      forward and that one tensor goes to every layer. sdpa would otherwise build a new
      (batch, 1, seq, seq) copy in every layer and keep each for its backward (64 MiB per layer
      at 2 x 4096 in bf16). Exact: every row that attends to some key gets the same attention,
      and a row that attends to no key (left padding) gets sdpa's zeros and passes no gradient;
      see ``surgery.attention``.
    - ``causal_right_padding``: in a fused-loss training step on sdpa, a right-padded batch whose
      padding positions are all ignored (label ``ignore_index``) runs without its attention mask,
      as a plain causal batch: sdpa then takes its flash kernel (causal blocks skipped, no key/value
      repeat for GQA) instead of a masked kernel over the full square. Exact for every trained
      token: causal attention never lets a token see positions after it, which is where right
      padding lives, and padding positions carry no loss. Checked on every such forward (one
      device-to-host read of a flag); anything else (left padding, labels on padding, logits or
      hidden states requested, a KV cache, position ids passed) keeps the mask. Under
      ``torch.compile`` the check is one deliberate graph break before the model (a graph per
      verdict, each compiled once); with ``fullgraph=True``, where no break is allowed, padded
      batches keep their mask (see ``surgery.compiling``).
    - ``padding_free``: with ``causal_right_padding`` and ``rope``, such a right-padded batch
      runs its real tokens only: the causal-LM forward hands the base model the real tokens as
      one row, and each attention layer runs sdpa's causal kernel on each row's real tokens
      alone, one call a row. Over more than ``surgery.unpadding.ROW_CALLS_MAX`` rows, and
      compiled behind q/k norms (where the rotated queries and keys are rebuilt in the
      backward), the attention puts its queries, keys and values back into the (batch, seq)
      layout (zeros at the padding) for one call instead and takes the real rows of its output
      again. Every projection, norm, activation and residual add skips the padding (on the H100
      a compiled Llama ~1B forward and backward over 2 x 4096 tokens, 512 of them padding, took
      126.6 instead of 128.6 ms), and the attention too where it runs per row; flash
      attention's variable-length kernel ran 1.5x slower than sdpa's cuDNN kernel over the same
      rows. Exact for every trained token (see ``surgery.unpadding``); one more device-to-host
      read (each row's count of real tokens) per such forward.
      The step returns no KV cache, and a MoE model's ``router_logits`` cover the real tokens
      only (its load-balancing loss is the same: transformers' counts only the mask's tokens).
      Off for models whose layers read the layout beyond the attention (sliding windows,
      chunked or linear attention, shared key/value layers, RoPE whose frequencies follow the
      length, multimodal models).
    - ``eager_attention_recompute``: with ``rope`` and ``attn_implementation="eager"`` (Gemma 2's
      default), the fp32 attention probabilities are not kept for the backward, which recomputes
      them from the kept half-precision tanh output (or scores) with transformers' own ops:
      gradients bit for bit transformers', 4 bytes per attention score and layer less (2 without
      a softcap) for one softmax pass more in the backward; see ``surgery.attention``. Under
      ``torch.compile`` too (an activation-checkpoint region).
    - ``varlen_attention``: with ``rope`` and ``attn_implementation="sdpa"`` on a CUDA GPU with
      flash attention (sm80+, torch 2.11+), a packed batch in a training or loss call (position
      ids restarting inside a row, no attention mask, no KV cache) runs its attention through
      ``torch.nn.attention.varlen.varlen_attn`` over the documents instead of sdpa with
      transformers' (batch, 1, seq, seq) block-diagonal mask: the same attention (each document
      sees only itself, causally, within any sliding window), but only the blocks inside documents
      are computed. Document boundaries come from the position ids, as transformers' mask and the
      loss take them (one device-to-host copy of the position ids per forward; under
      ``torch.compile`` that copy is one graph break before the model, or with ``fullgraph=True``
      an op at run time; either way one graph serves any document count).
      fp32 layers, attention dropout and attention-logit softcaps keep the mask. The Qwen-VL
      vision towers' attention runs every image, frame or window of a block in one varlen call
      too (``surgery.vision_attention``; half precision on such a GPU).
    - ``experts_implementation``: mixture-of-experts models whose experts dispatch through
      transformers' experts implementations (``use_experts_implementation``), which one runs;
      ``unpatch`` puts the previous one back. ``"auto"`` (the default): surgery's own,
      ``"surgery_grouped_mm"``, wherever the model runs transformers' ``grouped_mm`` (transformers'
      default; where torch has no grouped GEMM for the device, its per-expert loop op runs the
      groups) and has experts it can fuse;
      any other implementation the model was given (``"eager"``, ``"batched_mm"``, a hub kernel)
      is kept, as is a model with nothing to fuse. ``"surgery_grouped_mm"``: surgery's everywhere
      (experts it cannot fuse run transformers' ``grouped_mm``, with a warning). A name of
      transformers' (``"grouped_mm"``, ``"batched_mm"``, ``"eager"``, ...): that one, as
      ``model.set_experts_implementation`` sets it, nothing fused. None: the model's own, untouched.
      ``"surgery_grouped_mm"`` is transformers' ``grouped_mm`` (its grouped GEMMs, its row order and
      reduction) with ``act(gate) * up`` through the fused ``gated_activation_merged`` on the up
      GEMM's output (fp32, rounded once; only that output kept for the backward), the product
      rebuilt for the down GEMM's weight gradient (with ``recompute_mlp_product``) and the rows
      gathered for the up GEMM gathered again in the backward from the layer's input: per MoE layer
      (tokens x top_k) x (hidden + 2 x expert width) elements fewer kept. It fuses experts with a
      concatenated gate/up and no biases, transformers' default gate and an activation with a
      kernel (SwiGLU, GeGLU tanh), outside expert parallelism; see ``surgery.experts``. Llama 4's
      experts (no experts implementations in transformers: two batched GEMMs over every token)
      get, with ``"auto"`` or ``"surgery_grouped_mm"``, a forward with the same GEMMs and the
      activation fused between them (``ArchitectureSpec.batched_experts``); None leaves theirs.
    """

    rope: bool = True
    fused_linear_cross_entropy: bool = True
    loss_reduction: Literal["mean", "sequence"] = "mean"
    z_loss_scale: float = 0.0
    label_smoothing: float = 0.0
    return_logits: bool = False
    rms_norm: bool = True
    gated_mlp: bool = True
    embedding_backward: bool = True
    recompute_mlp_product: bool = True
    recompute_norm_output: bool = True
    loss_low_memory: bool = False
    loss_chunk_bytes: int | None = None
    loss_skip_ignored: bool = True
    share_attention_mask: bool = True
    causal_right_padding: bool = True
    padding_free: bool = True
    eager_attention_recompute: bool = True
    varlen_attention: bool = True
    experts_implementation: str | None = "auto"

    def __post_init__(self) -> None:
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {self.loss_reduction!r}"
            )
        if not self.z_loss_scale >= 0.0:
            raise ValueError(f"z_loss_scale must be >= 0, got {self.z_loss_scale}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        for name in (
            "rope",
            "fused_linear_cross_entropy",
            "return_logits",
            "rms_norm",
            "gated_mlp",
            "embedding_backward",
            "recompute_mlp_product",
            "recompute_norm_output",
            "loss_low_memory",
            "loss_skip_ignored",
            "share_attention_mask",
            "causal_right_padding",
            "padding_free",
            "eager_attention_recompute",
            "varlen_attention",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        chunk = self.loss_chunk_bytes
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
            raise TypeError(f"loss_chunk_bytes must be an int or None, got {chunk!r}")
        experts = self.experts_implementation
        if experts is not None and not isinstance(experts, str):
            raise TypeError(f"experts_implementation must be a str or None, got {experts!r}")
        if chunk is not None and chunk <= 0:
            raise ValueError(f"loss_chunk_bytes must be > 0, got {chunk}")
