"""The loss-only fallback: the fused loss on a causal LM outside the registry, proven at patch time.

``patch(model, fallback="loss")`` on a model that no spec describes swaps the two forwards the
spec path swaps for the loss, and nothing else: each lm_head ``nn.Linear`` gets ``lm_head_forward``
and the causal LM gets the generic ``causal_lm_forward`` (``moe_causal_lm_forward`` when its forward
takes ``output_router_logits``), bound to a spec derived from the model (``loss_only_spec``) that
names no attention, norm or MLP class. Attention, norms and MLPs keep transformers' forwards, and
the options that act on them are off (``loss_only_options``).

The generic forward computes the cross entropy of ``softcap(lm_head(h))``, ``h`` the base model's
``last_hidden_state``. Before anything is swapped, ``prove_loss_fallback`` checks that the model's
own forward computes exactly that, on a probe (two rows of a few tokens, eval mode, no grad):

- the forward takes the generic forward's arguments, in its order, with its defaults; the base
  model ``model.model`` takes them as the generic forward passes them, and the head
  ``model.lm_head`` holds a plain ``nn.Linear`` of (vocab x hidden);
- the lm_head is called once, on the base model's ``last_hidden_state``;
- the logits returned are the lm_head's output, or that output through the final softcap the config
  declares (``SOFTCAP_ATTRS``), same dtype. For this the lm_head's output is replaced, during the
  probe only, by a pattern spanning [-48, 48]: a scale or a cap that a random model's small logits
  would hide shows there;
- the loss is transformers' token mean of the next-token cross entropy of those logits (-100
  ignored);
- a mixture of experts' ``aux_loss`` is transformers' ``load_balancing_loss_func`` (of the model's
  modeling module) of the router logits, with the model's ``num_experts`` and
  ``num_experts_per_tok``, and the loss adds it times ``router_aux_loss_coef``.

Anything else is refused with ``FallbackRefusedError`` naming what differed, before anything is
changed: a logit scale (Granite's ``logits_scaling``, Cohere's ``logit_scale``: the fused loss takes
none), logits upcast to fp32 by the forward, another loss, another aux loss, another layout of
the model (``transformer``/``embed_out`` instead of ``model``/``lm_head``). A forward that is not
transformers' own (a subclass's, remote code's) is refused by ``surgery.patching.foreign`` when the
swaps are planned, after the probe: what differs is reported first.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from surgery.forwards.causal_lm import (
    STATE_ATTR,
    PatchState,
    causal_lm_forward,
    moe_causal_lm_forward,
)
from surgery.forwards.head import LM_HEAD_ATTR, head_linears, lm_head_forward
from surgery.models import ArchitectureSpec
from surgery.options import PatchOptions, loss_only_options
from surgery.patching.foreign import ForeignForwardError, foreign_kernel_modules
from surgery.patching.registry import UnsupportedModelError, find_causal_lm
from surgery.patching.signature import CACHE
from surgery.patching.swap import Swap, check_signature, plan_swap

__all__ = [
    "FALLBACKS",
    "FALLBACK_ATTR",
    "SOFTCAP_ATTRS",
    "FallbackRefusedError",
    "LossFallback",
    "causal_lm_of",
    "fallback_patched_lm",
    "find_fallback_lm",
    "loss_only_options",
    "plan_loss_fallback",
    "prove_loss_fallback",
]

FALLBACKS = ("loss",)
"""The values of ``patch(fallback=...)`` besides None (the default: an unknown architecture
raises)."""

FALLBACK_ATTR = "_surgery_fallback"
"""Key of a fallback-patched causal LM's ``LossFallback`` in its ``__dict__``."""

SOFTCAP_ATTRS = ("final_logit_softcapping",)
"""Config attributes declaring a final logit softcap ``cap * tanh(logits / cap)``: transformers'
name for it (VaultGemma, NanoChat, Gemma 3n); the probe checks that the forward applies it."""

PROBE_SHAPE = (2, 6)  # rows x tokens
PROBE_RANGE = 48.0  # the lm_head output pattern spans [-PROBE_RANGE, PROBE_RANGE]
PROBE_IGNORED = 2  # this position's label is -100 in the probe


