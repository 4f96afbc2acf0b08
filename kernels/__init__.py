"""Triton kernels with plain-PyTorch fp32 references beside them. Imports only torch and triton."""

from .cross_entropy import cross_entropy, cross_entropy_statistics
from .embedding import embedding, embedding_reference
from .gated_activation import gated_activation, gated_activation_reference
from .gather_sum import gather_sum, gather_sum_reference
from .linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_statistics
from .log_probs import TokenLogProbs, UpstreamHint, linear_log_probs
from .reduction import check_labels
from .reference import (
    LossOutput,
    cross_entropy_reference,
    linear_cross_entropy_reference,
    linear_log_probs_reference,
)
from .rms_norm import rms_norm, rms_norm_reference
from .rope import apply_rope, apply_rope_reference, apply_rotary_pos_emb
from .vocab_parallel import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_log_probs

__all__ = [
    "LossOutput",
    "TokenLogProbs",
    "UpstreamHint",
    "apply_rope",
    "apply_rope_reference",
    "apply_rotary_pos_emb",
    "check_labels",
    "cross_entropy",
    "cross_entropy_reference",
    "cross_entropy_statistics",
    "embedding",
    "embedding_reference",
    "gated_activation",
    "gated_activation_reference",
    "gather_sum",
    "gather_sum_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_statistics",
    "linear_log_probs",
    "linear_log_probs_reference",
    "rms_norm",
    "rms_norm_reference",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_log_probs",
]
