"""The shipped synthetic preference tasks, and the rule that scores any answer to them.

Every row is in DeepSpeed-Chat's columns (prompt, chosen, rejected) with prompts in its
" Human: ... Assistant:" convention. Because a rule knows the right answer to every prompt, the
reward model and PPO can be checked against the truth instead of against themselves.

Rejected answers are hard near misses -- the right form with wrong content, the mistakes a half-
trained policy makes (a letter replaced or repeated, one dropped or added, two swapped, the input
echoed) -- because a reward model trained on easy or unrepresentative negatives is gamed by PPO.

Regenerate the shipped files (deterministic from the seed):
    python -m rlhf.data.synthetic --out data/synthetic
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
from collections.abc import Callable
from pathlib import Path

LETTERS = string.ascii_lowercase
NUM_LETTERS = 4
PROMPT_RE = re.compile(r"^\s*Human:\s*(\w+)\s+(.*?)\s*Assistant:\s*$", re.DOTALL)


def make_prompt(task: str, args: list[str]) -> str:
    return f" Human: {task} {' '.join(args)} Assistant:"


def _answer_sort(args: list[str]) -> list[str]:
    return sorted(args)


def _answer_reverse(args: list[str]) -> list[str]:
    return list(reversed(args))


def _answer_add(args: list[str]) -> list[str]:
    return [str(int(args[0]) + int(args[1]))]


ANSWERS: dict[str, Callable[[list[str]], list[str]]] = {
    "sort": _answer_sort,
    "reverse": _answer_reverse,
    "add": _answer_add,
}


def parse_prompt(prompt: str) -> tuple[str, list[str]] | None:
    m = PROMPT_RE.match(prompt)
    if not m or m.group(1) not in ANSWERS:
        return None
    return m.group(1), m.group(2).split()


def expected_answer(prompt: str) -> str | None:
    parsed = parse_prompt(prompt)
    if parsed is None:
        return None
    task, args = parsed
    try:
        return " " + " ".join(ANSWERS[task](args))
    except (ValueError, IndexError):
        return None


def rule_score(prompt: str, answer: str) -> float:
    """1.0 when the answer is right, else 0.0; whitespace is not part of the answer's content."""
    expected = expected_answer(prompt)
    if expected is None:
        raise ValueError(f"not a prompt of the synthetic tasks: {prompt!r}")
    return float(answer.split() == expected.split())


# ------------------------------------------------------------------------------- near misses
# Kinds of letter mistakes and how often each is drawn. Weighted like the mistakes a half-trained
# policy really makes on the sort task (measured on a tiny SFT model sampling at temperature 0.7:
# 55% a letter not in the input, 29% a repeated letter, 12% a wrong length, 1% a wrong order);
# order mistakes stay in, since they are the hardest to tell from the right answer.
# A replaced letter is most often the right letter's neighbour in the alphabet: of the sort mistakes
# the default chain's SFT models made in PPO rollouts (4 seeds, 273 wrong answers), 40% swapped in a
# letter 1 away and 14% one 2 away; a reward model that had seen only uniformly drawn replacements
# scored 99% of those as right, and PPO learned to make them (rollout AUC of the reward model against
# the rule fell to 0.3). Hence "replace_near".
LETTER_MISTAKES = {"replace_near": 5, "replace": 2, "replace_two": 1, "duplicate": 3, "drop": 1, "insert": 1,
                   "swap_adjacent": 2, "swap_any": 1, "echo": 1}
NEAR = 2  # how far in the alphabet a "replace_near" letter lies from the right one


