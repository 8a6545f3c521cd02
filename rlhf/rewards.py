"""Reward functions PPO can use instead of, or added to, the reward model: registry by name.

A reward function takes (prompt text, answer text) and returns a float. Add one by writing the
function and putting it in REWARD_FNS; select it with ``step.reward_fn=<name>``.

    python launch.py step=ppo step.reward_fn=rule step.reward_model_weight=0 actor.path=<sft out>
"""

from __future__ import annotations

from collections.abc import Callable

from rlhf.data import synthetic

REWARD_FNS: dict[str, Callable[[str, str], float]] = {
    # The shipped synthetic tasks' rule: 1.0 for the right answer, 0.0 otherwise.
    "rule": synthetic.rule_score,
}
