"""TRL's fused LM head, served by surgery's kernel on a patched model.

TRL's trainers (``SFTTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ``KTOTrainer``, ``DPOTrainer``)
call ``trl.trainer.utils.add_fused_lm_head(model, ...)``, which sets ``model.forward`` to its
``_fused_forward``: called with ``fused_lm_head=True`` it runs the backbone and TRL's chunked
log-probability kernel, and returns a ``FusedCausalLMOutput`` (per-token ``log_probs`` and the
``outputs`` asked for at install time, ``label_mask``, the loss, the MoE ``aux_loss``); called
without, it calls the forward it replaced, which on a patched model is surgery's.

surgery serves the first kind of call. ``patch`` registers ``serve_fused_head`` as a forward
pre-hook of the patched causal LM (it runs inside ``model(...)``, also under PEFT, DDP, FSDP2 and
accelerate's wrappers). On a call with ``fused_lm_head=True`` whose forward is TRL's
``_fused_forward`` of a checked release (``CHECKED``), installed over surgery's forward, the hook
takes ``fused_lm_head`` out and puts a ``FusedHeadRequest`` (TRL's settings, read from that
function: temperature, outputs, softcap, logit scale, fp32 head) in its place. TRL's forward then
hands every argument to surgery's, which runs the base model and ``linear_log_probs`` through
the lm_head module and builds TRL's output with TRL's semantics (``fused_head_output``).

Anything else keeps TRL's head, whole: another TRL release (with a warning, once per model), a
head with an adapter of its own (LoRA on lm_head), a forward TRL did not install over surgery's.
What is read of TRL's (the function's name, module and closure names, ``FusedCausalLMOutput``)
is pinned by ``tests/surgery/test_trl.py`` against the TRL release CI installs.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.forwards.head import fused_head, head_takes_loss
from surgery.kernels import UpstreamHint
from surgery.patching.swap import ORIGINAL_ATTR

__all__ = [
    "CHECKED",
    "REQUEST_KWARG",
    "SFT_LOSS_KWARG",
    "FusedHeadRequest",
    "fused_head_output",
    "fused_head_request",
    "loss_options_set",
    "serve_fused_head",
]

CHECKED = ("1.16",)
"""TRL releases (major.minor) whose fused head surgery serves: the contract was checked against
each (``tests/surgery/test_trl.py``)."""

REQUEST_KWARG = "surgery_trl_request"
"""The keyword argument that carries a ``FusedHeadRequest`` from the hook to surgery's forward."""

SFT_LOSS_KWARG = "surgery_sft_loss"
"""The keyword argument ``surgery.integrations.trl_sft.SFTTrainer`` adds to TRL's fused call
(True): serve surgery's loss, with the patch's loss options, besides TRL's statistics."""

REQUEST_ATTR = "_surgery_trl_request"
"""Instance attribute of the patched causal LM: (TRL's function, its ``FusedHeadRequest`` or
None, the index of the closure cell holding the forward TRL replaced), read once per installed
function."""

TRL_OUTPUTS = ("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits")
"""The per-token fields of TRL's ``FusedCausalLMOutput`` (surgery's kernel computes more:
``predicted``)."""

_CLOSURE = (
    "original_forward",
    "temperature",
    "outputs",
    "cast_lm_head_to_fp32",
    "final_logit_softcapping",
    "logit_scale",
)


@dataclass(frozen=True)
class FusedHeadRequest:
    """TRL's fused-head settings, as ``add_fused_lm_head`` fixed them for this model, and what
    the model's training calls taught about their upstream gradient (``linear_log_probs``'
    ``upstream``): uniform over the tokens in SFT's token mean, and then the head takes three
    matrix products; per token in RL objectives."""

    outputs: tuple[str, ...]
    temperature: float
    logit_scale: float
    softcap: float | None
    cast_fp32: bool
    upstream: UpstreamHint = field(default_factory=UpstreamHint, compare=False)
    surgery_loss: bool = False
    """Serve surgery's loss (the patch's ``loss_reduction``, z-loss and label smoothing) and
    TRL's statistics instead of the per-token log-probabilities (``SFT_LOSS_KWARG``)."""


