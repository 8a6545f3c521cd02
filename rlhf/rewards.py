"""A task's rule: a function that scores any answer to a prompt, used as the held-out accuracy of
SFT and PPO, as the truth PPO's rollouts are checked against, and (step.reward_fn) as PPO's reward.

A rule takes (prompt text, answer text) and returns a float: 1.0 right, 0.0 wrong for the shipped
tasks; any number for yours. Name one from REWARD_FNS, or your own as ``package.module:function``
(imported from the working directory first, then PYTHONPATH). ``data.rule`` says which rule scores
a dataset's answers (default: the shipped tasks' rule, wherever it parses every prompt);
``step.reward_fn=rule`` makes that rule PPO's reward, or name another one there.

    python launch.py pipeline=e2e 'data.sources=[{path: DIR}]' data.rule=my_task:score
    python launch.py step=ppo step.reward_fn=rule step.reward_model_weight=0 actor.path=<sft out>/model
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence

from rlhf.data import synthetic
from rlhf.errors import ConfigError

RewardFn = Callable[[str, str], float]

REWARD_FNS: dict[str, RewardFn] = {
    # The shipped synthetic tasks' rule (sort, reverse, add): 1.0 for the right answer, 0.0 otherwise.
    "synthetic": synthetic.rule_score,
}
# step.reward_fn=rule: the data's own rule (data.rule, or the shipped tasks' rule on their prompts).
DATA_RULE = "rule"


def resolve(ref: str, key: str) -> RewardFn:
    """The function ``ref`` names (a REWARD_FNS key or ``module:function``), wrapped so that a failure
    or a non-number names the rule, the prompt and the answer. Raises ConfigError naming ``key``."""

    if ref in REWARD_FNS:
        return _checked(REWARD_FNS[ref], ref)
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={ref!r} is neither one of {', '.join(sorted(REWARD_FNS))} nor a "
                          "'package.module:function' reference")
    if os.getcwd() not in sys.path:  # `python launch.py` puts the repo on sys.path, not the user's folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{key}={ref!r}: cannot import module {module_name!r} ({err}); it must be importable "
                          "from the working directory or PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}={ref!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                          f"function {attr!r}")
    return _checked(fn, ref)


def _checked(fn: RewardFn, ref: str) -> RewardFn:
    def score(prompt: str, answer: str) -> float:
        try:
            value = float(fn(prompt, answer))
        except Exception as err:
            raise RuntimeError(f"reward function {ref} failed on prompt {prompt!r}, answer {answer!r}: "
                               f"{type(err).__name__}: {err}") from err
        if not math.isfinite(value):
            raise RuntimeError(f"reward function {ref} returned {value} for prompt {prompt!r}, answer {answer!r}")
        return value

    score.ref = ref  # type: ignore[attr-defined]
    return score


def task_rule(data_rule: str | None, prompts: Sequence[str]) -> RewardFn | None:
    """The rule that scores this data's answers: ``data.rule`` when set; else the shipped tasks' rule
    where it parses every one of ``prompts``; else None (nothing can tell right from wrong)."""
    if data_rule:
        return resolve(data_rule, "data.rule")
    if prompts and all(synthetic.parse_prompt(p) is not None for p in prompts):
        return resolve("synthetic", "data.rule")
    return None


def knows(rule: RewardFn, prompts: Sequence[str]) -> bool:
    """Whether ``rule`` can score these prompts (a user's rule is trusted to; the shipped rule only
    knows its own tasks' prompts)."""
    if getattr(rule, "ref", None) != "synthetic":
        return True
    return all(synthetic.parse_prompt(p) is not None for p in prompts)
