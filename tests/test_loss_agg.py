"""PPO's loss is aggregated over the whole optimizer step, whatever its split: the gradients of one
rollout batch of 8 answers (mixed lengths, two cut at the budget) are the same as micro 8 x
accumulation 1, micro 4 x accumulation 2, and 2 ranks x micro 4, for every advantage estimator and
every step.loss_agg, and for GSPO, CISPO, clip-higher and each rollout correction (fp32, real
DeepSpeed engines, the runner's own ppo_update).

    .venv/bin/python -m pytest -q tests/test_loss_agg.py
"""

from __future__ import annotations

from rlhf import losses
from tests.conftest import ROOT, one_and_two_ranks
from tests.loss_agg_worker import VARIANTS

WORKER = ROOT / "tests" / "loss_agg_worker.py"


def test_gradients_do_not_depend_on_micro_batches_accumulation_or_ranks(tmp_path):
    single, ranks = one_and_two_ranks(WORKER, tmp_path)
    found = {**single, **ranks}
    reference = found.pop("micro8x1")
    expected = {f"{e}/{a}/actor" for e in losses.ESTIMATORS for a in losses.LOSS_AGGS} | \
        {f"{e}/{a}/critic" for e, est in losses.ESTIMATORS.items() if est.needs_critic for a in losses.LOSS_AGGS} | \
        {f"{v}/actor" for v in VARIANTS}
    assert set(reference) == expected
    for split, grads in found.items():
        assert set(grads) == expected, split
        for key, want in reference.items():
            diff = (grads[key] - want).abs().max().item()
            assert diff <= 1e-6 * max(1.0, want.abs().max().item()), f"{split} {key}: max difference {diff:.2e}"
    # The aggregations are really different objectives (the test would not see a mix-up otherwise).
    actor = {a: reference[f"grpo/{a}/actor"] for a in losses.LOSS_AGGS}
    norms = [g.norm().item() for g in actor.values()]
    assert len({round(n, 3) for n in norms}) == len(norms), norms
    # And so are the objectives and corrections, each against GRPO's own aggregation's gradient.
    grpo = {"gspo": "seq_mean_token_mean", "cispo": "token_mean"}
    for variant in VARIANTS:
        base = reference[f"grpo/{grpo.get(variant, 'seq_mean_token_mean')}/actor"]
        assert (reference[f"{variant}/actor"] - base).abs().max().item() > 1e-6, variant