def _letter_near_miss(rng: random.Random, args: list[str], right: list[str]) -> list[str]:
    kinds = [k for k in LETTER_MISTAKES if k != "echo" or args != right]
    weights = [LETTER_MISTAKES[k] for k in kinds]
    foreign = [c for c in LETTERS if c not in args]
    while True:
        kind = rng.choices(kinds, weights)[0]
        out = list(right)
        if kind == "swap_adjacent":
            i = rng.randrange(len(out) - 1)
            out[i], out[i + 1] = out[i + 1], out[i]
        elif kind == "swap_any":
            i, j = rng.sample(range(len(out)), 2)
            out[i], out[j] = out[j], out[i]
        elif kind == "replace_near":
            i = rng.randrange(len(out))
            near = [c for c in foreign if 0 < abs(ord(c) - ord(out[i])) <= NEAR]
            if not near:
                continue
            out[i] = rng.choice(near)
        elif kind == "replace":
            out[rng.randrange(len(out))] = rng.choice(foreign)
        elif kind == "replace_two":
            for i in rng.sample(range(len(out)), 2):
                out[i] = rng.choice(foreign)
        elif kind == "duplicate":
            i, j = rng.sample(range(len(out)), 2)
            out[j] = out[i]
        elif kind == "drop":
            del out[rng.randrange(len(out))]
        elif kind == "insert":
            out.insert(rng.randrange(len(out) + 1), rng.choice(LETTERS))
        else:
            out = list(args)
        if out != right:
            return out


def _number_near_miss(rng: random.Random, right: int) -> int:
    while True:
        kind = rng.choice(["off_by_one", "off_by_ten", "digits_swapped", "no_carry"])
        if kind == "off_by_one":
            out = right + rng.choice([-1, 1])
        elif kind == "off_by_ten":
            out = right + rng.choice([-10, 10])
        elif kind == "digits_swapped":
            out = int(str(right)[::-1])
        else:
            out = right - 10 if right >= 10 else right + 10
        if out != right and out >= 0:
            return out


def candidate_answers(prompt: str, k: int, rng: random.Random) -> list[tuple[str, float]]:
    """The right answer and up to k-1 distinct near misses for ``prompt``, each with its rule score."""
    parsed = parse_prompt(prompt)
    if parsed is None:
        raise ValueError(f"not a prompt of the synthetic tasks: {prompt!r}")
    task, args = parsed
    right = ANSWERS[task](args)
    out = {" " + " ".join(right): 1.0}
    for _ in range(20 * k):  # some tasks have few distinct near misses; stop trying eventually
        if len(out) >= k:
            break
        if task == "add":
            wrong = [str(_number_near_miss(rng, int(right[0])))]
        else:
            wrong = _letter_near_miss(rng, args, right)
        out.setdefault(" " + " ".join(wrong), 0.0)
    return list(out.items())


# ------------------------------------------------------------------------------------ tables
def generate(task: str, n_train: int, n_eval: int, seed: int) -> dict[str, list[dict]]:
    """Rows for one task; train and eval prompts never share an input."""
    rng = random.Random(f"{task}-{seed}")
    if task == "add":
        inputs = [[str(a), str(b)] for a in range(100) for b in range(100)]
        rng.shuffle(inputs)
    else:
        seen: set[tuple[str, ...]] = set()
        inputs = []
        while len(inputs) < n_train + n_eval:
            args = rng.sample(LETTERS, NUM_LETTERS)
            if tuple(args) not in seen:
                seen.add(tuple(args))
                inputs.append(args)
    if len(inputs) < n_train + n_eval:
        raise ValueError(f"task {task!r} has only {len(inputs)} distinct inputs")
    rows = []
    for args in inputs[: n_train + n_eval]:
        right = ANSWERS[task](args)
        if task == "add":
            wrong = [str(_number_near_miss(rng, int(right[0])))]
        else:
            wrong = _letter_near_miss(rng, args, right)
        rows.append({"prompt": make_prompt(task, args), "chosen": " " + " ".join(right),
                     "rejected": " " + " ".join(wrong)})
    return {"train": rows[:n_train], "eval": rows[n_train:]}


