"""Every refusal of the chain, followed as a user would: trigger it on a small task (a shipped one or
one the chain was never tuned on), take the first fix the message prints (readiness.printed_fixes),
add it to the command line, run again, and check that the next run passes that check or stops on
another cause. No message leads back to itself, and each fix changes what stopped the step: a cap's
fix raises that cap, a plateau stop's fix names the plateau rule's keys.

    python -m pytest -q tests/test_refusals.py
"""

from __future__ import annotations

import json
import random
import re

import pytest
from conftest import compose

from bench.own_task import ROWS, RULES
from rlhf.chain.readiness import RUN_ANYWAY, printed_fixes, with_fix
from rlhf.config import ConfigError
from rlhf.launch import run

pytestmark = pytest.mark.slow

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=64"]
# A PPO that starts is one short step: the test is about what stops the chain before it.
PPO_SHORT = ["pipeline.ppo.step.max_steps=1", "pipeline.ppo.step.rollout_batch_size_per_device=16",
             "pipeline.ppo.step.micro_batch_size_per_device=8", "pipeline.ppo.step.eval_prompts=8"]
# The chain with the rule as PPO's reward (no reward model): what SFT leaves is judged right after it.
RULE_PPO = ["pipeline.steps=[sft,ppo]", "pipeline.ppo.step.reward_fn=rule", "pipeline.ppo.step.reward_model_weight=0",
            "pipeline.sft.step.eval_accuracy_prompts=32"]
# Only the reward model's checks: the SFT policy's floors off.
REWARD_ONLY = ["pipeline.min_policy_accuracy=0", "pipeline.sft_loss_still_falling=0", "pipeline.sft_beyond_constant=false",
               "pipeline.reward.step.rule_check_answers=0"]


def _untuned(tmp_path, task: str, rows: int = 2000) -> list[str]:
    """A task of bench/own_task.py as a user brings it: a data folder and a rule module of their own."""
    data = tmp_path / f"{task}_data"
    data.mkdir()
    rng = random.Random(0)
    for split, n in (("train", rows), ("eval", 200)):
        (data / f"{split}.json").write_text(json.dumps([ROWS[task](rng) for _ in range(n)]))
    (tmp_path / f"{task}_rule.py").write_text(RULES[task])
    return [f"data.sources=[{{path: {data}}}]", f"data.rule={task}_rule:score"]


def _named_causes(message: str) -> set[str]:
    """The step keys a message says stopped a step: a cap (the cap step.max_steps=...) or the plateau
    rule (step.early_stop_patience)."""
    return set(re.findall(r"the cap (step\.\w+)=", message)) | set(re.findall(r"\((step\.early_stop_patience)\)", message))


def follow(tmp_path, overrides: list[str], rounds: int) -> list[str]:
    """Run the chain, follow the first printed fix of each refusal, at most ``rounds`` refusals; the
    refusals in order. Every run is in the same folder, as a user's rerun is: the chain reuses the
    finished steps the fix does not touch and trains the others again."""
    chain, messages = tmp_path / "chain", []
    for _ in range(rounds):
        args = [*overrides, f"run_dir={chain}"]
        try:
            run(compose(args), overrides=args)
            return messages
        except ConfigError as err:
            message = str(err)
        assert RUN_ANYWAY in message, message
        assert message not in messages, f"following the fix led back to the same refusal: {message}"
        fixes = printed_fixes(message)
        assert fixes, f"no fix to follow in: {message}"
        fix = fixes[0]
        # The fix changes what stopped the step it names.
        for cause in _named_causes(message):
            assert any(f".{cause}=" in o for o in fix), (cause, fix, message)
        messages.append(message)
        overrides = with_fix(overrides, fix)
    return messages


@pytest.fixture
def users_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the users' rule modules import from here
    return tmp_path


BASE = ["pipeline=e2e", *QUIET, *PPO_SHORT]


def test_sft_stopped_by_its_cap_is_followed_by_a_higher_cap(tmp_path):
    """The shipped sort task: SFT at 0% after 2 steps; the fix doubles that cap, and again."""
    seen = follow(tmp_path, [*BASE, *RULE_PPO, "pipeline.sft.step.max_steps=2"], rounds=2)
    assert seen[0].startswith("Step 2 (PPO) not started: the SFT policy's held-out accuracy by the rule is") \
        and "pipeline.sft.step.max_steps=4" in seen[0] and "pipeline.sft.step.max_steps=8" in seen[1], seen


