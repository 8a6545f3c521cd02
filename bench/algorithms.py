"""Which alignment algorithm learns the shipped task, side by side: PPO (GAE with a critic), GRPO,
RLOO, REINFORCE++ -- each with the reward model and with the rule as the reward -- DPO, SimPO, ORPO and KTO (the pairs split into unpaired rows), all from
the same SFT start (and the same reward model), with the same budget of PPO steps and rollouts.

Each method is one `python launch.py` run of the chain's own PPO stage (conf/stage/e2e/ppo.yaml) with
step.advantage_estimator (and step.samples_per_prompt=4 for the group methods, so every method sees
128 rollouts per step) or of step=dpo on the reward part's pairs. Each output is then scored by the
rule on the held-out prompts no step ever evaluated on (as bench/rlhf_quality.py does). Prints a
markdown table (test accuracy before/after, gain, wall time, final KL to the reference, critic or
not), writes it with a PNG and a JSON file into --out, and prints one JSON line. A run already
finished in --out by an earlier invocation is reused with its wall time. Targets (the issue):
DPO >= SFT + 20 points; every RL estimator >= SFT + 20 with the reward model, >= SFT + 25 with the rule.

    python bench/algorithms.py                                   # builds its SFT start and reward model
    python bench/algorithms.py --chain runs/e2e/tiny-llama_synthetic-sort_seed42 --steps 375 --jobs 2
    python bench/algorithms.py --methods grpo rloo --rewards rule
    python bench/algorithms.py --methods dpo ipo --dpo step.beta=0.1
    python bench/algorithms.py --task rlvr --methods grpo grpo_dynamic gspo --rewards rule   # pipeline=rlvr's task

``--task rlvr`` runs the critic-free methods against the rule on pipeline=rlvr's task (synthetic-numbers:
prompts with reference answers and no preference pairs) from that chain's own SFT start, each over the
chain's GRPO stage (conf/stage/rlvr/ppo.yaml) with the method's overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Each RL method: its overrides of the PPO step. Group methods sample 4 answers per prompt, so the
# rollouts per step (128) and hence the compute budget stay those of PPO.
METHODS = {
    "ppo": ["step.advantage_estimator=gae"],
    "grpo": ["step.advantage_estimator=grpo", "step.samples_per_prompt=4"],
    "dr_grpo": ["step.advantage_estimator=dr_grpo", "step.samples_per_prompt=4"],
    "rloo": ["step.advantage_estimator=rloo", "step.samples_per_prompt=4"],
    "reinforce_pp": ["step.advantage_estimator=reinforce_pp"],
    "reinforce_pp_baseline": ["step.advantage_estimator=reinforce_pp_baseline", "step.samples_per_prompt=4"],
    # GRPO's advantages with the field's later additions, one at a time: DAPO's clip-higher and dynamic
    # sampling, the GSPO and CISPO objectives, and TIS (a no-op where sampler and trainer agree, as in fp32).
    "grpo_clip_higher": ["step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.clip_eps_high=0.28"],
    "ppo_clip_higher": ["step.advantage_estimator=gae", "step.clip_eps_high=0.28"],
    "grpo_dynamic": ["step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.dynamic_sampling=true"],
    "gspo": ["step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.policy_loss=gspo"],
    "cispo": ["step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.policy_loss=cispo"],
    "grpo_tis": ["step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.rollout_correction=tis"],
}
REWARDS = {"rm": [], "rule": ["step.reward_fn=rule", "step.reward_model_weight=0"]}
# DPO variants over the chain's DPO stage (conf/stage/e2e/dpo.yaml): plain DPO, with RPO's NLL term
# on the chosen answers, and IPO.
# SimPO, reference-free, and KTO over their own chain stages (conf/stage/e2e/simpo.yaml, kto.yaml);
# ORPO (reference-free) with its step file's settings. Name -> (step, stage files, overrides).
DPO_VARIANTS = {"dpo": ("dpo", ["e2e/dpo"], []), "dpo_rpo": ("dpo", ["e2e/dpo"], ["step.nll_coef=1"]),
                "ipo": ("dpo", ["e2e/dpo"], ["step.loss=ipo"]), "simpo": ("simpo", ["e2e/simpo"], []),
                "orpo": ("orpo", [], []), "kto": ("kto", ["e2e/kto"], [])}
TARGETS = {"dpo": 20.0, "rm": 20.0, "rule": 25.0}


def launch(args: list[str], log: Path) -> float:
    """One `python launch.py` run; its wall time. Raises with the log's tail if it fails."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise RuntimeError(f"launch.py {' '.join(args)} failed:\n" + log.read_text()[-3000:])
    return time.perf_counter() - start


