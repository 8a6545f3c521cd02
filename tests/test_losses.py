"""The RL math against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import losses, sequence


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


# ----------------------------------------------------------------------------------------- PPO
def test_kl_estimators_by_hand():
    logp, ref = t([-1.0]), t([-1.5])  # log ratio 0.5
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert losses.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert losses.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5, abs=1e-6)  # 0.106531
    assert losses.kl_penalty(t([-1.0]), t([-1.0]), "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        losses.kl_penalty(logp, ref, "k4")


def test_response_mask_and_last_token_for_early_stop_limit_and_empty():
    from rlhf.generation.rollout import response_mask

    response = t([[5, 2, 0, 0],   # stops early: eos at 1 (pads after it)
                  [5, 6, 7, 8],   # runs to the limit: no eos
                  [2, 0, 0, 0]],  # empty answer: eos first
                 torch.long)
    mask = response_mask(response, eos_id=2)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert losses.last_token_index(mask).tolist() == [1, 3, 0]


def test_reward_placement_by_hand():
    kl = t([[0.1, 0.2, 0.3], [0.1, 0.1, 0.1], [0.5, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rewards = losses.place_rewards(t([2.0, 7.0, 1.0]), kl, mask, kl_coef=0.5, clip=5.0)
    # Score on the last real token (eos, limit, or the lone eos of an empty answer), clipped to 5.
    expected = [[-0.05, -0.1 + 2.0, 0.0], [-0.05, -0.05, -0.05 + 5.0], [-0.25 + 1.0, 0.0, 0.0]]
    assert torch.allclose(rewards, t(expected), atol=1e-6)


def test_gae_by_hand():
    adv, ret = losses.gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=1.0, lam=0.95)
    # A2 = 1 - 0.7 = 0.3; A1 = (0.7 - 0.6) + 0.95 * 0.3 = 0.385; A0 = (0.6 - 0.5) + 0.95 * 0.385 = 0.46575
    assert torch.allclose(adv, t([[0.46575, 0.385, 0.3]]), atol=1e-6)
    assert torch.allclose(ret, t([[0.96575, 0.985, 1.0]]), atol=1e-6)


def test_gae_stops_at_the_end_of_the_answer():
    adv, _ = losses.gae(t([[0.0, 1.0, 9.0]]), t([[0.5, 0.6, 9.0]]), t([[1, 1, 0]]), gamma=1.0, lam=0.95)
    # The masked third token adds neither reward nor a bootstrap value: A1 = 1 - 0.6, A0 = 0.1 + 0.95 * 0.4.
    assert torch.allclose(adv, t([[0.48, 0.4, 0.0]]), atol=1e-6)


def test_gae_monte_carlo_with_discount():
    adv, _ = losses.gae(t([[0.0, 0.0, 1.0]]), t([[0.0, 0.0, 0.0]]), t([[1, 1, 1]]), gamma=0.9, lam=1.0)
    assert torch.allclose(adv, t([[0.81, 0.9, 1.0]]), atol=1e-6)


def test_clipped_surrogate_by_hand():
    loss, clipped = losses.clipped_surrogate(t([[0.0]]), t([[0.0]]), t([[2.0]]), 0.2)
    assert loss.item() == pytest.approx(-2.0) and not clipped.item()
    # ratio e^0.5 = 1.6487 with a positive advantage: clipped to 1.2.
    loss, clipped = losses.clipped_surrogate(t([[0.5]]), t([[0.0]]), t([[1.0]]), 0.2)
    assert loss.item() == pytest.approx(-1.2) and clipped.item()
    # The same ratio with a negative advantage: the unclipped (pessimistic) term wins.
    loss, clipped = losses.clipped_surrogate(t([[0.5]]), t([[0.0]]), t([[-1.0]]), 0.2)
    assert loss.item() == pytest.approx(math.exp(0.5), abs=1e-6) and not clipped.item()


def test_clip_higher_by_hand():
    """DAPO's clip-higher: ratio e^0.25 = 1.2840 with A = 1 is clipped at 1.2 by a symmetric 0.2, not by
    eps_high 0.28 (the upper bound 1.28 < 1.2840 still clips, at 1.28); ratio e^-0.5 = 0.6065 with
    A = -1 is clipped at the lower bound 0.8 either way (its term -A * 0.8 = 0.8 wins)."""
    loss, clipped = losses.clipped_surrogate(t([[0.25]]), t([[0.0]]), t([[1.0]]), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.28) and clipped.item()
    loss, clipped = losses.clipped_surrogate(t([[0.2]]), t([[0.0]]), t([[1.0]]), 0.2, 0.28)
    assert loss.item() == pytest.approx(-math.exp(0.2), abs=1e-6) and not clipped.item()  # 1.2214 < 1.28: kept
    loss, clipped = losses.clipped_surrogate(t([[-0.5]]), t([[0.0]]), t([[-1.0]]), 0.2, 0.28)
    assert loss.item() == pytest.approx(0.8) and clipped.item()


def test_gspo_is_the_sequence_level_objective_by_hand():
    """Answer log-ratios 0.1 and 0.3 (and a padded token): s = exp(0.2) = 1.2214. Inside a wide range
    each token's loss is -A s, and the token mean's gradient is the sequence objective's: d(-A s)/d
    logp_t = -A s / |y| per token. Clipped at 1 + 4e-4, nothing moves and every token counts as clipped."""
    old = t([[0.0, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    logp = t([[0.1, 0.3, 5.0]]).requires_grad_()
    loss, clipped = losses.gspo_surrogate(logp, old, t([[2.0, 2.0, 2.0]]), mask, 0.5, 0.5)
    assert loss[0, :2].tolist() == pytest.approx([-2 * math.exp(0.2)] * 2, abs=1e-6) and not clipped[0, :2].any()
    losses.masked_mean(loss, mask, dim=-1).sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2 * math.exp(0.2) / 2] * 2 + [0.0], abs=1e-6)
    logp.grad = None
    loss, clipped = losses.gspo_surrogate(logp, old, t([[2.0, 2.0, 2.0]]), mask, 3e-4, 4e-4)
    assert loss[0, 0].item() == pytest.approx(-2 * 1.0004, abs=1e-6) and clipped[0, :2].all()
    losses.masked_mean(loss, mask, dim=-1).sum().backward()
    assert logp.grad.abs().max().item() == 0.0


def test_cispo_keeps_every_token_s_gradient_with_a_clipped_detached_weight():
    """r = e^0.5 = 1.6487 with A = 1 and the cap 1.2: PPO would give no gradient; CISPO's loss is
    -1.2 * logp with gradient -1.2; r = e^-0.1 = 0.9048 within (0, 1.2]: weight r, gradient -0.9048."""
    logp = t([[0.5, -0.1]]).requires_grad_()
    loss, clipped = losses.cispo_surrogate(logp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), 1.0, 0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2 * 0.5, -math.exp(-0.1) * -0.1], abs=1e-6)
    assert clipped.tolist() == [[True, False]]
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.2, -math.exp(-0.1)], abs=1e-6)


def test_rollout_corrections_by_hand():
    """Trainer minus sampler log-probs 0.0, ln 3, ln 0.25 on one answer, ln 1.5 and a padded token on
    another. TIS caps at 2: 1, 2, 0.25 | 1.5. MIS drops an answer whose product exceeds 2: the first's
    is 3 * 0.25 = 0.75 (kept, 0.75 on every token), the second's 1.5 (kept). IcePop keeps tokens in
    [0.5, 2]: 1, 0 (3 > 2), 0 (0.25 < 0.5) | 1.5. A padded token weighs 0 and is never counted as changed."""
    old = t([[0.0, math.log(3), math.log(0.25)], [math.log(1.5), 0.0, 0.0]])
    sampler = torch.zeros(2, 3)
    mask = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w, changed = losses.rollout_correction(old, sampler, mask, "tis", 0.0, 2.0)
    assert w.tolist() == [pytest.approx([1.0, 2.0, 0.25]), pytest.approx([1.5, 0.0, 0.0])]
    assert changed.tolist() == [[False, True, False], [False, False, False]]
    w, changed = losses.rollout_correction(old, sampler, mask, "mis", 0.0, 2.0)
    assert w.tolist() == [pytest.approx([0.75] * 3), pytest.approx([1.5, 0.0, 0.0])] and not changed.any()
    w, _ = losses.rollout_correction(old, sampler, mask, "mis", 0.0, 1.2)  # 1.5 > 1.2: the second answer dropped
    assert w[1].tolist() == [0.0, 0.0, 0.0] and w[0].tolist() == pytest.approx([0.75] * 3)
    w, changed = losses.rollout_correction(old, sampler, mask, "icepop", 0.5, 2.0)
    assert w.tolist() == [pytest.approx([1.0, 0.0, 0.0]), pytest.approx([1.5, 0.0, 0.0])]
    assert changed.tolist() == [[False, True, True], [False, False, False]]
    # An answer sampled far from the trainer (a product of e^800) is dropped, not overflowed to nan.
    w, _ = losses.rollout_correction(t([[400.0, 400.0]]), torch.zeros(1, 2), torch.ones(1, 2), "mis", 0.0, 2.0)
    assert w.tolist() == [[0.0, 0.0]]


def test_dapo_soft_overlong_penalty_by_hand():
    """Budget 20, buffer 4: no penalty up to 16 tokens, then -(len - 16) / 4 * factor: 18 -> -0.5, 20 -> -1."""
    assert losses.overlong_penalty(t([10.0, 16.0, 18.0, 20.0]), 20, 4, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert losses.overlong_penalty(t([18.0]), 20, 4, 0.5).tolist() == [-0.25]


def test_dynamic_sampling_keeps_the_groups_with_a_signal_first():
    """Groups of 2: scores (1, 1) and (0, 1) in the first draw, (0, 0) and (1, 0) in the second: the
    groups with a signal are group 1 of each draw; a batch of 2 takes both, no fill; a batch of 3 fills
    with the first draw's group 0."""
    from rlhf.runners.ppo_experience import pick_groups, signal_groups

    signal = [signal_groups(t([1.0, 1.0, 0.0, 1.0]), 2), signal_groups(t([0.0, 0.0, 1.0, 0.0]), 2)]
    assert [s.tolist() for s in signal] == [[False, True], [False, True]]
    assert pick_groups(signal, 2) == ([[1], [1]], 0)
    assert pick_groups(signal, 3) == ([[0, 1], [1]], 1)


