"""The default chain on tasks the project does not ship, each under the user's own rule: does PPO
beat its SFT start there too, with the defaults only?

Writes what a user brings, per task: a folder in DeepSpeed-Chat's local/jsonfile layout (train.json
and eval.json, lists of prompt/chosen/rejected rows) and the rule as a module of their own
(``<task>_rule.py``, ``score(prompt, answer) -> float``). Three tasks of other kinds than the
shipped sort/reverse/add and than each other:
  dedupe -- a list of letters, answered with each letter's first occurrence, in order;
  count  -- how many times a letter occurs in a list (a number, not a list);
  shift  -- each letter mapped to the next one in the alphabet (a lookup per letter).
Then runs, from that folder, exactly the README's command:

    python launch.py pipeline=e2e 'data.sources=[{path: /abs/path/data}]' data.rule=<task>_rule:score

and scores the SFT start and PPO's output on eval prompts no step evaluated on, by the user's rule.
A chain that refuses a step (pipeline.on_weak_step) is reported with its one-line reason. Prints one
JSON line per task and, with several, a markdown table; target: +15 points per task.

    python bench/own_task.py --out /tmp/own_task                         # dedupe
    python bench/own_task.py --out /tmp/own_task --all --jobs 2          # the three tasks
    python bench/own_task.py --out /tmp/own_task --tasks count --seed 2 pipeline.ppo.step.epochs=3
    python bench/own_task.py --out /tmp/own_task_rule --rule-reward      # the user's rule as PPO's reward
    python bench/own_task.py --out /tmp/own_task --all --jobs 2 --follow-fix

``--follow-fix [N]``: when the chain refuses a step, add the first fix its message prints
(rlhf.chain.readiness.printed_fixes) to the same command, as a user would, and run it again in the same
run directory (the steps the fix does not touch are reused), at most N times (1 without N); the row
reports the last run, with the first refusal and the fixes applied.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf.chain.readiness import RUN_ANYWAY, printed_fixes, with_fix  # noqa: E402

RULES = {
    "dedupe": '''"""The dedupe task's rule: 1.0 when the answer lists each letter's first occurrence, in order."""


def expected(prompt):
    letters = prompt.split("dedupe", 1)[1].split("Assistant:")[0].split()
    return list(dict.fromkeys(letters))


def score(prompt, answer):
    return float(answer.split() == expected(prompt))
''',
    "count": '''"""The count task's rule: 1.0 when the answer is how many times the letter occurs in the list."""


def score(prompt, answer):
    letter, _, rest = prompt.split("count", 1)[1].split("Assistant:")[0].strip().partition(" in ")
    return float(answer.strip() == str(rest.split().count(letter)))
''',
    "shift": '''"""The shift task's rule: 1.0 when each letter is replaced by the next one in the alphabet (z -> a)."""


def score(prompt, answer):
    letters = prompt.split("shift", 1)[1].split("Assistant:")[0].split()
    return float(answer.split() == [chr((ord(c) - 97 + 1) % 26 + 97) for c in letters])