def _trl_function(forward: Any) -> Any:
    """TRL's ``_fused_forward`` function behind ``forward`` (bound, or inside accelerate's
    wrappers, which keep ``__wrapped__``), or None. TRL's own ``__wrapped__`` (``functools.wraps``
    of the class forward) is never followed past it."""
    fn = forward
    for _ in range(16):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        module = getattr(fn, "__globals__", {}).get("__name__")
        if code is not None and code.co_name == "_fused_forward" and module == "trl.trainer.utils":
            return fn
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def _trl_version() -> str:
    import trl

    return ".".join(trl.__version__.split(".")[:2])


def _read_request(model: nn.Module, fn: Any) -> tuple[FusedHeadRequest | None, int]:
    """TRL's settings in ``fn``'s closure, and the index of its cell holding the forward TRL
    replaced (``original_forward``); (None, -1) for a release surgery has not checked."""
    version = _trl_version()
    if version not in CHECKED:
        warnings.warn(
            f"surgery: TRL {version}'s fused LM head is not one surgery has checked (it serves "
            f"TRL {', '.join(CHECKED)}); TRL's own head computes the log-probabilities of "
            f"{type(model).__name__}, surgery's layer kernels still run.",
            stacklevel=5,
        )
        return None, -1
    names = fn.__code__.co_freevars
    closure = dict(zip(names, (c.cell_contents for c in fn.__closure__)))
    if not set(_CLOSURE) <= set(closure):
        return None, -1
    softcap = closure["final_logit_softcapping"]
    request = FusedHeadRequest(
        outputs=tuple(closure["outputs"]),
        temperature=float(closure["temperature"]),
        logit_scale=float(closure["logit_scale"]),
        softcap=None if softcap is None else float(softcap),
        cast_fp32=bool(closure["cast_lm_head_to_fp32"]),
    )
    return request, names.index("original_forward")


LOSS_OPTIONS = ("loss_reduction", "z_loss_scale", "label_smoothing")
"""``patch``'s options that change the loss: TRL's trainers compute their own from the
per-token log-probabilities, so under TRL none of them applies, except through
``surgery.integrations.trl_sft.SFTTrainer``."""


def loss_options_set(options) -> list[str]:
    """The ``LOSS_OPTIONS`` of ``PatchOptions`` ``options`` (or None) that differ from ``patch``'s
    defaults, as ``name=value``."""
    from surgery.options import OPTION

    if options is None:
        return []
    return [
        f"{name}={getattr(options, name)!r}"
        for name in LOSS_OPTIONS
        if getattr(options, name) != OPTION[name].default
    ]


def _warn_loss_options(model: nn.Module) -> None:
    from surgery.api import patch_options

    changed = loss_options_set(patch_options(model))
    if changed:
        warnings.warn(
            f"surgery: {type(model).__name__} is patched with {', '.join(changed)}, but TRL's "
            "trainer computes its loss itself from the per-token log-probabilities surgery's "
            "kernel serves (TRL's token mean): these options do not apply under TRL. For SFT, "
            "surgery.integrations.trl_sft.SFTTrainer trains on surgery's loss with them.",
            stacklevel=4,
        )


def fused_head_request(
    model: nn.Module, warn_loss_options: bool = False
) -> FusedHeadRequest | None:
    """The request surgery serves for TRL's fused forward on ``model``, or None (TRL's head).

    TRL's settings are read once per installed function (then, with ``warn_loss_options``, a
    warning names the patch's loss options TRL's own loss leaves out); what can change after that
    is checked
    on every call: that the forward TRL hands the call to is this model's patched forward (not
    the original's, after ``copy.deepcopy``: the copy shares TRL's function and its closure), and
    that the head takes the loss (no adapter put on it since)."""
    fn = _trl_function(model.forward)
    if fn is None:
        return None
    cached = model.__dict__.get(REQUEST_ATTR)
    if cached is None or cached[0] is not fn:
        cached = (fn, *_read_request(model, fn))
        model.__dict__[REQUEST_ATTR] = cached
        if warn_loss_options and cached[1] is not None:
            _warn_loss_options(model)
    _, request, slot = cached
    if request is None:
        return None
    installed = model.__dict__.get(ORIGINAL_ATTR)
    if installed is None or fn.__closure__[slot].cell_contents is not installed.value:
        return None  # TRL wrapped a forward other than this model's patched one
    if not head_takes_loss(model.lm_head):
        return None  # an adapter on the head: its logits, through TRL's head
    return request