def test_clipped_value_error_by_hand():
    # Unclipped (1 - 2)^2 = 1; clipped value 0.2 gives (0.2 - 2)^2 = 3.24; 0.5 * max = 1.62.
    assert losses.clipped_value_error(t([[1.0]]), t([[0.0]]), t([[2.0]]), 0.2).item() == pytest.approx(1.62)


# Two answers of 1 and 3 tokens (budget 4): token losses [2, -, -, -] and [1, 2, 6, -].
AGG_X, AGG_MASK = t([[2.0, 9.0, 9.0, 9.0], [1.0, 2.0, 6.0, 9.0]]), t([[1, 0, 0, 0], [1, 1, 1, 0]])


@pytest.mark.parametrize("agg,expected", [
    ("token_mean", (2 + 1 + 2 + 6) / 4),  # every token alike: 11 / 4 tokens
    ("seq_mean_token_mean", (2 / 1 + 9 / 3) / 2),  # each answer's mean, then the mean of answers
    ("seq_mean_token_sum", (2 + 9) / 2),  # each answer's sum, then the mean of answers
    ("seq_mean_token_sum_norm", (2 / 4 + 9 / 4) / 2),  # each answer's sum over the budget of 4
])
def test_loss_aggregations_by_hand(agg, expected):
    count = losses.agg_count(AGG_MASK, agg)
    assert count.item() == (4 if agg == "token_mean" else 2)
    assert losses.aggregate(AGG_X, AGG_MASK, agg, count, 4).item() == pytest.approx(expected)
    # Split into two micro-batches of one answer each, both divided by the whole step's count: the
    # shares add up to the step's loss, whatever the split.
    shares = [losses.aggregate(AGG_X[i:i + 1], AGG_MASK[i:i + 1], agg, count, 4) for i in (0, 1)]
    assert sum(shares).item() == pytest.approx(expected)


