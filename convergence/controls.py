"""Negative controls: a pure-PyTorch imitation of ``surgery.patch`` with switchable planted bugs,
to show that the convergence checks catch what they claim to catch.

``fake_patch()`` trains exactly like the real patch (transformers' modules, the loss of
``surgery.convergence.loss``, the packed-batch guard, boundaries from ``position_ids``,
``shift_labels``, a mixture's router aux loss over the mask's tokens); ``fake_patch(bug,
onset=k)`` plants one bug of ``BUGS``, active from training step ``k`` on (0: from the start; a
late onset shows that the checks do not stop at step 0). It is never the patched side of a real
run: ``python -m surgery.convergence --controls`` runs the whole table of bugs against it, and the
test suite requires every bug to fail in fp32 and bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from .loss import causal_lm_loss
from .side import load_balancing_loss, router_aux_loss_trained

__all__ = ["BUGS", "Bug", "fake_patch"]


@dataclass(frozen=True)
class Bug:
    """A planted bug and the run that exposes it: the loss options and layouts it needs (a bug
    in packing needs packed rows). Every control runs with a z-loss (``Z_SCALES``)."""

    description: str
    reduction: str = "mean"
    label_smoothing: float = 0.0
    layouts: tuple[str, ...] = ("padded", "packed")
    model: str = "llama"
    late: bool = True  # whether a late onset makes sense
    # Dynamic NTK RoPE, the documents' longest length as the trained context: standard RoPE is
    # shift-invariant, so positions that run on across documents change nothing while attention
    # keeps them apart; dynamic RoPE rescales its frequencies once a position passes the trained
    # context, which running positions do and restarting ones do not.
    dynamic_rope: bool = False


BUGS: dict[str, Bug] = {
    "z_grad": Bug("z-loss gradient 1% too large"),
    "z_scale_partial": Bug("trained loss carries 0.9 of the z-loss (returned whole)"),
    "z_loss_not_trained": Bug("z-loss returned but its gradient dropped"),
    "ls_dropped": Bug("label smoothing 0.1 asked, none applied", label_smoothing=0.1),
    "ls_unasked": Bug("label smoothing 0.05 applied when none asked"),
    "shift_extra": Bug("labels shifted one position too many"),
    "shift_missing": Bug("labels not shifted"),
    "shift_labels_ignored": Bug(
        "shift_labels ignored (labels shifted instead)", layouts=("padded",)
    ),
    "attention_leak": Bug(
        "packed documents attend to the previous ones (no cache guard)", layouts=("packed",)
    ),
    "boundary_leak": Bug(
        "a document's last token trained to predict the next document's first",
        layouts=("packed",),
    ),
    "rope_no_restart": Bug(
        "RoPE positions run on across packed documents", layouts=("packed",), dynamic_rope=True
    ),
    "rope_off_by_one": Bug("keys rotated one position ahead of queries"),
    "softcap_missing": Bug("final-logit softcap not applied", model="gemma2"),
    "lm_head_grad": Bug("lm_head weight gradient 1% too large"),
    "grad_scale": Bug("every gradient 1% too large (loss right)"),
    "token_mean": Bug("per-sequence mean replaced by the token mean", reduction="sequence"),
    "logits": Bug("the training forward returns logits", late=False),
    # A mixture of experts, where the sides run with the yardstick's routing replayed: replay
    # must not hide a wrong expert output.
    "moe_experts": Bug("every MoE layer's expert output 1% too large", model="mixtral"),
    "moe_router_input": Bug("the routers see hidden states 1% off", model="mixtral"),
    # The router aux loss, trained with the model's coefficient: wrongly weighted, and wrongly
    # counted (the mask left out, as a forward that drops it for its attention might).
    "aux_weight": Bug(
        "trained loss carries the router aux loss at 1.01x its coefficient", model="mixtral"
    ),
    "aux_padding": Bug(
        "router aux loss counts the padding tokens", layouts=("padded",), model="mixtral"
    ),
}


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _rotate_keys_one_position(model, active: Callable[[], bool]) -> None:
    """Forward hooks on every k_proj that, while ``active()``, rotate each key head by position
    1's angles: with the model's own rotation after it, keys sit one position ahead of queries."""
    rotary = model.model.rotary_emb
    for layer in model.model.layers:
        attn = layer.self_attn

        def hook(module, args, out, head_dim=attn.head_dim):
            if not active():
                return out
            angles = torch.cat([rotary.inv_freq, rotary.inv_freq]).to(out.device)
            cos, sin = angles.cos().to(out.dtype), angles.sin().to(out.dtype)
            k = out.unflatten(-1, (-1, head_dim))
            half = torch.cat([-k[..., head_dim // 2 :], k[..., : head_dim // 2]], dim=-1)
            return (k * cos + half * sin).flatten(-2)

        attn.k_proj.register_forward_hook(hook)


def _plant_module_bugs(model, bug: str | None, on: Callable[[str], bool]) -> None:
    """The bugs planted in the model's own modules (hooks and a rotary forward), active while
    ``on(bug)``: the experts' output, the router's input, RoPE's positions."""
    if bug == "moe_experts":
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_hook(
                lambda module, args, out: out * 1.01 if on("moe_experts") else out
            )
    if bug == "moe_router_input":
        # A fixed ±1% per hidden unit: changes the router's ranking, not only its scale.
        g = torch.Generator().manual_seed(0)
        sign = torch.randint(0, 2, (model.config.hidden_size,), generator=g) * 2 - 1
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_pre_hook(
                lambda module, args: (
                    (args[0] * (1 + 0.01 * sign.to(args[0])),) if on("moe_router_input") else args
                )
            )
    if bug == "rope_off_by_one":
        _rotate_keys_one_position(model, lambda: on("rope_off_by_one"))
    if bug == "rope_no_restart":
        rotary = model.model.rotary_emb
        own = rotary.forward

        def rotary_forward(x, position_ids):
            if on("rope_no_restart"):
                position_ids = torch.arange(position_ids.shape[-1], device=x.device)[None]
            return own(x, position_ids)

        rotary.forward = rotary_forward


