"""Router replay: run a mixture of experts with another run's routing decisions, and say whether
the decisions a side would have made itself differ from them only by rounding.

A router picks each token's experts with ``topk`` over its scores (probabilities or logits), a
discontinuous choice: where two scores are nearly tied, rounding alone can swap which expert a
token gets, and then that token's output and every expert's gradient differ by far more than
rounding. Two correct runs in bf16 do this (the unpatched model against the fp32 one too), each at
its own tokens, so comparing two sides' logits and gradients would compare different functions.

``Routing`` is a ``torch.overrides.TorchFunctionMode`` (public API, nothing in torch is rebound)
that sees every ``torch.topk`` and ``Tensor.topk`` of one forward. Every router of the registry's
mixtures calls ``topk`` once per MoE layer (Mistral 4's group-limited router three times: experts
within each group, groups, then experts), and nothing else in the decoder does (nothing of surgery's
own calls ``topk``). With ``output_router_logits`` (the sides of a mixture with a router aux loss
train it), transformers' ``load_balancing_loss_func`` ranks each layer's router probabilities once
more, one call per layer in layer order, after the decoder has returned: in the unpatched causal-LM
forward and in surgery's alike (``surgery.forwards.causal_lm`` calls the same function at the same
point). So every side makes the same calls in the same order, and the calls in order are the
forward's routing decisions followed by the aux loss's count of tokens per expert; replaying both
sends each real token to the same experts in the experts' output and in the aux loss, so a near tie
that rounding tips moves neither. A ``topk`` that is no part of the forward being compared (a side
computing an aux loss of its own) is not recorded: ``paused`` runs it freely, ``again`` forces the
experts the forward's own count of the same probabilities was given. What a call records
(``Decision``): the scores it ranked and the indices it picked, at the batch's real tokens. Given
another forward's decisions (``replay``), each call returns those indices at the real tokens, the
side's own choice at pads, and the side's *own* scores gathered at the forced indices, so that the
model's own formula (normalisation, scaling, sigmoid) runs on its own scores for the forced experts
and the gradients flow as through ``topk``'s values. Calls are matched by order; a call whose ranked
shape, ``k`` or ``largest`` differs from the recorded one, or a forward that calls ``topk`` fewer or
more times, is an error.

Tokens are matched between layouts through the real tokens: the flat positions of the batch's
non-pad tokens in row-major order (documents in order, as ``side.Side.real_tokens``), which a
router's ``(batch * seq, experts)`` scores (or ``(batch, seq, experts)``) are indexed by.

Under replay a side's own decisions are still recorded (the free ``topk`` of its own scores, with
every earlier layer routed like the yardstick): a would-be flip measured there is that layer's
rounding alone, not a cascade of an earlier flip. ``compare_decisions`` gives, per call, the
flips (tokens whose set of experts differs), the yardstick's margin at each flip (its k-th minus
its (k+1)-th score) and the largest score error against the yardstick.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Decision", "Routing", "compare_decisions", "margins"]

_TOPK = (torch.topk, torch.Tensor.topk)


@dataclass
class Decision:
    """One ``topk`` call at the real tokens: ``scores`` (N, ..., E), what was ranked (topk's
    dimension moved last), and ``indices`` (N, ..., k), the side's own pick; ``largest`` as
    given to ``topk``."""

    scores: torch.Tensor
    indices: torch.Tensor
    largest: bool

    @property
    def k(self) -> int:
        return self.indices.shape[-1]


def _topk_args(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    if out is not None:
        raise NotImplementedError("router replay: topk(out=...)")
    return input, k, dim, largest, sorted


def margins(d: Decision) -> torch.Tensor:
    """(N, ...) the gap between the k-th and the (k+1)-th score (fp64); inf where k is every
    expert (nothing to flip)."""
    s = d.scores.double()
    if d.k >= s.shape[-1]:
        return torch.full(s.shape[:-1], float("inf"), dtype=s.dtype, device=s.device)
    top = torch.topk(s if d.largest else -s, d.k + 1, dim=-1).values
    return top[..., -2] - top[..., -1]


class Routing(TorchFunctionMode):
    """Record the routing decisions of the forwards run inside it, and replay ``replay``'s.

    ``real``: (N,) flat positions of the real tokens in the batch of shape ``shape`` (batch,
    seq). ``replay``: the decisions to force at the real tokens, in call order, or None (free
    routing). ``decisions``: what each call ranked and would have picked itself."""

    def __init__(
        self,
        real: torch.Tensor,
        shape: tuple[int, int],
        replay: list[Decision] | None = None,
    ):
        super().__init__()
        self.real = real
        self.shape = tuple(shape)
        self.replay = replay
        self.decisions: list[Decision] = []
        self._paused = 0
        self._again: list[Decision] | None = None

    @contextlib.contextmanager
    def paused(self):
        """Inside, ``topk`` calls run as they would without the mode: neither recorded nor
        replayed."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def again(self, calls: int):
        """Inside, ``topk`` calls force the experts of the last ``calls`` calls again, in order,
        and record nothing: a second count of the same router probabilities (a side's aux loss
        over the real tokens, after its forward counted every token) counts the experts its
        forward was given. Free routing: as ``paused`` (the side's own choice comes out again)."""
        if self.replay is None:
            with self.paused():
                yield
            return
        done = len(self.decisions)
        self._again = list(self.replay[done - calls : done])
        try:
            yield
        finally:
            self._again = None

    def _tokens_first(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (topk's dimension already last) as (tokens, ..., E), and the rows of its real
        tokens: the batch's (batch * seq) tokens, or the real tokens alone, in order, where
        the forward ran them alone (surgery's ``padding_free``)."""
        b, t = self.shape
        n = self.real.numel()
        if x.dim() >= 2 and x.shape[0] == b * t:
            return x, self.real
        if x.dim() >= 3 and tuple(x.shape[:2]) == (b, t):
            return x.flatten(0, 1), self.real
        if n < b * t and x.dim() >= 2 and x.shape[0] == n:
            return x, torch.arange(n, device=x.device)
        if n < b * t and x.dim() >= 3 and tuple(x.shape[:2]) == (1, n):
            return x.flatten(0, 1), torch.arange(n, device=x.device)
        raise RuntimeError(
            f"router replay: topk over a tensor of shape {tuple(x.shape)}, whose leading "
            f"dimensions are neither the batch's {b}x{t} tokens nor its {n} real ones"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOPK or self._paused:
            return func(*args, **kwargs)
        x, k, dim, largest, _ = _topk_args(*args, **kwargs)
        free = func(*args, **kwargs)
        dim = dim % x.dim()
        scores, real = self._tokens_first(x.movedim(dim, -1))
        own, _ = self._tokens_first(free.indices.movedim(dim, -1))
        mine = Decision(scores[real].detach(), own[real], largest)
        if self._again is not None:
            if not self._again:
                raise RuntimeError("router replay: more topk calls than the ones repeated")
            i, forced = len(self.decisions), self._again.pop(0)
        else:
            i = len(self.decisions)
            self.decisions.append(mine)
            if self.replay is None:
                return free
            if i >= len(self.replay):
                raise RuntimeError(
                    f"router replay: topk call {i + 1}, only {len(self.replay)} recorded"
                )
            forced = self.replay[i]
        if (forced.scores.shape, forced.k, forced.largest) != (mine.scores.shape, k, largest):
            raise RuntimeError(
                f"router replay: topk call {i} ranks {tuple(mine.scores.shape)} (k={k}, "
                f"largest={largest}), the recorded one {tuple(forced.scores.shape)} "
                f"(k={forced.k}, largest={forced.largest})"
            )
        indices = own.clone()
        indices[real] = forced.indices.to(indices.device)
        indices = indices.reshape((*x.movedim(dim, -1).shape[:-1], k)).movedim(-1, dim)
        return torch.return_types.topk((x.gather(dim, indices), indices))

    def check_replayed(self) -> None:
        """Raise unless every recorded call was replayed (a forward that routes fewer times than
        the yardstick's is routing differently)."""
        if self.replay is not None and len(self.decisions) != len(self.replay):
            raise RuntimeError(
                f"router replay: {len(self.decisions)} topk calls, {len(self.replay)} recorded"
            )


def compare_decisions(mine: list[Decision], yardstick: list[Decision]) -> dict[str, Any]:
    """Per call: ``rows`` (tokens, times groups for a grouped call), ``flips`` (rows whose set of
    experts differs from the yardstick's), ``flip_margins`` (the yardstick's margin at each flip),
    ``score_error`` (the largest |score − yardstick's score|) and ``min_margin`` (the yardstick's
    smallest margin). A json-able dict of lists, one entry per call."""
    if len(mine) != len(yardstick):
        raise ValueError(f"{len(mine)} routing decisions against {len(yardstick)}")
    out: dict[str, list[Any]] = {
        "rows": [],
        "flips": [],
        "flip_margins": [],
        "score_error": [],
        "min_margin": [],
    }
    for a, y in zip(mine, yardstick):
        ia = a.indices.to(y.indices.device).sort(-1).values
        flipped = (ia != y.indices.sort(-1).values).any(-1)
        m = margins(y)
        err = (a.scores.to(y.scores.device).double() - y.scores.double()).abs()
        out["rows"].append(flipped.numel())
        out["flips"].append(int(flipped.sum()))
        out["flip_margins"].append(m[flipped].tolist())
        out["score_error"].append(float(err.max()) if err.numel() else 0.0)
        out["min_margin"].append(float(m.min()) if m.numel() else float("inf"))
    return out