class FallbackRefusedError(UnsupportedModelError):
    """``patch(model, fallback="loss")``: the model is not a standard causal LM whose logits the
    fused loss computes exactly; the message says what differed. Nothing was changed."""


@dataclass(frozen=True)
class LossFallback:
    """What ``prove_loss_fallback`` established about one model (kept in its ``__dict__`` while
    patched; ``surgery.describe`` reports it)."""

    spec: ArchitectureSpec
    """The derived spec the generic forward is bound to (``loss_only_spec``)."""
    checks: tuple[str, ...]
    """What the probe compared, in words."""


def find_fallback_lm(model: nn.Module) -> nn.Module:
    """The outermost transformers model in ``model`` (``model`` itself, or the one inside a
    ``PeftModel``). Raises ``FallbackRefusedError`` when there is none."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise FallbackRefusedError(
        f"surgery.patch(fallback='loss'): {type(model).__name__} holds no transformers model "
        "(PreTrainedModel). Nothing was changed."
    )


def fallback_patched_lm(model: nn.Module) -> nn.Module | None:
    """The causal LM in ``model`` that the fallback patched, or None."""
    for module in model.modules():
        if FALLBACK_ATTR in module.__dict__:
            return module
    return None


def causal_lm_of(model: nn.Module) -> nn.Module | None:
    """The causal LM that ``patch`` patches in ``model`` (patched or not): the supported one
    (``find_causal_lm``), else the one the fallback patched, else None."""
    try:
        return find_causal_lm(model)[0]
    except UnsupportedModelError:
        return fallback_patched_lm(model)


def _forward_class(lm: nn.Module) -> type:
    """The class whose ``forward`` the model runs: transformers' causal LM, or a subclass that
    overrides it."""
    return next(cls for cls in type(lm).__mro__ if "forward" in cls.__dict__)


def _refuse(lm: nn.Module, what: str) -> FallbackRefusedError:
    return FallbackRefusedError(
        f"surgery.patch(fallback='loss') refuses {type(lm).__name__}: {what}. Only the standard "
        "causal-LM forward (base model -> final hidden states -> lm_head -> token-mean cross "
        "entropy) can take the fused loss exactly. Nothing was changed."
    )


def _check_layout(lm: nn.Module) -> None:
    config = getattr(lm, "config", None)
    for attr in ("model", "lm_head"):
        if not isinstance(getattr(lm, attr, None), nn.Module):
            raise _refuse(lm, f"it has no `{attr}` module (the generic forward calls `{attr}`)")
    for attr in ("vocab_size", "hidden_size"):
        if not isinstance(getattr(config, attr, None), int):
            raise _refuse(lm, f"its config has no int `{attr}`")
    if not head_linears(lm):
        raise _refuse(
            lm,
            f"its lm_head ({type(lm.lm_head).__name__}) holds no nn.Linear of "
            f"({config.vocab_size} x {config.hidden_size}) whose weight the fused loss can read",
        )


def _check_signature(lm: nn.Module, forward) -> None:
    original = _forward_class(lm).forward
    try:
        check_signature(lm, original, forward)
    except RuntimeError as err:
        raise _refuse(lm, f"its forward's arguments are not the standard ones ({err})") from None
    theirs = inspect.signature(original).parameters
    ours = inspect.signature(forward).parameters
    for name, param in theirs.items():
        default, generic = param.default, ours[name].default if name in ours else param.default
        if default is not inspect.Parameter.empty and default != generic:
            raise _refuse(
                lm,
                f"its forward's {name} defaults to {default!r}, the generic one's to {generic!r}",
            )


def _check_moe(lm: nn.Module, spec: ArchitectureSpec) -> None:
    missing = [
        attr
        for attr in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
        if getattr(lm, attr, None) is None
    ]
    if not hasattr(lm.config, "output_router_logits"):
        missing.append("config.output_router_logits")
    try:
        spec.load_balancing_loss()
    except (AttributeError, ImportError):
        missing.append(f"{spec.module}.load_balancing_loss_func")
    if missing:
        raise _refuse(
            lm,
            "its forward takes output_router_logits (a mixture of experts) but it lacks "
            + ", ".join(missing)
            + ", with which transformers' router aux loss is computed",
        )


def _declared_softcap(lm: nn.Module) -> str | None:
    for attr in SOFTCAP_ATTRS:
        if getattr(lm.config, attr, None) is not None:
            return attr
    return None


def _spec_class(lm: nn.Module, moe: bool) -> type:
    """The class the derived spec names: the one whose forward runs, or for a mixture of experts
    the first class (in the MRO) whose module defines ``load_balancing_loss_func`` (a subclass's
    forward calling its parent's still gets the parent's aux loss; the probe checks it)."""
    if moe:
        for cls in type(lm).__mro__:
            module = sys.modules.get(cls.__module__)
            if hasattr(module, "load_balancing_loss_func"):
                return cls
    return _forward_class(lm)


def loss_only_spec(lm: nn.Module, softcap_attr: str | None, moe: bool) -> ArchitectureSpec:
    """The spec the generic forward is bound to: the model's class and module (for
    ``load_balancing_loss_func``), its softcap, whether it is a mixture of experts; no attention,
    norm or MLP class (nothing but the loss is swapped)."""
    cls = _spec_class(lm, moe)
    return ArchitectureSpec(
        model_type=str(getattr(lm.config, "model_type", "")),
        module=cls.__module__,
        causal_lm=cls.__qualname__,
        attention="",
        logit_softcap=softcap_attr,
        router_aux_loss=moe,
    )


# ---------------------------------------------------------------------------------------------
# the probe


def _mismatch(got, want: torch.Tensor) -> str | None:
    """Why ``got`` is not ``want``, or None: same shape and dtype, and each element within two
    roundings of ``want``'s dtype (2 eps x (|want| + mean |want|)). The same operations on the
    same inputs give the same bits; the margin only absorbs a reordered reduction."""
    if not isinstance(got, torch.Tensor):
        return f"it returned {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    g, w = got.detach().double(), want.detach().double().to(got.device)
    eps = torch.finfo(want.dtype).eps
    bound = 2 * eps * (w.abs() + w.abs().mean())
    diff = (g - w).abs()
    if bool((diff <= bound).all()):
        return None
    return f"max difference {float(diff.nan_to_num(float('inf')).max()):.4g}"


def _what_the_logits_are(logits: torch.Tensor, head: torch.Tensor) -> str:
    """A reading of returned logits against the lm_head's output, for a refusal message."""
    g, h = logits.detach().double().flatten(), head.detach().double().flatten().to(logits.device)
    scale = float(g @ h / (h @ h))
    if bool(torch.allclose(g, scale * h, rtol=1e-2, atol=1e-2)):
        return (
            f"they are {scale:.6g} x the lm_head's output: a logit scale (such as "
            "config.logits_scaling or logit_scale), which the fused loss does not take"
        )
    if float(g.abs().max()) < 0.9 * float(h.abs().max()):
        return (
            f"they are bounded by {float(g.abs().max()):.4g} where the lm_head's output reaches "
            f"{float(h.abs().max()):.4g}: a softcap? (declared ones are read from config."
            + " / config.".join(SOFTCAP_ATTRS)
            + ")"
        )
    return "they are something else"