def fake_patch(bug: str | None = None, onset: int = 0):
    """A ``patch`` callable: correct with ``bug=None``, else with ``BUGS[bug]`` planted from
    training step ``onset`` on (training steps are counted by training-mode forwards with
    labels; a second one on the same batch, a mixture's step-0 comparison pass and then the step
    trained, is the same step)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; expected one of {sorted(BUGS)}")

    def patch(model, loss_reduction="mean", z_loss_scale=0.0, label_smoothing=0.0, **_):
        steps, last_batch = [0], [None]

        def on(name: str) -> bool:
            return bug == name and steps[0] >= onset

        _plant_module_bugs(model, bug, on)

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                    shift_labels=None, **kwargs):  # fmt: skip
            counted = self.training and labels is not None
            if counted and input_ids is last_batch[0]:
                steps[0] -= 1
            # The packed-batch guard: with a KV cache transformers lets packed rows attend across
            # documents (see surgery.forwards.causal_lm).
            use_cache = None if on("attention_leak") else False
            aux_on = router_aux_loss_trained(self)
            moe = {"output_router_logits": True} if aux_on else {}
            base = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, **moe,
            )  # fmt: skip
            logits = _planted_logits(self, base.last_hidden_state, on)
            if labels is None:
                return CausalLMOutputWithPast(logits=logits)
            shift_labels, ls = _planted_targets(labels, shift_labels, label_smoothing, on)
            # Without position ids the loss sees one sequence per row: a document's last token
            # is trained on the next one's first label (packed labels do not mask it).
            pos = None if on("boundary_leak") else position_ids
            loss, z = causal_lm_loss(
                logits, labels, shift_labels=shift_labels,
                reduction="mean" if on("token_mean") else loss_reduction,
                z_loss_scale=z_loss_scale, label_smoothing=ls, position_ids=pos,
            )  # fmt: skip
            loss = _tampered_loss(loss, z, on)
            aux = None
            if aux_on:
                # transformers' load-balancing loss of the model's own module, after the decoder
                # (its topk calls in the order transformers' forward makes them).
                aux = load_balancing_loss(self)(
                    base.router_logits, self.num_experts, self.num_experts_per_tok,
                    None if on("aux_padding") else attention_mask,
                )  # fmt: skip
                coef = self.router_aux_loss_coef * (1.01 if on("aux_weight") else 1.0)
                loss = loss + coef * aux
            if counted:
                steps[0] += 1
                last_batch[0] = input_ids
            out = CausalLMOutputWithPast(
                loss=loss, logits=logits if (on("logits") or not self.training) else None
            )
            out["z_loss"] = z.detach()
            if aux is not None:
                out["aux_loss"] = aux.detach()
            return out

        model.forward = types.MethodType(forward, model)
        return model

    return patch


def _planted_logits(model, hidden: torch.Tensor, on: Callable[[str], bool]) -> torch.Tensor:
    """The head's logits of ``hidden`` (softcapped where the config says), with the planted bugs
    of the head's weight gradient and of a dropped softcap."""
    weight = model.lm_head.weight
    if on("lm_head_grad"):
        weight = _ScaleGrad.apply(weight, 1.01)
    logits = F.linear(hidden, weight)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None and not on("softcap_missing"):
        logits = cap * torch.tanh(logits / cap)
    return logits


def _planted_targets(labels, shift_labels, label_smoothing: float, on: Callable[[str], bool]):
    """The loss's (shifted targets, label smoothing): the caller's ``shift_labels`` (else the
    labels shifted by one), with the planted bugs of the shift and of the smoothing."""
    if shift_labels is None or on("shift_labels_ignored"):
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
    if on("shift_extra"):
        shift_labels = F.pad(shift_labels[:, 1:], (0, 1), value=-100)
    if on("shift_missing"):
        shift_labels = labels
    if on("ls_dropped"):
        label_smoothing = 0.0
    if on("ls_unasked"):
        label_smoothing = 0.05
    return shift_labels, label_smoothing


