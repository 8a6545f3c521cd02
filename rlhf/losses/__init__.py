"""Pure RL math: no modules, no engines, no config -- tensors in, tensors out, one file per family:
reward-model losses (reward.py), preference methods (preference.py), per-token math (tokens.py),
advantage estimators (advantages.py), policy and value losses and their aggregation (policy.py).
Each function is tested against hand-worked numbers in tests/test_losses.py.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

from rlhf.losses.advantages import (
    ESTIMATORS,
    AdvantageInputs,
    Estimator,
    discounted_returns,
    dr_grpo_estimator,
    gae,
    gae_estimator,
    group_advantages,
    group_centered,
    grpo_estimator,
    last_token_index,
    leave_one_out_advantages,
    place_rewards,
    reinforce_pp_baseline_estimator,
    reinforce_pp_estimator,
    rloo_estimator,
)
from rlhf.losses.policy import (
    KL_PLACES,
    LOSS_AGGS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    AdaptiveKLController,
    LossAgg,
    PolicyLoss,
    RunningMoments,
    agg_count,
    aggregate,
    cispo_surrogate,
    clipped_surrogate,
    clipped_value_error,
    gspo_surrogate,
    overlong_penalty,
    rollout_correction,
)
from rlhf.losses.preference import (
    DPO_LOSSES,
    PREFERENCE_LOSSES,
    PreferenceBatch,
    PreferenceResult,
    answer_nll,
    dpo_ipo,
    dpo_margin,
    dpo_robust,
    dpo_sigmoid,
    dpo_step,
    halves,
    kto,
    kto_reference_point,
    kto_step,
    log_odds,
    orpo,
    orpo_step,
    sequence_logprob,
    simpo,
    simpo_step,
)
from rlhf.losses.reward import (
    auc,
    divergence_mask,
    end_indices,
    gather_at,
    pairwise_accuracy,
    pairwise_loss,
    pairwise_loss_divergence,
    score_regularizer,
)
from rlhf.losses.tokens import (
    KL_ESTIMATORS,
    LOGPROB_CHUNK_BYTES,
    forbid_early_eos,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    masked_mean,
    masked_whiten,
    token_logprobs,
    token_logprobs_and_entropy,
)

__all__ = [
    "AdaptiveKLController", "AdvantageInputs", "DPO_LOSSES", "ESTIMATORS", "Estimator", "KL_ESTIMATORS",
    "KL_PLACES", "LOGPROB_CHUNK_BYTES", "LOSS_AGGS", "LossAgg", "POLICY_LOSSES", "PREFERENCE_LOSSES",
    "PolicyLoss", "PreferenceBatch", "PreferenceResult", "ROLLOUT_CORRECTIONS", "RunningMoments",
    "agg_count", "aggregate", "answer_nll", "auc", "cispo_surrogate", "clipped_surrogate",
    "clipped_value_error", "discounted_returns", "divergence_mask", "dpo_ipo", "dpo_margin", "dpo_robust",
    "dpo_sigmoid", "dpo_step", "dr_grpo_estimator", "end_indices", "forbid_early_eos", "gae",
    "gae_estimator", "gather_at", "group_advantages", "group_centered", "grpo_estimator", "gspo_surrogate",
    "halves", "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "kto", "kto_reference_point", "kto_step",
    "last_token_index", "leave_one_out_advantages", "log_odds", "masked_mean", "masked_whiten", "orpo",
    "orpo_step", "overlong_penalty", "pairwise_accuracy", "pairwise_loss", "pairwise_loss_divergence",
    "place_rewards", "reinforce_pp_baseline_estimator", "reinforce_pp_estimator", "rloo_estimator",
    "rollout_correction", "score_regularizer", "sequence_logprob", "simpo", "simpo_step", "token_logprobs",
    "token_logprobs_and_entropy",
]