def test_an_answer_left_out_of_the_loss_does_not_count():
    mask = AGG_MASK.clone()
    mask[1] = 0  # step.truncated_answers=mask
    assert losses.agg_count(mask, "seq_mean_token_mean").item() == 1
    assert losses.aggregate(AGG_X, mask, "seq_mean_token_mean", 1, 4).item() == pytest.approx(2.0)


def test_every_estimator_names_a_loss_aggregation_and_its_papers_choices():
    assert {n: e.loss_agg for n, e in losses.ESTIMATORS.items()} == {
        "gae": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
        "rloo": "seq_mean_token_sum", "reinforce_pp": "token_mean", "reinforce_pp_baseline": "token_mean"}


def test_early_eos_is_out_of_the_distribution_before_min_new_tokens():
    # Vocabulary of 3, eos = 2; logits 0 everywhere: 1/3 each, or 1/2 each where eos is forbidden.
    logits = torch.zeros(1, 3, 3)
    logp = losses.token_logprobs(losses.forbid_early_eos(logits, 2, 2), t([[0, 1, 0]], torch.long))
    assert torch.allclose(logp, t([[math.log(0.5), math.log(0.5), math.log(1 / 3)]]))
    assert losses.forbid_early_eos(logits, 2, 0) is logits


def test_token_logprobs_with_temperature():
    logits = t([[[0.0, math.log(3.0)]]])
    assert losses.token_logprobs(logits, t([[1]], torch.long)).item() == pytest.approx(math.log(0.75), abs=1e-6)
    p = math.sqrt(3) / (1 + math.sqrt(3))  # softmax of logits / 2
    assert losses.token_logprobs(logits, t([[1]], torch.long), 2.0).item() == pytest.approx(math.log(p), abs=1e-6)


