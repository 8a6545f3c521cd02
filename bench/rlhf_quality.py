"""Does RLHF improve the policy? The whole chain on the shipped rule-checkable task, judged by the rule.

Runs ``pipeline=e2e`` (SFT stopped early on purpose, reward model, PPO) into a fresh folder and
prints one JSON line: held-out greedy accuracy of the SFT start and of the PPO result (both scored
by the rule, not by the reward model), mean KL to the reference over the last PPO steps, the reward
model's mean score on the greedy answers before and after, its held-out accuracy, and the wall
time of each step. Target: PPO >= SFT + 20 points within 15 minutes of CPU for the whole chain.
``--rule-reward`` is the sanity run: the rule itself as the reward (no reward model in PPO).

    python bench/rlhf_quality.py
    python bench/rlhf_quality.py --rule-reward
    python bench/rlhf_quality.py seed=2 pipeline.ppo.step.epochs=6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rule-reward", action="store_true", help="PPO rewarded by the rule instead of the reward model")
    ap.add_argument("--out", type=Path, help="keep the chain here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the chain")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


    from rlhf.config import compose_config
    from rlhf.launch import run

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        overrides = ["pipeline=e2e", "logging.progress_bar=false", *args.overrides, f"run_dir={out}"]
        if args.rule_reward:
            # The chain's own PPO settings stay; the rule replaces the reward model on top of them.
            overrides += ["pipeline.ppo.step.reward_fn=rule", "pipeline.ppo.step.reward_model_weight=0",
                          "pipeline.steps=[sft,ppo]"]
        cfg = compose_config(overrides)
        start = time.perf_counter()
        run(cfg, overrides=overrides)
        wall = time.perf_counter() - start
        manifest = json.loads((out / "manifest.json").read_text())
        ppo = json.loads((out / "ppo" / "final_metrics.json").read_text())
        rows = [json.loads(line) for line in open(out / "ppo" / "metrics.jsonl") if '"kl"' in line]
        result = {
            "reward": "rule" if args.rule_reward else "reward model",
            "sft_accuracy": round(ppo["eval/accuracy_before"], 4), "ppo_accuracy": round(ppo["eval/accuracy"], 4),
            "gain_points": round(100 * (ppo["eval/accuracy"] - ppo["eval/accuracy_before"]), 1),
            "kl_last10": round(statistics.mean(r["kl"] for r in rows[-10:]), 4),
            "rollout_rule_accuracy_last10": round(statistics.mean(r["rollout/rule_accuracy"] for r in rows[-10:]), 4),
            "ppo_steps": ppo["step"], "wall_s": round(wall, 1),
            "step_seconds": {k: v.get("seconds") for k, v in manifest["steps"].items()},
            "target_gain_points": 20,
        }
        if not args.rule_reward:
            reward = manifest["steps"]["reward"]["metrics"]
            result.update(rm_heldout_acc=round(reward["eval/acc"], 4),
                          rm_score_before=round(ppo["eval/rm_score_before"], 4),
                          rm_score_after=round(ppo["eval/rm_score"], 4),
                          rm_rule_auc_last10=round(statistics.mean(r["rollout/rm_rule_auc"] for r in rows[-10:]), 4))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
