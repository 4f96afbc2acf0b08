"""Router replay for the tests that hold a patched mixture of experts to an error budget set by
the unpatched model in bf16/fp16 (or under autocast) against its fp32 run.

A router's ``topk`` is a discontinuous choice: where two experts' scores are nearly tied,
rounding alone sends a token to another expert, and a patched and an unpatched half-precision run
that do this at different tokens compute different functions, so the budget (the unpatched run's
own rounding) says nothing about them. As the convergence suite does (``surgery.convergence``
``routing`` and ``compare.flip_margin_ratio``, reused here, not restated): the fp32 unpatched run
records its routing decisions at the batch's real tokens, the unpatched half-precision run and
the patched run replay them, so all three compute the same function and the budget applies; and
the decisions the patched run would have made itself (its free ``topk`` under replay, every
earlier layer routed alike) may differ from the fp32 run's only where rounding can tip them: at
a margin of at most 2 × ``factor`` × the unpatched half-precision run's own router-score error on
that call, ``factor`` being the budget's.

Tokens are matched between layouts by their real-token positions, documents in order: a packed
row's every token, a padded (right or left) batch's tokens under its attention mask, in
row-major order. So a packed patched batch replays the decisions of its padded reference where
unpatched transformers needs the documents padded (``tiny.unpatched_packs_exactly``).

A model without experts modules takes none of this: ``replayed_steps`` runs its steps as they
are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from surgery.convergence.compare import flip_margin_ratio
from surgery.convergence.routing import Decision, Routing, compare_decisions

__all__ = ["assert_flips_within_rounding", "is_mixture", "replayed_steps", "routing_for"]


def is_mixture(model) -> bool:
    """Whether ``model`` holds a mixture of experts (transformers' ``*Experts`` modules), whose
    routers rank their scores with ``topk``."""
    return any(type(m).__name__.endswith("Experts") for m in model.modules())


def routing_for(batch: dict[str, torch.Tensor], replay: list[Decision] | None = None) -> Routing:
    """A ``Routing`` for one forward of ``batch`` (the model's keyword arguments): its real
    tokens are the flat positions under ``attention_mask``, or every position of a batch without
    one (packed rows)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is None:
        real = torch.arange(ids.numel(), device=ids.device)
    else:
        real = mask.flatten().nonzero().squeeze(1)
    return Routing(real, tuple(ids.shape), replay)


def _routed(run: Callable[[], Any], batch, replay) -> tuple[Any, list[Decision]]:
    routing = routing_for(batch, replay)
    with routing:
        out = run()
    routing.check_replayed()
    return out, routing.decisions


def assert_flips_within_rounding(
    patched: list[Decision],
    unpatched: list[Decision],
    reference: list[Decision],
    factor: float,
    what: str = "",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The patched run's own decisions differ from ``reference``'s (fp32) only at margins that
    rounding can reach: ``compare.flip_margin_ratio`` at most ``factor``, with the unpatched
    half-precision run's score error (both recorded under ``reference``'s replay) as the unit.
    Returns both runs' ``compare_decisions`` against the reference (patched, unpatched)."""
    mine = compare_decisions(patched, reference)
    theirs = compare_decisions(unpatched, reference)
    value, detail = flip_margin_ratio(mine, theirs)
    assert value <= factor, (
        f"{what}: routing flip at {value:.2f}x twice the unpatched router-score error "
        f"> {factor:g}: {detail}"
    )
    return mine, theirs


def replayed_steps(
    model,
    reference: Callable[[], Any],
    unpatched: Callable[[], Any],
    patched: Callable[[], Any],
    reference_batch: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    factor: float,
    what: str = "",
) -> tuple[Any, Any, Any]:
    """Run the three steps of a budget comparison, in this order, and return their results:
    ``reference`` (unpatched, fp32) and ``unpatched`` (unpatched, half precision) on
    ``reference_batch``, ``patched`` on ``batch`` (the same documents, in that layout or
    another). For a mixture of experts (``model``: any of the three models) the reference's
    routing is recorded and replayed in the other two, and the patched run's own decisions are
    held to ``assert_flips_within_rounding``; any other model runs the steps as they are."""
    if not is_mixture(model):
        return reference(), unpatched(), patched()
    ref, decisions = _routed(reference, reference_batch, None)
    assert decisions, f"{what}: a mixture of experts made no topk call"
    want, want_decisions = _routed(unpatched, reference_batch, decisions)
    got, got_decisions = _routed(patched, batch, decisions)
    assert_flips_within_rounding(got_decisions, want_decisions, decisions, factor, what)
    return ref, want, got