def test_logprobs_and_entropy_share_one_log_softmax_and_the_entropy_has_a_graph_only_as_a_bonus():
    logits = t([[[0.0, math.log(3.0)]]]).requires_grad_()
    logp, entropy = losses.token_logprobs_and_entropy(logits, t([[1]], torch.long))
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    assert logp.requires_grad and not entropy.requires_grad
    p = math.sqrt(3) / (1 + math.sqrt(3))  # softmax of logits / 2
    logp, entropy = losses.token_logprobs_and_entropy(logits, t([[1]], torch.long), 2.0, entropy_grad=True)
    assert logp.item() == pytest.approx(math.log(p), abs=1e-6)
    assert entropy.item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), abs=1e-6)
    (-entropy).backward()  # descending on the bonus moves the larger logit down, the smaller up
    assert logits.grad[0, 0, 1] > 0 > logits.grad[0, 0, 0]


def test_entropy_and_its_gradient_are_finite_where_early_eos_is_forbidden():
    # Position 0 forbids eos (id 2, step.min_new_tokens=1): the distribution is softmax(0, log 3) over the
    # other two ids, entropy H(1/4, 3/4); position 1 is uniform over three ids, entropy log 3.
    logits = t([[[0.0, math.log(3.0), 5.0], [0.0, 0.0, 0.0]]]).requires_grad_()
    masked = losses.forbid_early_eos(logits, eos_id=2, min_new_tokens=1)
    logp, entropy = losses.token_logprobs_and_entropy(masked, t([[1, 2]], torch.long), entropy_grad=True)
    assert logp[0].tolist() == pytest.approx([math.log(0.75), math.log(1 / 3)], abs=1e-6)
    assert entropy[0].tolist() == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(3)],
                                                abs=1e-6)
    (-entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 2] == 0  # the forbidden logit has no say in the distribution
    assert logits.grad[0, 0, 1] > 0 > logits.grad[0, 0, 0]  # more entropy: the larger logit down
    _, measured = losses.token_logprobs_and_entropy(masked.detach(), t([[1, 2]], torch.long))
    assert torch.isfinite(measured).all()  # the logged entropy (entropy_coef=0) too


def test_whiten_group_advantages_and_masked_mean():
    assert torch.allclose(losses.masked_whiten(t([1.0, 2.0, 3.0, 100.0]), t([1, 1, 1, 0])),
                          t([-1.224745, 0.0, 1.224745, 0.0]), atol=1e-5)
    adv = losses.group_advantages(t([1.0, 0.0, 3.0, 3.0]), torch.ones(4, 2), group_size=2)
    assert torch.allclose(adv[:, 0], t([0.707107, -0.707107, 0.0, 0.0]), atol=1e-5)
    assert losses.masked_mean(t([1.0, 3.0, 100.0]), t([1, 1, 0])).item() == 2.0


def test_adaptive_kl_controller_by_hand():
    ctl = losses.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # error = clip(12 / 6 - 1, -0.2, 0.2) = 0.2; coefficient *= 1 + 0.2 * 1000 / 10000
    assert ctl.update(12.0, 1000) == pytest.approx(0.102)
    fixed = losses.AdaptiveKLController(0.1, target=None, horizon=10000)
    assert fixed.update(12.0, 1000) == 0.1


def test_running_moments_match_the_whole_sample():
    m = losses.RunningMoments()
    m.update(t([1.0, 2.0, 3.0]))
    m.update(t([4.0, 5.0]))
    assert m.mean == pytest.approx(3.0) and m.var == pytest.approx(2.0)
    assert m.normalize(t([3.0])).item() == pytest.approx(0.0)


def _two_ranks(other_half):
    """A reduce that adds what the other rank would contribute: tests the global-statistics path
    of whitening and reward moments without starting processes."""
    def reduce(stats):
        return stats + other_half(stats)
    return reduce


def test_whitening_over_ranks_equals_whitening_the_whole_batch():
    x, mask = t([[1.0, 2.0, 0.0], [3.0, 5.0, 8.0]]), t([[1, 1, 0], [1, 1, 1]])
    whole = losses.masked_whiten(x, mask)
    top = lambda _: losses_stats(x[1:], mask[1:])  # noqa: E731 - rank 1's statistics, seen from rank 0
    assert torch.allclose(losses.masked_whiten(x[:1], mask[:1], reduce=_two_ranks(top)), whole[:1], atol=1e-6)
    # Rank-local whitening (the defect) differs: the same row comes out centred on its own mean.
    assert not torch.allclose(losses.masked_whiten(x[:1], mask[:1]), whole[:1], atol=1e-3)


