"""The RL math against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import losses


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


@pytest.mark.parametrize("mask,expected", [
    ([[1, 1, 1, 0, 0]], [2]),          # right padding
    ([[0, 0, 1, 1, 1]], [4]),          # left padding
    ([[1, 1, 1, 1, 1]], [4]),          # no padding at all (LLaMA ships no pad token)
    ([[1, 1, 0, 0], [0, 1, 1, 0]], [1, 2]),
])
def test_end_indices_from_the_mask(mask, expected):
    assert losses.end_indices(t(mask, torch.long)).tolist() == expected


def test_end_index_is_right_when_pad_equals_eos():
    # OPT-style ids where the real eos (2) and the padding (2) are the same id: searching for the
    # pad id, as DeepSpeed-Chat did, would stop at index 2 and score the token before the eos.
    ids = t([[0, 9, 8, 2, 2, 2]], torch.long)
    mask = t([[1, 1, 1, 1, 0, 0]], torch.long)
    first_pad = (ids[0] == 2).nonzero()[0].item()
    assert first_pad == 3 and losses.end_indices(mask).item() == 3
    ids_bos_eos_pad_same = t([[2, 9, 2, 2]], torch.long)  # bos == eos == pad
    assert (ids_bos_eos_pad_same[0] == 2).nonzero()[0].item() == 0  # the naive search fails outright
    assert losses.end_indices(t([[1, 1, 1, 0]], torch.long)).item() == 2


def test_gather_at():
    assert losses.gather_at(t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), t([2, 0], torch.long)).tolist() == [3.0, 4.0]


def test_pairwise_loss_by_hand():
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147; mean 0.410038
    assert losses.pairwise_loss(t([2.0, 0.0]), t([0.0, 0.0])).item() == pytest.approx(0.410038, abs=1e-6)


def test_pairwise_loss_is_stable_for_huge_margins():
    assert losses.pairwise_loss(t([1000.0]), t([-1000.0])).item() == pytest.approx(0.0, abs=1e-6)
    assert losses.pairwise_loss(t([-1000.0]), t([1000.0])).item() == pytest.approx(2000.0)


def test_divergence_mask_by_hand():
    chosen = t([[1, 5, 6, 7, 2, 0]], torch.long)
    rejected = t([[1, 5, 8, 2, 0, 0]], torch.long)
    cmask = t([[1, 1, 1, 1, 1, 0]], torch.long)
    rmask = t([[1, 1, 1, 1, 0, 0]], torch.long)
    # First difference at 2; ends at 4 (chosen) and 3 (rejected): positions 2..4.
    assert losses.divergence_mask(chosen, rejected, cmask, rmask).long().tolist() == [[0, 0, 1, 1, 1, 0]]


def test_divergence_mask_when_one_answer_extends_the_other():
    chosen = t([[1, 5, 6, 2]], torch.long)
    rejected = t([[1, 5, 6, 0]], torch.long)  # rejected stops one token earlier (its pad id is 0)
    mask = losses.divergence_mask(chosen, rejected, t([[1, 1, 1, 1]], torch.long), t([[1, 1, 1, 0]], torch.long))
    assert mask.long().tolist() == [[0, 0, 0, 1]]


def test_pairwise_loss_divergence_by_hand():
    chosen = t([[9.0, 9.0, 1.0, 2.0, 3.0, 9.0]])
    rejected = t([[9.0, 9.0, 0.0, 0.0, 0.0, -9.0]])
    mask = t([[0, 0, 1, 1, 1, 0]]).bool()
    # mean(-log sigmoid(1), -log sigmoid(2), -log sigmoid(3)) = mean(0.313262, 0.126928, 0.048587)
    assert losses.pairwise_loss_divergence(chosen, rejected, mask).item() == pytest.approx(0.162926, abs=1e-6)


def test_score_regularizer_by_hand():
    assert losses.score_regularizer(t([1.0, 2.0]), t([0.0, -1.0])).item() == pytest.approx(3.0)


def test_pairwise_accuracy_and_auc_by_hand():
    assert losses.pairwise_accuracy(t([1.0, 0.0, 2.0]), t([0.0, 1.0, 1.0])).item() == pytest.approx(2 / 3)
    assert losses.auc(t([0.9, 0.8, 0.3, 0.1]), t([1, 0, 1, 0])) == pytest.approx(0.75)
    assert losses.auc(t([0.5, 0.5]), t([1, 0])) == 0.5
    assert math.isnan(losses.auc(t([0.5, 0.4]), t([1, 1])))
