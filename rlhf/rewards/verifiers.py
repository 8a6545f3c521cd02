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


# GSM8K's answer marker: '####' and then the answer. '####' and then words is a Markdown heading
# ("#### Step 1"), which marks nothing: a model that writes headings before its \boxed{} answer
# must not be scored on a heading's number.
_MARKER = re.compile(r"####[ \t]*(?=[-+$.\d\\])")


def final_answer(text: str) -> str:
    """The final answer of a solution: the last \\boxed{} (explicit wherever it is), else what follows
    GSM8K's last '####' marker, else the whole text (an answer that is only the answer)."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    markers = list(_MARKER.finditer(text))
    if markers:
        return text[markers[-1].end():].strip()
    return text.strip()


def _marked(text: str) -> bool:
    return _boxed(text) is not None or _MARKER.search(text) is not None


def _numbers(text: str, first: bool = False) -> set[Fraction]:
    """The values the number ``text`` states may mean (the last number in it, or the first with
    ``first``): one value, or two for a percent, which people write both as the number ('25%' for a
    reference of 25, GSM8K's way) and as the fraction ('50%' for 0.5). Empty where it states none."""
    text = _latex_fractions(text).replace("\\!", "").replace("{,}", ",").replace("\\%", "%")
    found = _NUMBER.findall(text)
    if not found:
        return set()
    token = found[0 if first else -1].replace("$", "").replace(",", "").replace(" ", "")
    percent = token.endswith("%")
    try:
        value = Fraction(token.rstrip("%"))
    except (ValueError, ZeroDivisionError):
        return set()
    return {value, value / 100} if percent else {value}


def as_number(text: str) -> Fraction | None:
    """The number ``text`` states (the last one in it, so '... is 72.' gives 72), exactly: 1,000 and
    1000, 0.5 and 1/2 and \\frac{1}{2} are equal; a percent reads as its number (25% is 25). None where
    it states no number."""
    values = _numbers(text)
    return max(values, key=abs) if values else None


def _normal(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().rstrip(".").strip("$ ")).lower()


def math_score(prompt: str, answer: str, reference: str) -> float:
    """1.0 where the answer's final answer equals the reference's. A reference that is a number is
    compared as a number: with the first number after the answer's marker (\\boxed{}, GSM8K's
    '#### 18 apples'), or the last number an unmarked answer states (so prose around it is fine); a
    percent matches its number or its fraction. Any other reference (an expression, a choice) is
    compared as text, case, spaces, a trailing period and $ aside."""
    ours, theirs = final_answer(answer), final_answer(reference)
    if _is_number(theirs):
        expected = _numbers(theirs)
        return float(bool(expected & _numbers(ours, first=_marked(answer))))
    return float(_normal(ours) == _normal(theirs))


def _is_number(text: str) -> bool:
    text = _latex_fractions(text).replace("\\%", "%").strip().rstrip(".")
    return _NUMBER.fullmatch(text.replace(" ", "")) is not None


def exact_score(prompt: str, answer: str, reference: str) -> float:
    """1.0 where the answer is the reference, whitespace at the ends and between words aside."""
    return float(answer.split() == reference.split())