def losses_stats(x, mask):
    m = mask.double()
    return torch.stack([(x.double() * m).sum(), (x.double() ** 2 * m).sum(), m.sum()])


def test_running_moments_keep_their_statistics_on_the_scores_device():
    """Scores on another device than the host (a GPU; ``meta`` here): the statistics are stacked
    there, not with a host count (which failed on a GPU), and come back through the reduce."""
    m = losses.RunningMoments()
    seen = []

    def reduce(stats):  # as sum_over_ranks: the reduced numbers come back, from any device
        seen.append(stats.device)
        return torch.tensor([2.0, 4.0, 10.0], dtype=torch.float64)
    m.update(torch.empty(2, device="meta"), reduce=reduce)
    assert seen == [torch.device("meta")]
    assert m.mean == pytest.approx(2.0) and m.var == pytest.approx(1.0)


def test_running_moments_over_ranks_see_the_global_batch():
    local, other = t([1.0, 2.0, 3.0]), t([10.0, 20.0])
    m = losses.RunningMoments()
    m.update(local, reduce=_two_ranks(lambda _: torch.stack([torch.tensor(2.0, dtype=torch.float64),
                                                              other.double().sum(), (other.double() ** 2).sum()])))
    both = torch.cat([local, other])
    assert m.mean == pytest.approx(both.mean().item()) and m.var == pytest.approx(both.var(unbiased=False).item())


# --------------------------------------------------------------------- critic-free estimators
def _inputs(score, kl=None, mask=None, kl_coef=0.0, group=2, gamma=1.0, reduce=None):
    score = t(score)
    mask = t(mask) if mask is not None else torch.ones(len(score), 2)
    kl = t(kl) if kl is not None else torch.zeros_like(mask)
    return losses.AdvantageInputs(score=score, kl=kl, kl_coef=kl_coef, mask=mask, values=None, group_size=group,
                                  gamma=gamma, lam=0.95, whiten=True, reduce=reduce)


# Answers of lengths 3, 1, 2, 3 (a group of 4): length must not change a sequence-level advantage.
MIXED = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_group_whose_answers_all_scored_the_same_gets_zero_advantage(name):
    # The bug this replaced: whitening GRPO's advantages over the batch gave all-wrong groups +0.19.
    x = _inputs([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0], mask=MIXED + MIXED, group=4)
    adv, _ = losses.ESTIMATORS[name].fn(x)
    assert torch.equal(adv[:4], torch.zeros(4, 3))
    assert (adv[4:].abs().sum(-1) > 0).all()


def test_grpo_and_rloo_by_hand_with_mixed_lengths():
    x = _inputs([1.0, 0.0, 0.0, 1.0], mask=MIXED, group=4)
    # GRPO: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025 on every real token.
    adv, returns = losses.ESTIMATORS["grpo"].fn(x)
    assert returns is None
    assert torch.allclose(adv, t([[0.866025] * 3, [-0.866025, 0, 0], [-0.866025] * 2 + [0], [0.866025] * 3]),
                          atol=1e-5)
    # Dr. GRPO: the same without the std: +-0.5.
    adv, _ = losses.ESTIMATORS["dr_grpo"].fn(x)
    assert torch.allclose(adv, t([[0.5] * 3, [-0.5, 0, 0], [-0.5] * 2 + [0], [0.5] * 3]))
    # RLOO: 1 - (1 + 0 + 0) / 3 = 2/3 for the right answers, 0 - 2/3 for the wrong ones.
    adv, _ = losses.ESTIMATORS["rloo"].fn(x)
    assert torch.allclose(adv[:, 0], t([2 / 3, -2 / 3, -2 / 3, 2 / 3]), atol=1e-6)
    assert adv[1, 1:].abs().sum() == 0, "no advantage past the answer's end"


def test_sequence_methods_put_the_kl_into_the_reward_when_asked():
    # Equal scores; the first answer paid 1.0 of summed KL at coefficient 0.1: rewards 0.9 and 1.0,
    # mean 0.95, sample std 0.070711 -> -0.707107 and +0.707107.
    x = _inputs([1.0, 1.0], kl=[[0.5, 0.5], [0.0, 0.0]], kl_coef=0.1)
    adv, _ = losses.ESTIMATORS["grpo"].fn(x)
    assert torch.allclose(adv[:, 0], t([-0.707107, 0.707107]), atol=1e-4)
    # In the loss instead (coefficient 0 here), the same groups carry no signal.
    assert torch.equal(losses.ESTIMATORS["grpo"].fn(_inputs([1.0, 1.0], kl=[[0.5, 0.5], [0, 0]]))[0], torch.zeros(2, 2))


