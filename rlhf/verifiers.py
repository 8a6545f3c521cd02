"""Verifiers that ship: rules that score an answer against the row's reference answer, for prompts
with a checkable answer (GSM8K, MATH, arithmetic). Named by a word in ``data.rule`` or
``step.reward_fn`` (rlhf.rewards.REWARD_FNS); each takes (prompt, answer, reference) and returns 1.0
for a right answer, else 0.0.

    python launch.py pipeline=rlvr                                   # GRPO against `math` on the shipped task
    python launch.py pipeline=rlvr 'data.sources=[{path: openai/gsm8k}]'
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number as people write it: sign, thousands separators, decimals, a fraction (3/4) or a percent.
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\$?\.\d+%?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _latex_fractions(text: str) -> str:
    """\\frac{a}{b} (and \\dfrac, \\tfrac) written as a/b."""
    return _FRAC.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces nested), as MATH's solutions mark their answer."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_answer(text: str) -> str:
    """The final answer of a solution: what follows GSM8K's '####', else the last \\boxed{}, else the
    whole text (an answer that is only the answer)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = _boxed(text)
    return boxed.strip() if boxed is not None else text.strip()


def as_number(text: str) -> Fraction | None:
    """The number ``text`` states (the last one in it, so '... is 72.' gives 72), exactly: 1,000 and
    1000, 0.5 and 1/2 and \\frac{1}{2}, 50% and 0.5 are equal. None where it states no number."""
    text = _latex_fractions(text).replace("\\!", "").replace("{,}", ",")
    found = _NUMBER.findall(text)
    if not found:
        return None
    token = found[-1].replace("$", "").replace(",", "").replace(" ", "")
    percent = token.endswith("%")
    token = token.rstrip("%")
    try:
        value = Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _normal(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().rstrip(".").strip("$ ")).lower()


def math_score(prompt: str, answer: str, reference: str) -> float:
    """1.0 where the answer's final answer equals the reference's. A reference that is a number is
    compared as a number with the last number the answer states (so prose around it is fine); any
    other reference (an expression, a choice) as text, case, spaces, a trailing period and $ aside."""
    ours, theirs = final_answer(answer), final_answer(reference)
    expected = as_number(theirs) if _is_number(theirs) else None
    if expected is not None:
        return float(as_number(ours) == expected)
    return float(_normal(ours) == _normal(theirs))


def _is_number(text: str) -> bool:
    text = _latex_fractions(text).strip().rstrip(".")
    return _NUMBER.fullmatch(text.replace(" ", "")) is not None


def exact_score(prompt: str, answer: str, reference: str) -> float:
    """1.0 where the answer is the reference, whitespace at the ends and between words aside."""
    return float(answer.split() == reference.split())