def _probe_pattern(output: torch.Tensor) -> torch.Tensor:
    """A replacement for the lm_head's output: the same shape and dtype, values spread over
    [-PROBE_RANGE, PROBE_RANGE] in a fixed random order."""
    n = output.numel()
    g = torch.Generator().manual_seed(0)
    values = torch.linspace(-PROBE_RANGE, PROBE_RANGE, n, dtype=torch.float64)
    values = values[torch.randperm(n, generator=g)].reshape(output.shape)
    return values.to(device=output.device, dtype=output.dtype)


def _input_device(lm: nn.Module) -> torch.device:
    try:
        return lm.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(lm.parameters()).device


def _run_probe(lm: nn.Module, spec: ArchitectureSpec) -> list[str]:
    """Compare the model's outputs on the probe with the generic forward's ingredients; raise
    ``FallbackRefusedError`` at the first difference; return what was checked."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, PROBE_SHAPE, generator=g)
    ids = ids.to(_input_device(lm))
    labels = ids.clone()
    labels[:, PROBE_IGNORED] = -100
    moe = {"output_router_logits": True} if spec.router_aux_loss else {}
    out, seen = _probe_forward(lm, ids, labels, moe)
    base = _probe_base_model(lm, ids, moe)
    if len(seen) != 1:
        raise _refuse(lm, f"its forward called lm_head {len(seen)} times on the probe, not once")
    head_input, pattern = seen[0]
    differs = _mismatch(head_input, base.last_hidden_state)
    if differs:
        raise _refuse(lm, f"lm_head's input is not the base model's last_hidden_state ({differs})")
    checks = ["lm_head is called once, on the base model's last_hidden_state"]
    want, check = _check_logits(lm, spec, out, pattern)
    checks.append(check)
    return checks + _check_loss(lm, spec, out, base, want, labels)


def _probe_forward(lm: nn.Module, ids, labels, moe: dict):
    """The model's own forward on the probe with lm_head's output replaced by a known pattern
    (``_probe_pattern``): its output, and each lm_head call's (input, pattern)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def substitute(module, args, kwargs, output):
        pattern = _probe_pattern(output)
        seen.append((args[0] if args else next(iter(kwargs.values())), pattern))
        return pattern.clone()  # the forward may change its logits in place; the pattern stays

    handle = lm.lm_head.register_forward_hook(substitute, with_kwargs=True)
    try:
        out = lm(input_ids=ids, labels=labels, use_cache=False, **moe)
    except Exception as err:  # the model's own error, reported as a refusal
        raise _refuse(lm, f"its forward raised on the probe ({type(err).__name__}: {err})") from err
    finally:
        handle.remove()
    return out, seen