def test_sft_stopped_by_its_plateau_is_followed_by_a_lower_rate_without_the_plateau_stop(users_folder):
    """An untuned dedupe task, a constant rate far too high: the held-out loss stalls at 0% accuracy
    well before the cap, and with no drops of the rate (tests/test_sft.py has the drops) the plateau
    ends SFT; the fix starts over at a lower rate without the plateau stop, so the next run ends at its
    cap (or passes)."""
    dedupe = _untuned(users_folder, "dedupe")
    plateau = [*BASE, *RULE_PPO, *dedupe, "pipeline.sft.optim.lr=0.3", "pipeline.sft.optim.warmup_steps=0",
               "pipeline.sft.optim.scheduler=constant", "pipeline.sft.step.early_stop_patience=2",
               "pipeline.sft.step.plateau_lr_drops=0", "pipeline.sft.step.max_steps=150"]
    seen = follow(users_folder, plateau, rounds=2)
    assert "SFT stopped on its loss plateau" in seen[0] and "the likely cause is a learning rate too high" in seen[0] \
        and "pipeline.sft.optim.lr=0.1 pipeline.sft.step.early_stop_patience=0" in seen[0], seen
    assert len(seen) == 1 or "the cap step.max_steps=150" in seen[1], seen


def test_sft_loss_still_falling_before_a_reward_model_is_followed_by_a_higher_cap(tmp_path):
    seen = follow(tmp_path, [*BASE, "pipeline.steps=[sft,reward]", "pipeline.sft.step.max_steps=2",
                             "pipeline.sft.step.eval_accuracy_prompts=32"], rounds=2)
    assert seen[0].startswith("Step 2 (reward model) not started: SFT stopped with its held-out loss still falling") \
        and "pipeline.sft.step.max_steps=4" in seen[0], seen


def test_sft_no_better_than_a_constant_answer_is_followed_by_a_lower_rate_and_a_higher_cap(users_folder):
    """An untuned count task: SFT no better than always answering the commonest count."""
    count = _untuned(users_folder, "count")
    seen = follow(users_folder, [*BASE, *RULE_PPO, *count, "pipeline.sft.step.max_steps=10",
                                 "pipeline.sft.step.eval_accuracy_prompts=128"], rounds=2)
    assert "of always giving the best single answer" in seen[0] and \
        "pipeline.sft.optim.lr=0.001 pipeline.sft.step.early_stop_patience=0 pipeline.sft.step.max_steps=20" in seen[0], seen


REWARD_BASE = [*BASE, *REWARD_ONLY, "pipeline.sft.step.max_steps=2"]


def test_a_reward_model_below_its_floor_at_its_cap_is_followed_by_a_higher_cap(tmp_path):
    seen = follow(tmp_path, [*REWARD_BASE, "pipeline.reward.step.max_steps=2",
                             "pipeline.reward.step.policy_pairs_prompts=0"], rounds=2)
    assert seen[0].startswith("Step 3 (PPO) not started: the reward model's held-out pairwise accuracy") \
        and "(pipeline.reward.step.max_steps=4)" in seen[0], seen


def test_a_reward_model_that_misjudges_the_policy_is_followed_by_more_of_the_policys_answers(tmp_path):
    """PPO's start check, with a floor on the AUC that nothing short of perfect meets: a policy that
    answers some prompts right (100 SFT steps), a reward model of a few steps."""
    audit = [*REWARD_BASE, "pipeline.sft.step.max_steps=100", "pipeline.reward.step.max_steps=10",
             "pipeline.reward.step.policy_pairs_prompts=64", "pipeline.reward_min_accuracy=0",
             "pipeline.reward_min_policy_auc=1.0"]
    seen = follow(tmp_path, audit, rounds=2)
    assert seen[0].startswith("PPO stopped before its first update: the reward model separates the policy's own") \
        and "(pipeline.reward.step.policy_pairs_prompts=256)" in seen[0], seen
    assert "pipeline.reward.step.policy_pairs_prompts=1024" in seen[1], seen
