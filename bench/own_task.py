"""The default chain on a task the project does not ship, under the user's own rule: does PPO beat
its SFT start there too?

Writes what a user brings: a folder in DeepSpeed-Chat's local/jsonfile layout (train.json and
eval.json, lists of prompt/chosen/rejected rows) for a "dedupe" task -- answer a list of letters
with each letter's first occurrence, in order -- and the rule as a module of their own
(``dedupe_rule.py``, ``score(prompt, answer) -> float``). Then runs, from that folder, exactly the
README's command:

    python launch.py pipeline=e2e 'data.sources=[{path: /abs/path/data}]' data.rule=dedupe_rule:score

and scores the SFT start and PPO's output on eval prompts no step evaluated on, by the user's rule.
Prints the chain's figures and one JSON line; the target is PPO above SFT.

    python bench/own_task.py --out /tmp/own_task
    python bench/own_task.py --out /tmp/own_task --seed 2 pipeline.ppo.step.epochs=3
    python bench/own_task.py --out /tmp/own_task_rule --rule-reward   # the user's rule as PPO's reward
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RULE = '''"""The dedupe task's rule: 1.0 when the answer lists each letter's first occurrence, in order."""


def expected(prompt):
    letters = prompt.split("dedupe", 1)[1].split("Assistant:")[0].split()
    return list(dict.fromkeys(letters))


def score(prompt, answer):
    return float(answer.split() == expected(prompt))
'''


def row(rng: random.Random) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_own_task")
    ap.add_argument("--rows", type=int, default=40000, help="train rows (the 2,4,4 split shares them)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rule-reward", action="store_true",
                    help="PPO rewarded by the user's rule instead of a reward model (SFT -> PPO)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the chain")
    args = ap.parse_args()
    out = args.out.resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, n in (("train", args.rows), ("eval", 1000)):
        (out / "data" / f"{split}.json").write_text(json.dumps([row(rng) for _ in range(n)]))
    (out / "dedupe_rule.py").write_text(RULE)

    command = [sys.executable, str(ROOT / "launch.py"), "pipeline=e2e", f"data.sources=[{{path: {out / 'data'}}}]",
               "data.rule=dedupe_rule:score", f"seed={args.seed}", "logging.progress_bar=false", *args.overrides,
               f"run_dir={out / 'chain'}"]
    if args.rule_reward:  # the README's "the rule as PPO's reward", inside the chain
        command += ["pipeline.steps=[sft,ppo]", "pipeline.ppo.step.reward_fn=rule",
                    "pipeline.ppo.step.reward_model_weight=0"]
    start = time.perf_counter()
    with open(out / "chain.log", "w") as log:  # from the user's folder, as they would run it
        proc = subprocess.run(command, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"the chain failed:\n{(out / 'chain.log').read_text()[-3000:]}")

    from bench.rlhf_quality import test_accuracy, test_prompts
    from rlhf.config import load_run_config

    sys.path.insert(0, str(out))
    from dedupe_rule import score

    steps = ("sft", "ppo") if args.rule_reward else ("sft", "reward", "ppo")
    final = {s: json.loads((out / "chain" / s / "final_metrics.json").read_text()) for s in steps}
    final.setdefault("reward", {})
    cfg = load_run_config(out / "chain" / "ppo" / "config.yaml")
    prompts = test_prompts(cfg)
    max_new = cfg.step.max_new_tokens
    result = {"task": "dedupe (not shipped), rule dedupe_rule:score", "seed": args.seed,
              "ppo_reward": "rule" if args.rule_reward else "reward model",
              "sft_eval_acc": round(final["sft"]["eval/accuracy"], 4),
              "reward_eval_acc": round(final["reward"].get("eval/acc", float("nan")), 4),
              "reward_rule_agreement": round(final["reward"].get("eval/rule_agreement", float("nan")), 4),
              "ppo_eval_acc": round(final["ppo"]["eval/accuracy"], 4),
              "ppo_last_eval_acc": round(final["ppo"].get("eval/accuracy_last", final["ppo"]["eval/accuracy"]), 4),
              "best_step": final["ppo"].get("best_step", final["ppo"]["step"]),
              "ppo_warnings": len(final["ppo"].get("warnings", [])), "test_prompts": len(prompts),
              "test_sft": round(test_accuracy(out / "chain" / "sft" / "model", prompts, max_new, score), 4),
              "test_ppo": round(test_accuracy(out / "chain" / "ppo" / "model", prompts, max_new, score), 4),
              "wall_s": round(wall, 1)}
    result["gain_points"] = round(100 * (result["test_ppo"] - result["test_sft"]), 1)
    result["ppo_beats_sft"] = result["gain_points"] > 0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