def _probe_base_model(lm: nn.Module, ids, moe: dict):
    """The base model's output on the probe, called as the generic forward calls it; refused
    where it does not take those arguments or lacks a field the forward reads."""
    try:
        base = lm.model(
            input_ids=ids,
            attention_mask=None,
            position_ids=None,
            inputs_embeds=None,
            use_cache=False,
            **{CACHE: None},
            **moe,
        )
        names = ("last_hidden_state", CACHE, "hidden_states", "attentions")
        for name in names + (("router_logits",) if moe else ()):
            getattr(base, name)
    except Exception as err:
        raise _refuse(
            lm,
            f"its base model does not take or return what the generic forward passes and reads "
            f"({type(err).__name__}: {err})",
        ) from err
    return base


def _check_logits(lm: nn.Module, spec: ArchitectureSpec, out, pattern):
    """The logits the model returned against lm_head's output (``pattern``), capped where the
    spec's ``logit_softcap`` says: (the logits they must be, what was checked)."""
    cap = getattr(lm.config, spec.logit_softcap) if spec.logit_softcap else None
    want = pattern if cap is None else torch.tanh(pattern / cap) * cap
    logits = getattr(out, "logits", None)
    differs = _mismatch(logits, want)
    if differs:
        what = "the lm_head's output" if cap is None else f"softcap(lm_head output, {cap:g})"
        detail = (
            _what_the_logits_are(logits, pattern)
            if isinstance(logits, torch.Tensor) and logits.shape == pattern.shape
            else ""
        )
        raise _refuse(
            lm,
            f"the logits it returns are not {what} ({differs}"
            + (f"; {detail}" if detail else "")
            + ")",
        )
    if cap is None:
        return want, "logits are the lm_head's output"
    return (
        want,
        f"logits are {cap:g} * tanh(lm_head output / {cap:g}) (config.{spec.logit_softcap})",
    )


