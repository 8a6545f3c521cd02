"""A task's rule: a function that scores any answer to a prompt, used as the held-out accuracy of
SFT and PPO, as the truth PPO's rollouts are checked against, and (step.reward_fn) as PPO's reward.

A rule takes (prompt text, answer text) and returns a float: 1.0 right, 0.0 wrong for the shipped
tasks; any number for yours. A rule with a third parameter also receives the row's reference
answer (its ``answer`` or ``chosen`` column), as verifiers of prompts with a checkable answer do:
``math`` and ``exact`` ship (rlhf.rewards.verifiers). Name one from REWARD_FNS, or your own as ``package.module:function``
(imported from the working directory first, then PYTHONPATH). ``data.rule`` says which rule scores
a dataset's answers (default: the shipped tasks' rule, wherever it parses every prompt);
``step.reward_fn=rule`` makes that rule PPO's reward, or name another one there.

    python launch.py pipeline=e2e 'data.sources=[{path: DIR}]' data.rule=my_task:score
    python launch.py step=ppo step.reward_fn=rule step.reward_model_weight=0 actor.path=<sft out>/model
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from rlhf.data import synthetic
from rlhf.errors import ConfigError
from rlhf.rewards import verifiers

RewardFn = Callable[[str, str], float]
# Where a rule with a reference parameter finds each prompt's reference answer (built on first use).
References = Callable[[], Mapping[str, str]]

REWARD_FNS: dict[str, Callable[..., float]] = {
    # The shipped synthetic tasks' rule (sort, reverse, add): 1.0 for the right answer, 0.0 otherwise.
    "synthetic": synthetic.rule_score,
    # The final answer (after GSM8K's ####, in MATH's \boxed{}, or the last number) against the
    # reference's: numbers as numbers (1,000 = 1000, 1/2 = 0.5), other answers as text.
    "math": verifiers.math_score,
    # The answer word for word the reference (whitespace aside).
    "exact": verifiers.exact_score,
}
# step.reward_fn=rule: the data's own rule (data.rule, or the shipped tasks' rule on their prompts).
DATA_RULE = "rule"


def takes_reference(fn: Callable) -> bool:
    """Whether a rule has a third parameter, the reference answer."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.kind == p.VAR_POSITIONAL]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def resolve(ref: str, key: str, references: References | None = None) -> RewardFn:
    """The function ``ref`` names (a REWARD_FNS key or ``module:function``), wrapped so that a failure
    or a non-number names the rule, the prompt and the answer, and called as (prompt, answer): a rule
    that takes a reference gets the prompt's from ``references``. Raises ConfigError naming ``key``."""

    if ref in REWARD_FNS:
        return _checked(REWARD_FNS[ref], ref, references)
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
    return _checked(fn, ref, references)


def _checked(fn: Callable[..., float], ref: str, references: References | None = None) -> RewardFn:
    with_reference = takes_reference(fn)
    table: dict[str, Mapping[str, str]] = {}

    def reference(prompt: str) -> str:
        if references is None:
            raise RuntimeError(f"rule {ref} takes a reference answer, and this step has no rows to take it from")
        if "rows" not in table:
            table["rows"] = references()
        if prompt not in table["rows"]:
            raise RuntimeError(f"rule {ref} takes a reference answer, and no row of the data has one for prompt "
                               f"{prompt!r} (give rows an answer or chosen column)")
        return table["rows"][prompt]

    def score(prompt: str, answer: str) -> float:
        args = (prompt, answer, reference(prompt)) if with_reference else (prompt, answer)
        try:
            value = float(fn(*args))
        except Exception as err:
            raise RuntimeError(f"reward function {ref} failed on prompt {prompt!r}, answer {answer!r}: "
                               f"{type(err).__name__}: {err}") from err
        if not math.isfinite(value):
            raise RuntimeError(f"reward function {ref} returned {value} for prompt {prompt!r}, answer {answer!r}")
        return value

    score.ref = ref  # type: ignore[attr-defined]
    return score


def task_rule(data_rule: str | None, prompts: Sequence[str], references: References | None = None) -> RewardFn | None:
    """The rule that scores this data's answers: ``data.rule`` when set; else the shipped tasks' rule
    where it parses every one of ``prompts``; else None (nothing can tell right from wrong).
    ``references``: each prompt's reference answer, for a rule that takes one (rlhf.data.blend.data_rule)."""
    if data_rule:
        return resolve(data_rule, "data.rule", references)
    if prompts and all(synthetic.parse_prompt(p) is not None for p in prompts):
        return resolve("synthetic", "data.rule")
    return None


def knows(rule: RewardFn, prompts: Sequence[str]) -> bool:
    """Whether ``rule`` can score these prompts (a user's rule is trusted to; the shipped rule only
    knows its own tasks' prompts)."""
    if getattr(rule, "ref", None) != "synthetic":
        return True
    return all(synthetic.parse_prompt(p) is not None for p in prompts)
