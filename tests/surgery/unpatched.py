"""Unpatched transformers' training step under the loss options and inputs surgery offers: the
reference for the padding-free and varlen tests.

Where transformers itself has the option (its token mean, ``shift_labels``, ``inputs_embeds``,
``num_items_in_batch``) the unpatched model computes the loss as it does; where it has not
(``loss_reduction="sequence"``, z-loss) the loss is computed here in fp64 from the unpatched model's
logits, by definition: each document's mean cross entropy over its labelled tokens, then the mean
over documents that have any; the z-loss term ``scale * logsumexp(logits)**2`` under the same
weights as the cross entropy. Documents are the rows of a padded batch, or the runs of a packed
row whose positions continue (a new one wherever the position does not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["VARIANTS", "patch_options", "patched_step", "unpatched_step", "variant_batch"]

# The loss options and inputs that change what the fused loss computes, each a step of its own.
VARIANTS = ["mean", "sequence", "shift_labels", "inputs_embeds", "z_loss", "num_items_in_batch"]
Z_LOSS_SCALE = 1e-2
NUM_ITEMS = 40  # more than the batches' labelled tokens: the sum over it, not their mean


def patch_options(variant: str) -> dict:
    """``surgery.patch``'s options for ``variant``."""
    if variant == "sequence":
        return {"loss_reduction": "sequence"}
    if variant == "z_loss":
        return {"z_loss_scale": Z_LOSS_SCALE}
    return {}


def variant_batch(batch: dict, variant: str) -> dict:
    """``batch`` (input_ids, labels, maybe attention_mask and position_ids) with what ``variant``
    adds: transformers' shifted labels beside the labels, or ``num_items_in_batch``."""
    batch = dict(batch)
    if variant == "shift_labels":
        batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    if variant == "num_items_in_batch":
        batch["num_items_in_batch"] = torch.tensor(NUM_ITEMS)
    return batch


def call(model, batch: dict, variant: str, **extra):
    """``model``'s output on ``batch`` (from ``variant_batch``), fed its input embeddings instead
    of the ids for the ``inputs_embeds`` variant."""
    batch = {**batch, **extra}
    if variant == "inputs_embeds":
        ids = batch.pop("input_ids")
        batch["inputs_embeds"] = model.get_input_embeddings()(ids)
    return model(**batch)


def _documents(batch: dict) -> torch.Tensor:
    """(batch * seq,) the document index of every token."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    positions = batch.get("position_ids")
    if positions is None:
        starts = torch.zeros(rows, seq, dtype=torch.bool)
        starts[:, 0] = True
    else:
        positions = positions.expand(rows, seq).cpu()
        starts = torch.ones(rows, seq, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts.flatten().long().cumsum(0) - 1


def reference_loss(logits: torch.Tensor, batch: dict, variant: str) -> torch.Tensor:
    """The loss of ``variant`` from unpatched ``logits`` (batch, seq, vocab), in fp64."""
    labels = batch["labels"]
    targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten().to(logits.device)
    x = logits.double().flatten(0, 1)
    valid = targets != -100
    ce = F.cross_entropy(x, targets.clamp_min(0), reduction="none")
    lse = torch.logsumexp(x, dim=-1)
    if variant == "sequence":
        doc = _documents(batch).to(x.device)
        count = torch.zeros(int(doc.max()) + 1, dtype=x.dtype, device=x.device)
        count.index_add_(0, doc, valid.double())
        weights = valid / count[doc].clamp_min(1) / (count > 0).sum()
    else:
        weights = valid / valid.sum()
    loss = (weights * ce).sum()
    if variant == "z_loss":
        loss = loss + Z_LOSS_SCALE * (weights * lse.square()).sum()
    return loss


def _step(model, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach().to(torch.float32), grads


def unpatched_step(model, batch: dict, variant: str = "mean", **extra):
    """Loss and every parameter's gradient of one unpatched step on ``batch`` (from
    ``variant_batch``) under ``variant``; ``extra``: more keyword arguments for the model
    (``use_cache``, ``output_router_logits``)."""

    def loss_of():
        if variant not in ("sequence", "z_loss"):
            return call(model, batch, variant, **extra).loss
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = call(model, inputs, variant, **extra)
        loss = reference_loss(out.logits, batch, variant)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            loss = loss + model.config.router_aux_loss_coef * aux.double()
        return loss

    return _step(model, loss_of)


def patched_step(model, batch: dict, variant: str = "mean", **extra):
    """The same step of a patched ``model`` (patched with ``patch_options(variant)``): its own
    loss."""
    return _step(model, lambda: call(model, batch, variant, **extra).loss)