''',
}


def dedupe_row(rng: random.Random) -> dict:
    letters = [rng.choice("abcdefgh") for _ in range(rng.randint(4, 7))]
    right = list(dict.fromkeys(letters))
    # Rejected answers as a user would collect them: whole-answer mistakes (duplicates kept, sorted,
    # reversed) and the near misses a learning policy makes -- two neighbours swapped, a letter left
    # out anywhere, a letter written twice, a letter replaced. Pairs with only the first kind taught
    # a reward model that PPO gamed from its first evaluation (README, "Your own data").
    i = rng.randrange(len(right))
    j = min(i + 1, len(right) - 1)
    swapped = right[:i] + [right[j], right[i]] + right[j + 1:] if j > i else right[::-1]
    wrong = rng.choice([
        letters,
        sorted(right),
        right[::-1],
        swapped,
        right[:i] + right[i + 1:],
        right[:i + 1] + [right[i]] + right[i + 1:],
        right[:i] + [rng.choice([c for c in "abcdefgh" if c != right[i]])] + right[i + 1:],
    ])
    if wrong == right:
        wrong = right + [right[0]]
    return {"prompt": f" Human: dedupe {' '.join(letters)} Assistant:", "chosen": " " + " ".join(right),
            "rejected": " " + " ".join(wrong)}


def count_row(rng: random.Random) -> dict:
    letters = [rng.choice("abcdef") for _ in range(rng.randint(3, 8))]
    letter = rng.choice(letters if rng.random() < 0.8 else "abcdef")
    right = letters.count(letter)
    # Off by one either way (the near miss a policy makes), or another letter's count.
    wrong = rng.choice([right + 1, max(right - 1, 0) if right else right + 2,
                        letters.count(rng.choice([c for c in "abcdef" if c != letter]))])
    if wrong == right:
        wrong = right + 1
    return {"prompt": f" Human: count {letter} in {' '.join(letters)} Assistant:", "chosen": f" {right}",
            "rejected": f" {wrong}"}


def shift_row(rng: random.Random) -> dict:
    letters = [rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 5))]
    right = [chr((ord(c) - 97 + 1) % 26 + 97) for c in letters]
    i = rng.randrange(len(right))
    # The input echoed, shifted the other way, shifted by two, or one letter left unshifted.
    wrong = rng.choice([letters, [chr((ord(c) - 97 - 1) % 26 + 97) for c in letters],
                        [chr((ord(c) - 97 + 2) % 26 + 97) for c in letters], right[:i] + [letters[i]] + right[i + 1:]])
    return {"prompt": f" Human: shift {' '.join(letters)} Assistant:", "chosen": " " + " ".join(right),
            "rejected": " " + " ".join(wrong)}


ROWS = {"dedupe": dedupe_row, "count": count_row, "shift": shift_row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_own_task")
    ap.add_argument("--rows", type=int, default=40000, help="train rows (the 2,4,4 split shares them)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rule-reward", action="store_true",
                    help="PPO rewarded by the user's rule instead of a reward model (SFT -> PPO)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the chain")
    ap.add_argument("--tasks", nargs="+", default=["dedupe"], choices=list(ROWS))
    ap.add_argument("--all", action="store_true", help="every task")
    ap.add_argument("--jobs", type=int, default=1, help="chains at once (wall times then share the CPU)")
    ap.add_argument("--follow-fix", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="after a refusal, apply the first fix it prints and run the chain again; at most N times")
    args = ap.parse_args()
    tasks = list(ROWS) if args.all else args.tasks
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda t: run_task(t, args), tasks))
    for r in results:
        print(json.dumps(r), flush=True)
    if len(results) > 1:
        keys = ("task", "test_sft", "reward_eval_acc", "test_ppo", "gain_points", "ppo_warnings", "refused",
                "fix_applied", "refused_after_fix", "minutes")
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        print("\n".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in results))


def _run_chain(command: list[str], out: Path, log_name: str) -> str | None:
    """Runs the chain from the user's folder, as they would; returns the refusal's one line, if any."""
    with open(out / log_name, "w") as log:
        proc = subprocess.run(command, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = (out / log_name).read_text()
    refusal = [line for line in text.splitlines() if RUN_ANYWAY in line]
    if proc.returncode == 2 and refusal:  # the chain refused a step: its own one line
        return refusal[0]
    if proc.returncode:
        raise SystemExit(f"the chain in {out} failed:\n{text[-3000:]}")
    return None


def run_task(task: str, args) -> dict:
    out = (args.out / task).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, n in (("train", args.rows), ("eval", 1000)):
        (out / "data" / f"{split}.json").write_text(json.dumps([ROWS[task](rng) for _ in range(n)]))
    (out / f"{task}_rule.py").write_text(RULES[task])

    command = [sys.executable, str(ROOT / "launch.py"), "pipeline=e2e", f"data.sources=[{{path: {out / 'data'}}}]",
               f"data.rule={task}_rule:score", f"seed={args.seed}", "logging.progress_bar=false", *args.overrides,
               f"run_dir={out / 'chain'}"]
    if args.rule_reward:  # the README's "the rule as PPO's reward", inside the chain
        command += ["pipeline.steps=[sft,ppo]", "pipeline.ppo.step.reward_fn=rule",
                    "pipeline.ppo.step.reward_model_weight=0"]
    start = time.perf_counter()
    result = {"task": f"{task} (not shipped), rule {task}_rule:score", "seed": args.seed,
              "ppo_reward": "rule" if args.rule_reward else "reward model"}
    refusal = _run_chain(command, out, "chain.log")
    if refusal:
        result["refused"] = refusal
    applied = []
    while refusal and len(applied) < args.follow_fix and (fixes := printed_fixes(refusal)):
        # The user copies the first fix onto the same command and runs it again in the same folder.
        applied.append(" ".join(fixes[0]))
        command = with_fix(command[:-1], fixes[0]) + command[-1:]  # run_dir stays last
        refusal = _run_chain(command, out, f"chain_fixed{len(applied)}.log")
    if applied:
        result["fix_applied"] = "; then ".join(applied)
        if refusal:
            result["refused_after_fix"] = refusal
    result["minutes"] = round((time.perf_counter() - start) / 60, 1)
    steps = [s for s in (("sft", "ppo") if args.rule_reward else ("sft", "reward", "ppo"))
             if (out / "chain" / s / "final_metrics.json").exists()]
    final = {s: json.loads((out / "chain" / s / "final_metrics.json").read_text()) for s in steps}

    from bench.rlhf_quality import test_accuracy, test_prompts
    from rlhf.config import load_run_config

    sys.path.insert(0, str(out))
    score = __import__(f"{task}_rule").score
    cfg = load_run_config(out / "chain" / "sft" / "config.yaml")
    prompts = test_prompts(cfg)
    result.update(sft_eval_acc=round(final["sft"].get("eval/accuracy", float("nan")), 4),
                  sft_stopped_by=final["sft"].get("stopped_by"), test_prompts=len(prompts),
                  test_sft=round(test_accuracy(out / "chain" / "sft" / "model", prompts, cfg.step.max_new_tokens,
                                               score), 4))
    if "reward" in final:
        result.update(reward_eval_acc=round(final["reward"]["eval/acc"], 4),
                      reward_rule_agreement=round(final["reward"].get("eval/rule_agreement", float("nan")), 4))
    if "ppo" in final:
        ppo_cfg = load_run_config(out / "chain" / "ppo" / "config.yaml")
        result.update(ppo_eval_acc=round(final["ppo"]["eval/accuracy"], 4),
                      best_step=final["ppo"].get("best_step", final["ppo"]["step"]),
                      ppo_warnings=len(final["ppo"].get("warnings", [])),
                      test_ppo=round(test_accuracy(out / "chain" / "ppo" / "model", test_prompts(ppo_cfg),
                                                   ppo_cfg.step.max_new_tokens, score), 4))
        result["gain_points"] = round(100 * (result["test_ppo"] - result["test_sft"]), 1)
    return result


if __name__ == "__main__":
    main()
