"""The generic causal-LM forward: what it hands the lm_head, against unpatched transformers.

``logits_to_keep`` keeps transformers' meaning in every form transformers accepts: an int (0:
every position, k: the last k), a 1-D tensor of positions kept in every row, a 2-D integer tensor
of positions per row and a 2-D boolean mask (the kept positions of all rows, flattened). The
slicing is transformers' own ``slice_logits_to_keep``, where the installed release has it. The
short rows end in pad positions whose sliding window (Mistral, Qwen 2 and 3, Gemma 3) holds only
padding: query rows that attend to no key, whose logits match too (see
``surgery.attention.forward``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers.modeling_utils as modeling_utils

import surgery
from surgery.forwards import causal_lm as surgery_forward
from tests.models.tiny import (
    ARCHS,
    loss_and_grads,
    padded_batch,
    sequences,
    tiny_model,
    twin,
)
from tests.utils import FP32_CLOSE as TOL

LENGTHS = [9, 6, 3]
# Releases before transformers' helper (5.17 among them) index the sequence dimension with any
# tensor: a 2-D one has no per-row meaning there.
HAS_HELPER = hasattr(modeling_utils, "slice_logits_to_keep")


def _keeps() -> dict[str, int | torch.Tensor]:
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, [0, 8]] = mask[1, 3] = mask[2, [1, 2, 5]] = True  # 2, 1 and 3 positions
    return {
        "int-0": 0,
        "int-3": 3,
        "1d": torch.tensor([0, 4, 8]),
        "2d-positions": torch.tensor([[8, 0], [5, 5], [2, 7]]),
        "2d-mask": mask,
    }


KEEPS = _keeps()


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("keep", list(KEEPS))
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_to_keep_as_transformers(arch, keep, mode):
    """Patched against unpatched logits, with no labels: in eval (no gradients) and in training
    (the logits path, gradients on)."""
    if keep.startswith("2d") and not HAS_HELPER:
        pytest.skip("this transformers release gives a 2-D logits_to_keep no per-row meaning")
    model = tiny_model(arch).train(mode == "train")
    reference = twin(model)
    surgery.patch(model)
    batch = padded_batch(sequences(LENGTHS)).kwargs()
    del batch["labels"]
    with torch.set_grad_enabled(mode == "train"):
        got = model(**batch, logits_to_keep=KEEPS[keep]).logits
        want = reference(**batch, logits_to_keep=KEEPS[keep]).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.skipif(not HAS_HELPER, reason="this transformers release has no helper")
def test_slice_is_transformers_own():
    assert surgery_forward.slice_logits_to_keep is modeling_utils.slice_logits_to_keep


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_loss_skip_ignored_trains_as_transformers_on_the_labelled_tokens_only(arch, monkeypatch):
    """``loss_skip_ignored`` (the default): a padded SFT batch whose prompts are masked gives
    transformers' loss and every gradient (fp32), and the loss's logits products run over the
    labelled tokens only (those whose next-token label is not -100)."""
    lce = importlib.import_module("surgery.kernels.linear_cross_entropy.ops")
    rows, logits = [], lce._logits
    monkeypatch.setattr(lce, "_logits", lambda x, w, b: rows.append(x.shape[0]) or logits(x, w, b))
    batch = padded_batch(sequences(LENGTHS))
    batch.labels[:, :4] = -100  # the prompts
    model = tiny_model(arch).train()
    reference = twin(model)
    surgery.patch(model)
    loss, grads = loss_and_grads(model, **batch.kwargs())
    want, want_grads = loss_and_grads(reference, **batch.kwargs())
    torch.testing.assert_close(loss, want, **TOL)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    labelled = int((batch.labels[:, 1:] != -100).sum())
    assert rows == [labelled]