def test_discounted_returns_and_reinforce_pp_by_hand():
    # G = r_t + gamma G_{t+1}: [1 + 0.5 * 2, 2, 0] (the third token is past the end).
    assert torch.equal(losses.discounted_returns(t([[1.0, 2.0, 3.0]]), t([[1, 1, 0]]), 0.5), t([[2.0, 2.0, 0.0]]))
    # REINFORCE++: returns [[1, 1], [0, 0]] (score on the last token, gamma 1), whitened over the
    # batch's 4 tokens: mean 0.5, std 0.5.
    adv, _ = losses.ESTIMATORS["reinforce_pp"].fn(_inputs([1.0, 0.0]))
    assert torch.allclose(adv, t([[1.0, 1.0], [-1.0, -1.0]]), atol=1e-4)
    # Per-token KL in the reward: the first token's return also pays the second token's KL.
    x = _inputs([1.0, 1.0], kl=[[1.0, 2.0], [0.0, 0.0]], kl_coef=0.1)
    returns = losses.discounted_returns(losses.place_rewards(x.score, x.kl, x.mask, 0.1, None), x.mask, 1.0)
    assert torch.allclose(returns, t([[0.7, 0.8], [1.0, 1.0]]), atol=1e-6)


def test_reinforce_pp_baseline_centres_on_the_group_then_normalizes_over_the_batch_by_hand():
    # Scores [1, 0 | 1, 1] in groups of 2, answers of 2, 1, 1 and 2 tokens. Group means 0.5 and 1:
    # centered [0.5, -0.5 | 0, 0]; returns to go [[0.5, 0.5], [-0.5, -], [0, -], [0, 0]]. Over the batch's
    # 6 tokens: mean 0.5 / 6 = 1/12, variance 0.75 / 6 - 1/144 = 0.118056, std 0.343592 ->
    # (0.5 - 1/12) / std = 1.212678, (-0.5 - 1/12) / std = -1.697749, (0 - 1/12) / std = -0.242536.
    x = _inputs([1.0, 0.0, 1.0, 1.0], mask=[[1, 1], [1, 0], [1, 0], [1, 1]])
    adv, returns = losses.ESTIMATORS["reinforce_pp_baseline"].fn(x)
    assert returns is None
    assert torch.allclose(adv, t([[1.212678, 1.212678], [-1.697749, 0.0], [-0.242536, 0.0], [-0.242536, -0.242536]]),
                          atol=1e-5)
    assert losses.masked_mean(adv, x.mask).item() == pytest.approx(0.0, abs=1e-6)  # re-centred over the batch


def test_reinforce_pp_normalizes_over_every_rank():
    # Two ranks each holding one answer must whiten as one batch of two: the reduce sums both.
    other = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64)  # the other rank: sum 0, sum sq 0, 2 tokens
    adv, _ = losses.ESTIMATORS["reinforce_pp"].fn(_inputs([1.0], reduce=lambda s: s + other))
    assert torch.allclose(adv, t([[1.0, 1.0]]), atol=1e-4)


def test_every_estimator_declares_its_papers_defaults():
    for name, est in losses.ESTIMATORS.items():
        assert est.kl_in in losses.KL_PLACES and est.kl_estimator in losses.KL_ESTIMATORS, name
    assert [n for n, e in losses.ESTIMATORS.items() if e.needs_critic] == ["gae"]


# ----------------------------------------------------------------------------------------- DPO
def test_dpo_losses_by_hand():
    zero, ten = t([0.0]), t([10.0])
    # margin 0: every logistic loss is log 2, label smoothing or not.
    assert losses.dpo_sigmoid(zero, 0.1, 0.0).item() == pytest.approx(math.log(2), abs=1e-6)
    assert losses.dpo_sigmoid(zero, 0.1, 0.1).item() == pytest.approx(math.log(2), abs=1e-6)
    # margin 10, beta 0.1: z = 1; -log sigmoid(1) = 0.313262, -log sigmoid(-1) = 1.313262.
    assert losses.dpo_sigmoid(ten, 0.1, 0.0).item() == pytest.approx(0.313262, abs=1e-5)
    assert losses.dpo_sigmoid(ten, 0.1, 0.1).item() == pytest.approx(0.9 * 0.313262 + 0.1 * 1.313262, abs=1e-5)
    assert losses.dpo_robust(ten, 0.1, 0.1).item() == pytest.approx((0.9 * 0.313262 - 0.1 * 1.313262) / 0.8, abs=1e-5)
    # IPO: (10 - 1 / 0.2)^2 = 25.
    assert losses.dpo_ipo(ten, 0.1, 0.0).item() == pytest.approx(25.0)
    assert losses.dpo_margin(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.5])).item() == pytest.approx(1.5)


