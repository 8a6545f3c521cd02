"""Does RLHF improve the policy, on every seed? The whole chain on the shipped rule-checkable task,
judged by the rule, seed by seed.

Runs ``pipeline=e2e`` (SFT stopped early on purpose, reward model, PPO) once per seed into its own
folder and prints a markdown table, one row per seed: held-out greedy accuracy of the SFT start and
of PPO's output (the best-evaluated actor, step.keep_best) and of its last actor, the gain, the KL to
the reference over the last PPO steps, the reward model's held-out accuracy, hacking warnings and
the chain's wall time; then one JSON line with the minimum gain. Targets: every gain >= +20 points,
each chain <= 15 CPU minutes.

The chain's own accuracies are measured on the held-out prompts the runs also select on (SFT stops
there, PPO keeps its best evaluation there). So each output is scored again on the eval rows no
step ever saw ("test"), and the gain is judged on those.

``--repeat`` runs the first seed twice into two folders and checks that the second run reproduces
the first's numbers and weights (same command, seed and machine). ``--rule-reward``: the rule
itself as PPO's reward (no reward model), the sanity run.

    python bench/rlhf_quality.py                   # seed 42, the chain `make run` runs
    python bench/rlhf_quality.py --seeds 1 2 3     # the seed table
    python bench/rlhf_quality.py --seeds 1 --repeat
    python bench/rlhf_quality.py --rule-reward pipeline.ppo.step.epochs=1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def test_prompts(schema) -> list[str]:
    """Eval prompts of the blend that no step evaluates on (the steps use data.max_eval_samples of them)."""
    from datasets import load_dataset

    from rlhf.data.blend import DataReport, load_step_data
    from rlhf.models import load_tokenizer, resolve_path

    tokenizer = load_tokenizer(resolve_path(schema.model))
    _, used = load_step_data(schema.data, "ppo", DataReport(), tokenizer)
    seen = set(used["prompt"])
    folder = Path(schema.data.sources[0].path)
    (eval_file,) = [f for f in (folder / "eval.jsonl", folder / "eval.json") if f.exists()]
    rows = load_dataset("json", data_files=str(eval_file), split="train")
    return sorted({p for p in rows["prompt"] if p not in seen})


def test_accuracy(model_dir: Path, prompts: list[str], max_new_tokens: int, rule=None) -> float:
    """Greedy answers of a saved model (plain transformers) scored by ``rule`` (default: the shipped tasks')."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.synthetic import rule_score

    rule = rule or rule_score

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    right = 0.0
    for i in range(0, len(prompts), 128):
        batch = prompts[i:i + 128]
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        right += sum(rule(p, a) for p, a in zip(batch, answers, strict=True))
    return right / len(prompts)


def run_chain(seed: int, out: Path, args) -> dict:
    from rlhf.config import compose_config, load_run_config
    from rlhf.launch import run

    overrides = ["pipeline=e2e", "logging.progress_bar=false", f"seed={seed}", *args.overrides, f"run_dir={out}"]
    if args.rule_reward:
        # The chain's own PPO settings stay; the rule replaces the reward model on top of them.
        overrides += ["pipeline.ppo.step.reward_fn=rule", "pipeline.ppo.step.reward_model_weight=0",
                      "pipeline.steps=[sft,ppo]"]
    from rlhf.chain.readiness import RUN_ANYWAY
    from rlhf.errors import ConfigError

    cfg = compose_config(overrides)
    start = time.perf_counter()
    try:
        run(cfg, overrides=overrides)
    except ConfigError as err:  # the chain refused a step: a row of the table, and the next seed runs
        if RUN_ANYWAY not in str(err):
            raise
        return {"seed": seed, "refused": str(err), "wall_s": round(time.perf_counter() - start, 1)}
    wall = time.perf_counter() - start
    ppo = json.loads((out / "ppo" / "final_metrics.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [json.loads(line) for line in open(out / "ppo" / "metrics.jsonl") if '"kl"' in line]
    ppo_cfg = load_run_config(out / "ppo" / "config.yaml")  # the PPO step exactly as it ran
    prompts, max_new = test_prompts(ppo_cfg), ppo_cfg.step.max_new_tokens
    result = {
        "seed": seed,
        "sft": round(ppo["eval/accuracy_before"], 4),
        "ppo_output": round(ppo["eval/accuracy"], 4),
        "ppo_last": round(ppo.get("eval/accuracy_last", ppo["eval/accuracy"]), 4),
        "best_step": ppo.get("best_step", ppo["step"]),
        "test_prompts": len(prompts),
        "test_sft": round(test_accuracy(out / "sft" / "model", prompts, max_new), 4),
        "test_ppo": round(test_accuracy(out / "ppo" / "model", prompts, max_new), 4),
        "kl_last10": round(statistics.mean(r["kl"] for r in rows[-10:]), 3),
        "warnings": len(ppo.get("warnings", [])),
        "wall_s": round(wall, 1),
        "model_sha": hashlib.sha256((out / "ppo" / "model" / "model.safetensors").read_bytes()).hexdigest()[:12],
    }
    result["gain_points"] = round(100 * (result["test_ppo"] - result["test_sft"]), 1)
    if not args.rule_reward:
        result["rm_heldout_acc"] = round(manifest["steps"]["reward"]["metrics"]["eval/acc"], 4)
        if "select/policy_rm_auc_before" in ppo:
            result["rm_policy_auc"] = round(ppo["select/policy_rm_auc_before"], 4)
    return result


COLUMNS = ("seed", "sft", "ppo_output", "ppo_last", "best_step", "test_sft", "test_ppo", "gain_points", "kl_last10",
           "rm_heldout_acc", "rm_policy_auc", "warnings", "wall_s")


def table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "-")) for c in COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42], help="one chain per seed (default: 42)")
    ap.add_argument("--repeat", action="store_true", help="run the first seed twice and compare the two")
    ap.add_argument("--rule-reward", action="store_true", help="PPO rewarded by the rule instead of the reward model")
    ap.add_argument("--out", type=Path, help="keep the chains here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every chain")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        runs = [(s, out / f"seed{s}") for s in args.seeds]
        if args.repeat:
            runs.append((args.seeds[0], out / f"seed{args.seeds[0]}_again"))
        results = [run_chain(seed, folder, args) for seed, folder in runs]
    print(table(results))
    for r in results:
        if "refused" in r:
            print(f"seed {r['seed']}: {r['refused']}")
    gains = [r.get("gain_points", 0.0) for r in results]  # a refused chain gained nothing
    summary = {"reward": "rule" if args.rule_reward else "reward model", "seeds": args.seeds,
               "min_gain_points": min(gains), "mean_gain_points": round(statistics.mean(gains), 1),
               "refused": [r["seed"] for r in results if "refused" in r],
               "max_wall_s": max(r["wall_s"] for r in results), "target_gain_points": 20, "rows": results}
    if args.repeat:
        a, b = results[0], results[-1]
        summary["reproduced"] = all(a[k] == b[k] for k in a if k != "wall_s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
