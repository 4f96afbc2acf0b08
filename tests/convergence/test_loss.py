"""The reference side's loss against the kernels' fp32 reference, and packing equivalence."""

from __future__ import annotations

import pytest
import torch

from surgery.convergence.data import collate_packed, collate_padded, make_batches
from surgery.convergence.loss import causal_lm_loss
from surgery.kernels import cross_entropy_reference

VOCAB = 509


def _logits_pair(docs):
    """Random logits for a packed row and the same logits laid out padded."""
    padded, packed = collate_padded(docs), collate_packed(docs)
    flat = torch.randn(1, packed["input_ids"].shape[1], VOCAB, dtype=torch.float64) * 3
    grid = torch.randn(*padded["input_ids"].shape, VOCAB, dtype=torch.float64) * 3
    grid[padded["attention_mask"].bool()] = flat[0]
    return padded, packed, grid, flat


@pytest.mark.parametrize("reduction", ["mean", "sequence"])
@pytest.mark.parametrize("z_loss_scale", [0.0, 1e-2], ids=["z0", "z1e-2"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["ls0", "ls0.1"])
def test_matches_kernel_reference_and_packing(reduction, z_loss_scale, label_smoothing):
    train, _ = make_batches("tiny", 1, seed=5)
    padded, packed, grid, flat = _logits_pair(train[0])
    opts = dict(reduction=reduction, z_loss_scale=z_loss_scale, label_smoothing=label_smoothing)
    mine_padded = causal_lm_loss(grid, padded["labels"], **opts)
    mine_packed = causal_lm_loss(
        flat, packed["labels"], position_ids=packed["position_ids"], **opts
    )
    theirs = cross_entropy_reference(
        flat, packed["labels"], position_ids=packed["position_ids"], shift=True, **opts
    )
    # Both compute in fp32 from the (fp64) logits, summing in different orders.
    for mine in (mine_padded, mine_packed):
        torch.testing.assert_close(mine[0], theirs.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine[1], theirs.z_loss, rtol=1e-6, atol=1e-6)


def test_sequence_and_mean_differ_on_unequal_lengths():
    train, _ = make_batches("tiny", 1, seed=6)
    padded, _, grid, _ = _logits_pair(train[0])
    mean, _ = causal_lm_loss(grid, padded["labels"], reduction="mean")
    seq, _ = causal_lm_loss(grid, padded["labels"], reduction="sequence")
    assert abs(float(mean) - float(seq)) > 1e-6


def test_all_ignored_gives_zero_and_unknown_reduction_raises():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.full((2, 5), -100)
    for reduction in ("mean", "sequence"):
        loss, z = causal_lm_loss(logits, labels, reduction=reduction, z_loss_scale=1.0)
        loss.backward()
        assert loss.item() == 0.0 and z.item() == 0.0
        assert torch.isfinite(logits.grad).all() and not logits.grad.any()
    with pytest.raises(ValueError, match="unknown reduction"):
        causal_lm_loss(logits, labels, reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "sequence"])
def test_packed_boundaries_are_never_targets_and_shift_labels_take_precedence(reduction):
    """A packed row whose documents' first labels are real tokens (not -100) trains exactly the
    padded documents: the last token of a document has no target. ``shift_labels`` replace the
    shift of ``labels`` (here: labels are the raw input ids, the masking lives in shift_labels)."""
    train, _ = make_batches("tiny", 1, seed=7)
    padded, packed, grid, flat = _logits_pair(train[0])
    unmasked = packed["labels"].clone()
    starts = packed["position_ids"] == 0
    unmasked[starts] = packed["input_ids"][starts]
    assert (unmasked != packed["labels"]).sum() == len(train[0])
    want = causal_lm_loss(grid, padded["labels"], reduction=reduction, z_loss_scale=1e-2)
    got = causal_lm_loss(flat, unmasked, position_ids=packed["position_ids"],
                         reduction=reduction, z_loss_scale=1e-2)  # fmt: skip
    leaked = causal_lm_loss(flat, unmasked, reduction="mean")
    shifted = torch.nn.functional.pad(padded["labels"][:, 1:], (0, 1), value=-100)
    via_shift = causal_lm_loss(grid, padded["input_ids"], shift_labels=shifted,
                               reduction=reduction, z_loss_scale=1e-2)  # fmt: skip
    for mine in (got, via_shift):
        torch.testing.assert_close(mine[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine[1], want[1], rtol=1e-6, atol=1e-6)
    assert abs(float(leaked[0]) - float(causal_lm_loss(flat, packed["labels"])[0])) > 1e-3