def test_simpo_by_hand():
    """Chosen: log-prob -4 over 2 tokens; rejected: -9 over 3; beta 2: rewards 2 * -2 = -4 and 2 * -3 = -6.
    Margin 2 minus gamma 1 = 1: -log sigmoid(1) = 0.313262. Longer answers are not favoured: the same
    per-token log-prob gives the same reward at any length."""
    loss, chosen, rejected = losses.simpo(t([-4.0]), t([-9.0]), t([2.0]), t([3.0]), beta=2.0, gamma=1.0)
    assert chosen.item() == -4.0 and rejected.item() == -6.0
    assert loss.item() == pytest.approx(0.313262, abs=1e-5)
    # gamma = the margin: the loss is log 2, where DPO's margin 0 puts it.
    assert losses.simpo(t([-4.0]), t([-9.0]), t([2.0]), t([3.0]), 2.0, 2.0)[0].item() == pytest.approx(math.log(2))
    assert losses.simpo(t([-2.0]), t([-20.0]), t([2.0]), t([20.0]), 2.0, 0.0)[0].item() == pytest.approx(math.log(2))


def test_orpo_by_hand():
    """Chosen: log-prob 2 log 0.5 over 2 tokens, p = 0.5, odds 1 (log odds 0); rejected: 3 log 0.2 over 3
    tokens, p = 0.2, odds 0.25. Log odds ratio log 4: -log sigmoid(log 4) = log(1 + 1/4) = log 1.25.
    With lambda 0.1: the chosen NLL per token log 2 + 0.1 log 1.25 = 0.715461; rewards 0.1 log p."""
    loss, chosen, rejected = losses.orpo(t([2 * math.log(0.5)]), t([3 * math.log(0.2)]), t([2.0]), t([3.0]), lam=0.1)
    assert loss.item() == pytest.approx(math.log(2) + 0.1 * math.log(1.25), abs=1e-6)
    assert loss.item() == pytest.approx(0.715461, abs=1e-6)
    assert chosen.item() == pytest.approx(0.1 * math.log(0.5)) and rejected.item() == pytest.approx(0.1 * math.log(0.2))
    # lambda 0: SFT's loss alone; equal per-token probabilities: the odds term is log 2.
    assert losses.orpo(t([-2.0]), t([-4.0]), t([2.0]), t([2.0]), 0.0)[0].item() == pytest.approx(1.0)
    same = losses.orpo(t([-2.0]), t([-4.0]), t([2.0]), t([4.0]), 1.0)[0].item()
    assert same == pytest.approx(1.0 + math.log(2), abs=1e-6)
    # Near p = 1 the log odds stay finite (p capped just below 1), and the gradient too.
    x = t([-1e-9, -0.5, -3.0]).requires_grad_()
    assert torch.isfinite(losses.log_odds(x)).all()
    assert losses.log_odds(x)[2].item() == pytest.approx(math.log(math.exp(-3) / (1 - math.exp(-3))), abs=1e-6)
    losses.log_odds(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_kto_by_hand():
    """Mismatched log-ratios 0.5 and 1.5: z0 = 1. Desirable r = 2, beta 1: 1 - sigmoid(1) = 0.268941;
    undesirable r = -1: 1 - sigmoid(1 - (-1)) = 1 - sigmoid(2) = 0.119203. Weights scale each kind."""
    z0 = losses.kto_reference_point(t([0.5, 1.5]))
    assert z0.item() == pytest.approx(1.0)
    per_row = losses.kto(t([2.0, -1.0]), t([1.0, 0.0]), z0, 1.0, 1.0, 1.0)
    assert per_row.tolist() == pytest.approx([0.268941, 0.119203], abs=1e-6)
    assert losses.kto(t([2.0, -1.0]), t([1.0, 0.0]), z0, 1.0, 2.0, 0.5).tolist() == \
        pytest.approx([2 * 0.268941, 0.5 * 0.119203], abs=1e-6)
    # A negative KL estimate is clamped to 0, and z0 carries no gradient (it is not trained).
    assert losses.kto_reference_point(t([-2.0, 1.0])).item() == 0.0
    mismatched = t([0.5, 1.5]).requires_grad_()
    assert not losses.kto_reference_point(mismatched).requires_grad
    # At the start policy = reference: every r and z0 are 0, each row's loss 1 - sigmoid(0) = 0.5, ties.
    batch = losses.PreferenceBatch(t([-3.0, -4.0, -5.0, -6.0]), t([2, 2, 2, 2]), t([-3.0, -4.0, -5.0, -6.0]),
                                   t([1.0, 0.0]))
    step = type("Step", (), {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0})
    r = losses.kto_step(batch, step)
    assert r.loss.item() == pytest.approx(0.5) and r.right.tolist() == [0.5, 0.5]
    assert r.chosen.tolist() == [0.0] and r.rejected.tolist() == [0.0]
    # The chosen answers' log-probs are the desirable rows' own (-3), not a mean with the undesirable (-4).
    assert r.chosen_logp.tolist() == [-3.0]


def _kto_z0_on_rank(rank: int, init: str, shares: list, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=len(shares))
    try:
        z0 = losses.kto_reference_point(torch.tensor(shares[rank]))
        torch.save(z0, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_kto_reference_point_is_the_mean_over_every_ranks_partners(tmp_path):
    """Two gloo ranks with 1 and 3 partners: both get z0 = the mean of all 4 log-ratios (2.5), not their
    own shares' means (1 and 3) nor the mean of the two means (2)."""
    import torch.multiprocessing as mp

    shares, out = [[1.0], [2.0, 3.0, 4.0]], str(tmp_path / "z0")
    mp.spawn(_kto_z0_on_rank, args=(f"file://{tmp_path / 'store'}", shares, out), nprocs=2, join=True)
    assert [torch.load(f"{out}.{r}").item() for r in range(2)] == pytest.approx([2.5, 2.5])


def test_sequence_logprob_sums_the_answer_tokens_only():
    logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens: each token costs log 4
    ids, answer = t([[1, 2, 3]], torch.long), t([[0, 1, 1]])
    next_logp = losses.token_logprobs(logits, sequence.next_tokens(ids))  # the next token's; the last predicts none
    assert losses.sequence_logprob(next_logp, answer).item() == pytest.approx(-2 * math.log(4), abs=1e-6)
    next_logp = torch.tensor([[-1.0, -2.0, -4.0]])
    assert losses.sequence_logprob(next_logp, answer).item() == -3.0  # tokens 1 and 2, predicted at 0 and 1


def test_log_probs_and_entropy_in_row_chunks_equal_one_pass_over_the_whole_tensor(monkeypatch):
    """On CPU the vocabulary-wide passes run a few rows at a time (LOGPROB_CHUNK_BYTES): values and
    gradients must be those of one pass over the whole [batch, time, vocabulary] tensor, with a
    forbidden eos in some rows and a chunk size that does not divide the rows."""
    torch.manual_seed(0)
    logits = losses.forbid_early_eos(torch.randn(3, 5, 11) * 3, eos_id=4, min_new_tokens=2).detach()
    tokens = torch.randint(0, 11, (3, 5))
    tokens[:, :2] = 0  # a forbidden eos is never a drawn token

    def whole(x, temperature):
        logp = torch.log_softmax(x.float() / temperature, -1)
        safe = torch.where(torch.isneginf(logp), 0.0, logp)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * safe).sum(-1)

    for chunk_rows in (1, 4, 100):  # one row, a chunk size that leaves a remainder, one chunk
        monkeypatch.setattr(losses.tokens, "LOGPROB_CHUNK_BYTES", 4 * 11 * chunk_rows)
        for temperature, sliced in ((1.0, False), (0.7, False), (0.7, True)):
            # sliced: logits[:, :-1] of a longer sequence, as DPO's log-probs take them (not contiguous)
            a, b = (torch.cat([logits, logits[:, :1]], 1).requires_grad_() if sliced else
                    logits.clone().requires_grad_() for _ in range(2))
            x, y = (a[:, :-1], b[:, :-1]) if sliced else (a, b)
            lp, ent = losses.token_logprobs_and_entropy(x, tokens, temperature, entropy_grad=True)
            lp_ref, ent_ref = whole(y, temperature)
            assert torch.allclose(lp, lp_ref, atol=1e-6) and torch.allclose(ent, ent_ref, atol=1e-5)
            assert torch.allclose(losses.token_logprobs(x, tokens, temperature), lp_ref, atol=1e-6)
            (lp.sum() + 0.3 * ent.sum()).backward()
            (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
            assert torch.isfinite(a.grad).all() and torch.allclose(a.grad, b.grad, atol=1e-6)