def _check_loss(lm: nn.Module, spec: ArchitectureSpec, out, base, want, labels) -> list[str]:
    """The loss (and a mixture's aux_loss) the model returned against the token-mean next-token
    cross entropy of ``want`` (plus transformers' load-balancing loss times its coefficient);
    what was checked."""
    checks = []
    vocab = want.shape[-1]
    expected = F.cross_entropy(
        want.float()[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1).to(want.device)
    )
    if spec.router_aux_loss:
        expected_aux = spec.load_balancing_loss()(
            base.router_logits, lm.num_experts, lm.num_experts_per_tok, None
        )
        differs = _mismatch(getattr(out, "aux_loss", None), expected_aux)
        if differs:
            raise _refuse(
                lm,
                f"its aux_loss is not {spec.module}.load_balancing_loss_func of the router logits "
                f"({differs})",
            )
        expected = expected + lm.router_aux_loss_coef * expected_aux.to(expected.device)
        checks.append(
            "aux_loss is load_balancing_loss_func(router_logits, num_experts, "
            "num_experts_per_tok), added times router_aux_loss_coef"
        )
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or not torch.allclose(
        loss.detach().double(), expected.detach().double().to(loss.device), rtol=1e-5, atol=1e-6
    ):
        got = f"{float(loss):.6g}" if isinstance(loss, torch.Tensor) else repr(loss)
        raise _refuse(
            lm,
            f"its loss ({got}) is not the token-mean next-token cross entropy of its logits "
            f"({float(expected):.6g})",
        )
    checks.append("loss is the token-mean next-token cross entropy of the logits")
    return checks


def prove_loss_fallback(lm: nn.Module) -> LossFallback:
    """Check that the fallback computes exactly what ``lm``'s own forward computes (the module
    docstring lists what is checked) and return what was found; raise ``FallbackRefusedError``
    (or ``ForeignForwardError`` for a model another kernel library patched) otherwise. ``lm``
    must be unpatched. Runs the model on a probe in eval mode under no_grad, then puts every
    module's training flag back; its parameters and buffers are not changed."""
    foreign = foreign_kernel_modules(lm)
    if foreign:
        raise ForeignForwardError(
            f"surgery.patch: {type(lm).__name__} holds modules patched by another kernel "
            f"library: {'; '.join(foreign[:3])}. Nothing was changed."
        )
    _check_layout(lm)
    moe = "output_router_logits" in inspect.signature(_forward_class(lm).forward).parameters
    _check_signature(lm, moe_causal_lm_forward if moe else causal_lm_forward)
    spec = loss_only_spec(lm, _declared_softcap(lm), moe)
    if moe:
        _check_moe(lm, spec)
    if any(p.is_meta for p in lm.parameters()):
        raise _refuse(lm, "its parameters are on the meta device: the probe cannot run it")

    modes = [(module, module.training) for module in lm.modules()]
    lm.eval()
    try:
        with torch.no_grad():
            checks = _run_probe(lm, spec)
    finally:
        for module, training in modes:
            module.training = training
    checks.insert(0, "forward takes the standard causal-LM arguments")
    return LossFallback(spec=spec, checks=tuple(checks))


def plan_loss_fallback(lm: nn.Module, proof: LossFallback, options: PatchOptions) -> list[Swap]:
    """The swaps of the loss-only patch of ``lm`` (proven by ``proof``) with ``options`` (already
    ``loss_only_options``), checked; nothing is changed yet."""
    wanted: list[tuple[str, nn.Module, object, dict]] = []
    if options.fused_linear_cross_entropy:
        names = {id(m): n for n, m in lm.named_modules()}
        for head in head_linears(lm):
            wanted.append((names[id(head)], head, lm_head_forward, {LM_HEAD_ATTR: True}))
    state = {STATE_ATTR: PatchState(spec=proof.spec, options=options), FALLBACK_ATTR: proof}
    forward = moe_causal_lm_forward if proof.spec.router_aux_loss else causal_lm_forward
    wanted.append(("", lm, forward, state))
    swaps = [plan_swap(module, fn, extra, name) for name, module, fn, extra in wanted]
    return [swap for swap in swaps if swap is not None]
