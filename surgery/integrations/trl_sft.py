"""TRL's ``SFTTrainer`` trained on surgery's loss: ``loss_reduction="sequence"``, z-loss and
label smoothing under TRL.

``trl.SFTTrainer`` computes its loss itself, the token mean of the per-token log-probabilities its
fused head returns (surgery serves that head, ``surgery.integrations.trl``), so the patch's loss
options do not reach it. This subclass takes the loss from surgery's fused head instead: on a
patched model its ``compute_loss`` makes TRL's fused call with ``SFT_LOSS_KWARG``, and surgery's
forward returns, from one sweep over the logits, the loss the patched model computes given labels
(the patch's ``loss_reduction``, ``z_loss_scale`` and ``label_smoothing``, documents from the
batch's ``position_ids`` or ``cu_seq_lens_q``) and the statistics TRL logs (entropy, token
accuracy). Everything else is TRL's: the data, the collator, the training loop, the MoE
load-balancing loss (weighted as TRL weighs it), the metrics, plus ``z_loss`` where the z-loss is
on. With the patch's default options the loss is TRL's own token mean (tested trainer against
trainer). ``compute_loss(..., return_outputs=True)`` (evaluation with ``compute_metrics``) returns,
as TRL's does, the outputs of a second forward without the labels, whose logits the metrics read.

    from surgery.integrations.trl_sft import SFTTrainer

    surgery.patch(model, loss_reduction="sequence", z_loss_scale=1e-4)
    trainer = SFTTrainer(model=model, args=trl.SFTConfig(padding_free=True, ...), ...)

A model that is not patched, or whose head surgery does not serve (a TRL release surgery has not
checked, a LoRA adapter on the lm_head), trains as ``trl.SFTTrainer`` does when no loss option is
set, and raises otherwise. Settings that replace TRL's loss themselves (``compute_loss_func``,
``label_smoothing_factor``, ``loss_type`` other than ``"nll"``, DeepSpeed sequence parallelism)
cannot be combined with surgery's loss options: that raises too.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import trl

from surgery.api import patch_options
from surgery.integrations.trl import SFT_LOSS_KWARG, fused_head_request, loss_options_set
from surgery.patching.fallback import causal_lm_of

__all__ = ["SFTTrainer"]


class SFTTrainer(trl.SFTTrainer):
    """``trl.SFTTrainer`` whose loss, on a model patched by surgery, is surgery's (module
    docstring); every argument as ``trl.SFTTrainer`` takes it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        options = patch_options(self.model)
        changed = loss_options_set(options)
        if options is None or self._replaces_loss(changed) or not self._served(changed):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        inputs = {**inputs, "use_cache": False}
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        outputs = model(
            **inputs,
            fused_lm_head=True,
            num_items_in_batch=num_items_in_batch,
            **{SFT_LOSS_KWARG: True},
        )
        loss = outputs.loss
        # As TRL's loss: `num_items_in_batch` counts the tokens of every rank (a token mean over
        # them), and DDP averages the gradients over the ranks.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled and outputs.aux_loss is not None:
            # A per-micro-batch mean: with `num_items_in_batch` the Trainer leaves gradient
            # accumulation to the loss, so it is averaged over the accumulation steps here.
            steps = (
                self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            )
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        self._log_step(mode, inputs, outputs, z_loss=options.z_loss_scale > 0)
        if return_outputs:
            # Evaluation with compute_metrics (or preprocess_logits_for_metrics) reads the
            # outputs' logits, which the fused head never makes: as trl.SFTTrainer, from a
            # forward of their own, without the labels (TRL deprecates this path too).
            warnings.warn(
                "surgery's SFTTrainer: return_outputs=True costs a second forward for the logits "
                "(compute_metrics / preprocess_logits_for_metrics), as in trl.SFTTrainer",
                FutureWarning,
                stacklevel=2,
            )
            with torch.no_grad():
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        return (loss, outputs) if return_outputs else loss

    def _served(self, changed: list[str]) -> bool:
        """Whether surgery serves TRL's fused head on this model now (``fused_head_request``);
        raises if not while loss options are set (``changed``)."""
        lm = causal_lm_of(self.model)
        if lm is not None and fused_head_request(lm) is not None:
            return True
        if changed:
            raise RuntimeError(
                f"surgery: the model is patched with {', '.join(changed)}, but surgery does not "
                "serve TRL's fused head on it (a TRL release surgery has not checked, or an "
                "adapter on the lm_head), so TRL's own loss would train it without them"
            )
        return False

    def _replaces_loss(self, changed: list[str]) -> bool:
        """Whether a setting of TRL's replaces the loss itself: then TRL computes it, and surgery's
        loss options cannot apply (``changed``: those set; raises if any)."""
        own = []
        if self.compute_loss_func is not None:
            own.append("compute_loss_func")
        if self.label_smoother is not None:
            own.append("label_smoothing_factor")
        if self.args.loss_type != "nll":
            own.append(f"loss_type={self.args.loss_type!r}")
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if (
            parallelism is not None
            and parallelism.sp_enabled
            and parallelism.sp_backend == "deepspeed"
        ):
            own.append("DeepSpeed sequence parallelism")
        if own and changed:
            raise ValueError(
                f"surgery: the model is patched with {', '.join(changed)}, but the trainer's "
                f"{', '.join(own)} computes the loss itself: set one or the other"
            )
        return bool(own)

    def _log_step(self, mode: str, inputs: dict, outputs: Any, z_loss: bool) -> None:
        """The metrics ``trl.SFTTrainer`` logs for a step (entropy and token accuracy over the
        tokens with a target, tokens seen, the MoE aux loss), plus the z-loss term when on."""
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        valid = gather(outputs.label_mask.sum()).sum()
        for name, value in (
            ("entropy", outputs.entropy.sum()),
            ("mean_token_accuracy", outputs.is_top1.sum()),
        ):
            metrics[name].append(
                (gather(value.detach()).sum() / valid).item() if valid > 0 else 0.0
            )
        if z_loss:
            metrics["z_loss"].append(gather(outputs.z_loss.detach()).mean().item())
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = inputs["attention_mask"].sum()
            else:  # padding-free: one row of packed documents
                ids = inputs["position_ids"]
                tokens = ids.new_tensor(ids.size(-1))
            self._total_train_tokens += gather(tokens).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled and outputs.aux_loss is not None:
            metrics["aux_loss"].append(gather(outputs.aux_loss.detach()).mean().item())
