"""Reward-model quality on the shipped task, measured against the rule (not against itself).

Trains the reward step (default: tiny-opt from random weights, 3 epochs over the 16000 reward pairs
of the sort task, about three minutes on one CPU core) and prints one JSON line: held-out accuracy on the hard
near-miss pairs, agreement with the rule on the right answer vs several near misses per held-out
prompt (and the AUC of the scores against the rule across prompts), score means, and wall time.
Target: held-out accuracy >= 0.97 (0.98 stretch). A prototype found reward models at
0.945-0.966 were gamed by PPO every time, while 0.988 held.

    python bench/reward_quality.py
    python bench/reward_quality.py model=tiny-llama step.epochs=4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULTS = ["step=reward", "model=tiny-opt", "step.epochs=3", "step.eval_every_steps=0",
            "data.max_eval_samples=1000", "step.rule_check_answers=8", "logging.progress_bar=false"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, applied after the defaults above")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from rlhf.config import compose_config
    from rlhf.launch import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_config([*DEFAULTS, *args.overrides, f"run_dir={tmp}"])
        start = time.perf_counter()
        final = run(cfg)
        wall = time.perf_counter() - start
    print(json.dumps({
        "model": cfg.model.name, "epochs": cfg.step.epochs, "steps": final["step"], "wall_s": round(wall, 1),
        "heldout_acc": round(final["eval/acc"], 4), "heldout_acc_before": round(final["eval/acc_before"], 4),
        "rule_agreement": round(final["eval/rule_agreement"], 4), "rule_auc": round(final["eval/rule_auc"], 4),
        "chosen_score": round(final["eval/chosen_score"], 3), "rejected_score": round(final["eval/rejected_score"], 3),
        "target_acc": 0.97}))


if __name__ == "__main__":
    main()