# Per task: the chain that builds the start (and its steps), the PPO stage every RL method runs over.
TASKS = {"sort": ("e2e", "[sft,reward]", "e2e/ppo"), "rlvr": ("rlvr", "[sft]", "rlvr/ppo")}


def start_models(args) -> tuple[Path, Path]:
    """The SFT start and the reward model: a chain's (--chain), or built with the task's chain's stages
    (the rlvr task has no reward model)."""
    chain = args.chain or args.out / "chain"
    pipeline, steps, _ = TASKS[args.task]
    if not args.chain:
        launch([f"pipeline={pipeline}", f"pipeline.steps={steps}", f"seed={args.seed}", "logging.progress_bar=false",
                f"run_dir={chain}"], args.out / "chain.log")
    return chain / "sft" / "model", chain / "reward" / "model"


def run_one(name: str, reward: str, sft: Path, rm: Path, args) -> dict:
    run_dir = args.out / f"{name}_{reward}"
    common = [f"seed={args.seed}", "logging.progress_bar=false", f"run_dir={run_dir}", f"actor.path={sft}"]
    if name in DPO_VARIANTS:
        step, stages, variant = DPO_VARIANTS[name]
        overrides = [f"step={step}", *([f"+stage=[{','.join(stages)}]"] if stages else []), *common, *variant, *args.dpo]
    else:
        critic = [f"critic.path={rm}"] if args.task == "sort" else []
        overrides = ["step=ppo", f"+stage=[{TASKS[args.task][2]}]", *common, *critic, f"step.max_steps={args.steps}",
                     *METHODS[name], *REWARDS[reward]]
    timing = run_dir / "bench_wall_s.json"
    if timing.exists() and (run_dir / "final_metrics.json").exists():  # finished by an earlier invocation
        wall = json.loads(timing.read_text())
    else:
        wall = launch(overrides, args.out / f"{name}_{reward}.log")
        timing.write_text(json.dumps(wall))
    final = json.loads((run_dir / "final_metrics.json").read_text())
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    kl = [r["kl_k1"] for r in rows if "kl_k1" in r]
    return {"method": name, "reward": reward, "wall_s": round(wall, 1), "model": str(run_dir / "model"),
            "final_kl": round(sum(kl[-10:]) / len(kl[-10:]), 3) if kl else None,
            "critic": (run_dir / "critic").exists(), "steps": final["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_algorithms", help="runs, table and plot")
    ap.add_argument("--chain", type=Path, help="a finished chain folder whose sft/ and reward/ outputs to start from")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=375, help="PPO steps of 128 rollouts for every RL method")
    ap.add_argument("--methods", nargs="+", default=["ppo", "grpo", "rloo", "reinforce_pp", "dpo", "dpo_rpo", "simpo",
                                                      "orpo", "kto"],
                    choices=[*METHODS, *DPO_VARIANTS])
    ap.add_argument("--rewards", nargs="+", default=["rm", "rule"], choices=list(REWARDS))
    ap.add_argument("--dpo", nargs="*", default=[], help="extra overrides of the DPO run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (wall times then share the CPU)")
    ap.add_argument("--task", choices=list(TASKS), default="sort",
                    help="sort: the shipped task of the default chain; rlvr: pipeline=rlvr's (the rule only)")
    args = ap.parse_args()
    if args.task == "rlvr":
        # No reward model and no pairs there: the critic-free methods against the rule.
        unfit = [m for m in args.methods if m in DPO_VARIANTS or "gae" in " ".join(METHODS[m])]
        if unfit or args.rewards != ["rule"]:
            ap.error(f"--task rlvr takes critic-free methods with --rewards rule only (not {unfit or args.rewards})")
    args.out.mkdir(parents=True, exist_ok=True)

    from bench.rlhf_quality import test_accuracy, test_prompts
    from rlhf.config import load_run_config
    from rlhf.data.blend import data_rule
    from rlhf.models import load_tokenizer

    sft, rm = start_models(args)
    todo = [(m, r) for m in args.methods if m in METHODS for r in args.rewards]
    todo += [(m, "pairs") for m in args.methods if m in DPO_VARIANTS]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job, sft, rm, args), todo))

    cfg = load_run_config(Path(results[0]["model"]).parent / "config.yaml")
    prompts = test_prompts(cfg)
    max_new = cfg.step.max_new_tokens
    # The data's own rule (the rlvr task's `math` reads each prompt's reference answer).
    rule = data_rule(cfg.data, prompts, load_tokenizer(str(sft)))
    before = test_accuracy(sft, prompts, max_new, rule)
    for r in results:
        r["test_after"] = round(test_accuracy(Path(r["model"]), prompts, max_new, rule), 4)
        r["gain_points"] = round(100 * (r["test_after"] - before), 1)
        target = TARGETS["dpo" if r["reward"] == "pairs" else r["reward"]]
        r["target_met"] = r["gain_points"] >= target

    head = ("method", "reward", "test_sft", "test_after", "gain_points", "target_met", "final_kl", "critic",
            "steps", "wall_s")
    lines = [f"Held-out greedy accuracy by the rule on {len(prompts)} prompts no step evaluated on; SFT start "
             f"{before:.3f}; RL methods {args.steps} steps of 128 rollouts, seed {args.seed}, jobs {args.jobs}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str({**r, "test_sft": round(before, 4)}.get(c, "-")) for c in head) + " |"
              for r in results]
    table = "\n".join(lines)
    print(table)
    (args.out / "algorithms.md").write_text(table + "\n")
    (args.out / "algorithms.json").write_text(json.dumps({"test_sft": before, "results": results}, indent=2))
    plot(results, before, args.out / "algorithms.png", args.task)
    print(json.dumps({"test_sft": round(before, 4), "min_gain_rm": min((r["gain_points"] for r in results
                                                                       if r["reward"] == "rm"), default=None),
                      "min_gain_rule": min((r["gain_points"] for r in results if r["reward"] == "rule"), default=None),
                      "all_targets_met": all(r["target_met"] for r in results),
                      "table": str(args.out / "algorithms.md"), "plot": str(args.out / "algorithms.png")}))


def plot(results: list[dict], before: float, path: Path, task: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot needs the bench extra: pip install -e '.[bench]'
        print(f"no matplotlib: {path} not written (pip install -e '.[bench]')")
        return
    colors = {"rm": "tab:blue", "rule": "tab:green", "pairs": "tab:orange"}
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(results)), 4.5))
    labels = [f"{r['method'].replace('_', ' ')}\n{r['reward']}" for r in results]
    ax.bar(labels, [100 * r["test_after"] for r in results], color=[colors[r["reward"]] for r in results])
    ax.axhline(100 * before, color="black", linestyle="--", label=f"SFT start {100 * before:.1f}%")
    ax.set_ylabel("held-out accuracy by the rule (%)")
    ax.set_title(f"Alignment methods on the {task} task (same SFT start, same rollout budget)")
    ax.set_ylim(0, 110)
    ax.legend(loc="upper left", fontsize="small")
    ax.tick_params(axis="x", labelsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