def generate_numbers(n_train: int, n_eval: int, seed: int) -> dict[str, list[dict]]:
    """Prompt-and-answer rows with a checkable numeric answer and no rejected one, as GSM8K's are: the
    largest or the smallest of four two-digit numbers, in words the shipped rule does not parse, scored
    by data.rule=math against the row's reference answer. Train and eval never share a question."""
    rng = random.Random(f"numbers-{seed}")
    seen: set[tuple] = set()
    rows = []
    while len(rows) < n_train + n_eval:
        kind, numbers = rng.choice(("largest", "smallest")), rng.sample(range(10, 100), 4)
        if (kind, *numbers) in seen:
            continue
        seen.add((kind, *numbers))
        answer = max(numbers) if kind == "largest" else min(numbers)
        rows.append({"prompt": f" Human: {kind} of {', '.join(map(str, numbers))}? Assistant:", "answer": f" {answer}"})
    return {"train": rows[:n_train], "eval": rows[n_train:]}


# The word problems of the `words` task: (story with {a} and {b}, the unit asked about), each a sum.
STORIES = (
    ("{name} has {a} apples and buys {b} more.", "apples does {name} have now"),
    ("A shelf holds {a} books. {name} puts {b} more books on it.", "books are on the shelf"),
    ("{name} walked {a} km on Monday and {b} km on Tuesday.", "km did {name} walk in total"),
    ("A class has {a} girls and {b} boys.", "children are in the class"),
    ("{name} saved {a} dollars in May and {b} dollars in June.", "dollars did {name} save"),
)
NAMES = ("Tom", "Ana", "Lee", "Mia", "Sam", "Ivy", "Ben", "Zoe")


def generate_arithmetic(n_train: int, n_eval: int, seed: int, words: bool = False) -> dict[str, list[dict]]:
    """Sums of two numbers from 1 to 30 asked as a pretrained chat model is asked (plain user questions,
    rendered by its chat template), with the sum as the reference for data.rule=math: ``arithmetic``
    asks for the number alone; ``words`` tells a one-line story and asks for an answer ending
    '#### <number>', GSM8K's form. Train and eval never share a pair of numbers."""
    task = "words" if words else "arithmetic"
    rng = random.Random(f"{task}-{seed}")
    # A small instruct model answers about a third of these right, greedily, in its own template: a
    # start that RL from the verifier can improve (two-digit sums with carries it mostly gets wrong).
    pairs = [(a, b) for a in range(1, 31) for b in range(1, 31)]
    rng.shuffle(pairs)
    rows = []
    for a, b in pairs[: n_train + n_eval]:
        if words:
            story, unit = rng.choice(STORIES)
            name = rng.choice(NAMES)
            prompt = (f"{story.format(name=name, a=a, b=b)} How many {unit.format(name=name)}? "
                      "End your answer with '#### <number>'.")
            rows.append({"prompt": prompt, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
        else:
            rows.append({"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)})
    return {"train": rows[:n_train], "eval": rows[n_train:]}


# Rows per task: sort is the default blend and the quality benchmarks' task, so it is the largest.
SIZES = {"sort": (40000, 1000), "reverse": (10000, 1000), "add": (8000, 1000), "numbers": (8000, 1000),
         "arithmetic": (600, 150), "words": (600, 150)}
GENERATORS = {
    "numbers": generate_numbers,
    "arithmetic": generate_arithmetic,
    "words": lambda n_train, n_eval, seed: generate_arithmetic(n_train, n_eval, seed, words=True),
}


def write(out: Path, seed: int = 0) -> None:
    for task, (n_train, n_eval) in SIZES.items():
        folder = out / task
        folder.mkdir(parents=True, exist_ok=True)
        make = GENERATORS.get(task)
        tables = make(n_train, n_eval, seed) if make else generate(task, n_train, n_eval, seed)
        for split, rows in tables.items():
            with open(folder / f"{split}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        print(f"{folder}: {n_train} train, {n_eval} eval rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/synthetic"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write(args.out, args.seed)


if __name__ == "__main__":
    main()
