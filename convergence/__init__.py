"""surgery.convergence: proof that a patched model trains like the original.

Mini models of every supported architecture (``configs``, at the suite's sizes; how each is
built: ``mini`` and ``minis``, by ``model_type``), deterministic synthetic data collated padded or
packed (``data``), the reference loss from HF logits (``loss``), the sides compared (``side``) and
what is captured of them (``capture``), the lockstep train-and-compare loop (``train``; a real
checkpoint's sides one after another: ``pretrained``, ``sequential``) and the verdict with its
tolerance table (``compare``).
Run it with ``python -m surgery.convergence``.
"""

from .compare import TOLERANCES, Check, Tolerance, evaluate
from .configs import ARCHITECTURES, SIZES, build_model, make_config
from .data import collate_packed, collate_padded, make_batches
from .loss import causal_lm_loss
from .side import Variant
from .train import RunConfig, train_and_compare

__all__ = [
    "ARCHITECTURES",
    "SIZES",
    "TOLERANCES",
    "Check",
    "RunConfig",
    "Tolerance",
    "Variant",
    "build_model",
    "causal_lm_loss",
    "collate_packed",
    "collate_padded",
    "evaluate",
    "make_batches",
    "make_config",
    "train_and_compare",
]