def serve_fused_head(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook (``with_kwargs=True``) of a patched causal LM: a TRL fused-head call
    becomes a call of surgery's forward with a ``FusedHeadRequest`` (module docstring). Any other
    call is left as it is, at the cost of one dictionary lookup."""
    if not kwargs.get("fused_lm_head"):
        return None
    surgery_loss = bool(kwargs.get(SFT_LOSS_KWARG))
    request = fused_head_request(model, warn_loss_options=not surgery_loss)
    if request is None:
        return None
    kwargs = dict(kwargs)
    del kwargs["fused_lm_head"]
    if kwargs.pop(SFT_LOSS_KWARG, False):
        request = dataclasses.replace(request, surgery_loss=True)
    kwargs[REQUEST_KWARG] = request
    return args, kwargs


def fused_head_output(
    model: nn.Module,
    request: FusedHeadRequest,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: Any,
    head_options: dict,
    aux_loss: torch.Tensor | None = None,
    aux_coef: float | None = None,
    loss_options: dict | None = None,
    softcap: float | None = None,
):
    """TRL's ``FusedCausalLMOutput`` of the final hidden states (B, T, D), with TRL's semantics:
    targets are the labels shifted by one position in each row (``hidden[:, :-1]`` against
    ``labels[:, 1:]``), or ``shift_labels`` as given; every per-token field is (B, T - 1) (or
    (B, T)) and 0 (False) where the target is -100; ``loss`` is minus the sum of the
    log-probabilities over ``num_items_in_batch`` (default: the number of targets, at least 1),
    plus ``aux_coef`` times the MoE ``aux_loss`` where there is one. ``head_options``: the
    patch's loss kernel settings (chunk size, ``skip_ignored``, ``low_memory``).

    A ``request.surgery_loss`` request gets surgery's loss instead (``loss_options``: the
    patch's reduction, z-loss, label smoothing and the batch's sequence boundaries; ``softcap``:
    the model's), without the aux loss, and ``z_loss``, the z-loss term inside it (detached);
    the statistics TRL asked for are computed in the same sweep, ``log_probs`` is None."""
    from trl.trainer.utils import FusedCausalLMOutput

    shift = shift_labels is None
    targets = (labels if shift else shift_labels).to(hidden.device)
    mask = (targets[:, 1:] if shift else targets) != -100
    if request.surgery_loss:
        return _surgery_loss_output(
            model, request, hidden, targets, shift, mask, head_options, loss_options, softcap,
            aux_loss,
        )  # fmt: skip
    out = fused_head(model)(
        hidden,
        labels=targets,
        outputs=request.outputs,
        temperature=request.temperature,
        logit_scale=request.logit_scale,
        softcap=request.softcap,
        shift=shift,
        cast_fp32=request.cast_fp32,
        upstream=request.upstream,
        **head_options,
    )

    fields = {name: _trim(getattr(out, name), shift) for name in TRL_OUTPUTS}
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / count
    if aux_loss is not None:
        loss = loss + aux_coef * aux_loss.to(loss.device)
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)


def _trim(t: torch.Tensor | None, shift: bool) -> torch.Tensor | None:
    """A per-token field in TRL's shape: without a row's last token (it has no next label)."""
    return t[:, :-1].contiguous() if shift and t is not None else t


def _surgery_loss_output(
    model, request, hidden, targets, shift, mask, head_options, loss_options, softcap, aux_loss
):
    """``fused_head_output`` of a ``surgery_loss`` request (see there)."""
    from trl.trainer.utils import FusedCausalLMOutput

    if request.temperature != 1.0 or request.logit_scale != 1.0:
        raise ValueError(
            "surgery: surgery's SFT loss is the model's own cross entropy; TRL's head was set up "
            f"with temperature {request.temperature} and logit scale {request.logit_scale}"
        )
    statistics = tuple(name for name in request.outputs if name != "log_probs")
    (loss, z_loss), stats = fused_head(model)(
        hidden,
        labels=targets,
        statistics=statistics,
        softcap=softcap,
        shift=shift,
        cast_fp32=request.cast_fp32,
        **loss_options,
        **head_options,
    )
    fields = {name: _trim(stats.get(name), shift) for name in TRL_OUTPUTS if name != "log_probs"}
    out = FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)
    out["z_loss"] = z_loss.detach()
    return out