def _tampered_loss(loss: torch.Tensor, z: torch.Tensor, on: Callable[[str], bool]):
    """``loss`` with the planted bugs of its gradient (the z-loss's and the whole loss's)."""
    if on("z_grad"):
        loss = loss + 0.01 * (z - z.detach())
    if on("z_scale_partial"):
        loss = loss - 0.1 * z
    if on("z_loss_not_trained"):
        loss = loss - z + z.detach()
    if on("grad_scale"):
        loss = loss + 0.01 * (loss - loss.detach())
    return loss


LATE_ONSET = 5  # a late bug starts at this training step
Z_SCALES = (1e-2, 1e-4)  # the suite's default z-loss scale, and the common one


@dataclass(frozen=True)
class Control:
    """One negative-control run: ``bug`` planted from step ``onset`` in a ``dtype`` run with
    z-loss scale ``z``."""

    bug: str
    dtype: str
    z: float
    onset: int = 0

    @property
    def name(self) -> str:
        late = f"@{self.onset}" if self.onset else ""
        return f"{self.bug}{late}/{self.dtype}/z{self.z:g}"


def controls(dtypes: tuple[str, ...] = ("fp32", "bf16")) -> list[Control]:
    """Every bug of ``BUGS``, in each dtype, at each z-loss scale, from the start and (where it
    makes sense) from step ``LATE_ONSET``."""
    out = []
    for bug, spec in BUGS.items():
        for dtype in dtypes:
            for z in Z_SCALES:
                out.append(Control(bug, dtype, z))
                if spec.late:
                    out.append(Control(bug, dtype, z, LATE_ONSET))
    return out


def run_config(control: Control, *, size: str = "tiny", device: str = "cpu", **kw):
    """The ``RunConfig`` that exposes ``control``'s bug (its loss options, layouts and model);
    the correct fake patch must pass the same config. ``kw``: further RunConfig fields."""
    from .configs import SIZES, make_config
    from .side import Variant
    from .train import RunConfig

    spec = BUGS[control.bug]
    variant = Variant(spec.reduction, control.z, spec.label_smoothing)
    overrides = {}
    if spec.dynamic_rope:
        rope = {**make_config(spec.model, size).rope_parameters, "rope_type": "dynamic",
                "factor": 4.0}  # fmt: skip
        overrides = {"rope_parameters": rope, "max_position_embeddings": SIZES[size].max_doc_len}
    steps = kw.pop("steps", LATE_ONSET + 3)
    return RunConfig(model=spec.model, size=size, dtype=control.dtype, device=device,
                     steps=steps, variant=variant, layouts=spec.layouts,
                     config_overrides=json.dumps(overrides) if overrides else "", **kw)  # fmt: skip


def run_controls(
    *,
    size: str = "tiny",
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    say: Callable[[str], None] = print,
) -> dict:
    """Every control of ``controls(dtypes)`` at ``size`` on ``device``: the bug-free fake patch
    must pass each run's config and the planted bug must fail it. Returns a json-able summary
    (``"passed"``: every bug caught, every correct run passed) with the checks that caught each
    bug."""
    from .compare import evaluate
    from .train import train_and_compare

    correct: dict = {}
    rows = []
    for control in controls(dtypes):
        cfg = run_config(control, size=size, device=device)
        t0 = time.perf_counter()
        if cfg not in correct:
            failed = [c for c in evaluate(train_and_compare(cfg, patch=fake_patch()))
                      if not c.passed]  # fmt: skip
            correct[cfg] = [f"{c.side}:{c.name} {c.value:.2e} > {c.limit:.2e}" for c in failed]
        record = train_and_compare(cfg, patch=fake_patch(control.bug, control.onset))
        caught = [dataclasses.asdict(c) for c in evaluate(record) if not c.passed]
        rows.append({
            "control": control.name, "bug": control.bug, "dtype": control.dtype, "z": control.z,
            "onset": control.onset, "description": BUGS[control.bug].description,
            "caught": bool(caught), "caught_by": caught, "correct_fake_failed": correct[cfg],
            "seconds": time.perf_counter() - t0,
        })  # fmt: skip
        del record
        # The sides' models hold themselves through their bound forwards (a reference cycle):
        # free them now, or a full-size table runs out of GPU memory.
        gc.collect()
        names = sorted({c["name"] for c in caught})
        say(
            f"{control.name:36} "
            + ("caught by " + ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
               if caught else "MISSED")
            + ("" if not correct[cfg] else f"  (correct fake FAILED: {correct[cfg][:2]})")
        )  # fmt: skip
    passed = all(r["caught"] and not r["correct_fake_failed"] for r in rows)
    return {"passed": passed, "size": size, "device": device, "controls": rows}
