"""A pure-PyTorch imitation of ``surgery.patch``, with switchable bugs: the negative controls that
show the convergence checks catch what they claim to catch. Never the patched side of a real run."""

from __future__ import annotations

import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from surgery.convergence.loss import causal_lm_loss


def fake_patch(bug: str | None = None):
    """A ``patch`` callable. ``bug``: None (correct), "no_boundaries" (packed rows are one
    sequence), "z_loss_not_trained" (z-loss returned but its gradient dropped), "logits" (the
    training forward returns logits), "grad_scale" (the right loss, gradients 1% too large)."""

    def patch(model, loss_reduction="mean", z_loss_scale=0.0, label_smoothing=0.0, **_):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                    **kwargs):  # fmt: skip
            hidden = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state  # fmt: skip
            logits = self.lm_head(hidden)
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap is not None:
                logits = cap * torch.tanh(logits / cap)
            if labels is None:
                return CausalLMOutputWithPast(logits=logits)
            pos = None if bug == "no_boundaries" else position_ids
            loss, z = causal_lm_loss(
                logits, labels, reduction=loss_reduction, z_loss_scale=z_loss_scale,
                label_smoothing=label_smoothing, position_ids=pos,
            )  # fmt: skip
            if bug == "z_loss_not_trained":
                loss = loss - z + z.detach()
            if bug == "grad_scale":
                loss = loss + 0.01 * (loss - loss.detach())
            out = CausalLMOutputWithPast(
                loss=loss, logits=logits if (bug == "logits" or not self.training) else None
            )
            out["z_loss"] = z.detach()
            return out

        model.forward = types.MethodType(forward, model)
        return model

    return patch
