"""Kill it anywhere: a chain (SFT -> reward model -> PPO at tiny scale, 2 CPU ranks, ZeRO-3,
checkpoints every few steps) run once to its end, then once more per point, killed with SIGKILL at a
moment drawn from a seeded generator over the uninterrupted run's wall time -- one rank, every rank,
or the launching process, drawn too -- and rerun with the same command until it finishes. Each
point's final weights (every step's model/, model_last/ and critic/) are compared bitwise with the
uninterrupted run's, and its metrics.jsonl for logged steps that appear twice or are missing.

    python bench/kill_matrix.py --points 12 --seed 1     # one JSON line; about 2 min a point on 2 cores

Where each kill landed is read from the killed process's Python stack (py-spy, `pip install
py-spy`; without it, from the run folder's files): the chain step and its phase (start-up, rollout,
update, evaluation, checkpoint write, HF save, pairs drawn from the policy, chain bookkeeping). A
point whose rerun differs keeps its folder under --out for inspection.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("sft", "reward", "ppo")
CHAIN = ["pipeline=e2e", "hardware=cpu-2rank", "zero=3", "logging.progress_bar=false", "data.max_eval_samples=32",
         "pipeline.on_weak_step=warn", "checkpoint.every_steps=4",
         "pipeline.sft.step.max_steps=16", "pipeline.sft.step.eval_every_steps=8",
         "pipeline.reward.step.max_steps=16", "pipeline.reward.step.policy_pairs_prompts=32",
         "pipeline.ppo.step.max_steps=6", "pipeline.ppo.step.rollout_batch_size_per_device=16",
         "pipeline.ppo.step.micro_batch_size_per_device=8", "pipeline.ppo.step.eval_prompts=16",
         "pipeline.ppo.step.eval_every_steps=3", "pipeline.ppo.step.early_stop_patience=0"]
# A phase, by the innermost of these functions on the killed rank's stack.
PHASES = {"draw": "curves redraw", "refresh": "curves redraw", "save_hf_model": "HF save", "_ema_save": "HF save",
          "save": "checkpoint write", "save_checkpoint": "checkpoint write", "policy_pairs": "pairs from the policy",
          "policy_check": "PPO start check", "group_signal": "PPO start check", "make_experience": "rollout",
          "ppo_update": "update", "rule_check": "evaluation", "evaluate": "evaluation", "full_eval": "evaluation",
          "mean_eval": "evaluation", "optimize": "update", "micro_step": "update", "train": "training",
          "finish": "HF save", "build_prompts": "start-up", "load_step_data": "start-up", "train_engine": "start-up",
          "init_distributed": "start-up", "load_run_config": "start-up", "main_steps": "between steps"}


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "launch.py", *CHAIN, f"run_dir={run_dir}"]


def env() -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT")}
    return {**keep, "PYTHONUNBUFFERED": "1"}


def run_to_end(run_dir: Path, log, tries: int = 4) -> tuple[float, int]:
    """Run (or rerun) the chain until it exits 0; its wall time and how many launches it took."""
    start = time.monotonic()
    for n in range(1, tries + 1):
        if subprocess.run(command(run_dir), cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT).returncode == 0:
            return time.monotonic() - start, n
    raise RuntimeError(f"{run_dir}: the chain did not finish in {tries} launches (log: {log.name})")


def ranks_of(proc: psutil.Process) -> list[psutil.Process]:
    """The rank processes of a launch (``python -u -m rlhf.worker``), not the launcher's own."""
    def is_rank(p: psutil.Process) -> bool:
        cmd = p.cmdline()
        return any(a == "-m" and b == "rlhf.worker" for a, b in zip(cmd, cmd[1:], strict=False))

    try:
        return [c for c in proc.children(recursive=True) if is_rank(c)]
    except psutil.Error:
        return []


def stack_phase(pid: int) -> str | None:
    """The phase a rank is in, from its Python stack, innermost frame first (None without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return None
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        return None
    frames = [line.split()[0].split(".")[-1] for line in out.splitlines() if line.startswith("    ") and line.split()]
    return next((PHASES[f] for f in frames if f in PHASES), "start-up")


def file_phase(run_dir: Path) -> tuple[str, str]:
    """The chain step a kill landed in and a phase from the run folder: the first step not finished."""
    for name in STEPS:
        d = run_dir / name
        if not (d / "final_metrics.json").exists():
            if not (d / "metrics.jsonl").exists():
                return name, "start-up"
            if (d / "model").exists():
                return name, "HF save"
            return name, "training"
    return "-", "chain bookkeeping"


def logged_steps(metrics: Path) -> list[int]:
    """The training steps a metrics.jsonl logged (lines with a loss), in order."""
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "loss" in r or "policy_loss" in r]


def weights(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(f.relative_to(run_dir)): load_file(str(f)) for f in sorted(run_dir.glob("*/*/model.safetensors"))}


def compare(base: Path, run: Path) -> dict:
    wa, wb = weights(base), weights(run)
    identical = wa.keys() == wb.keys() and all(
        wa[f].keys() == wb[f].keys() and all(torch.equal(wa[f][k], wb[f][k]) for k in wa[f]) for f in wa)
    diff = max((float((wa[f][k].float() - wb[f][k].float()).abs().max()) for f in wa if f in wb for k in wa[f]
                if k in wb[f]), default=float("nan"))
    duplicated = missing = 0
    for name in STEPS:
        a, b = logged_steps(base / name / "metrics.jsonl"), logged_steps(run / name / "metrics.jsonl")
        duplicated += len(b) - len(set(b))
        missing += len(set(a) - set(b))
    return {"identical": identical, "max_abs_diff": diff, "files": sorted(wb), "duplicated_steps": duplicated,
            "missing_steps": missing}


def kill_point(run_dir: Path, at_s: float, target: str, log) -> dict:
    """Start the chain, kill ``target`` (one_rank, every_rank, launcher) at ``at_s`` seconds, wait for
    what is left of it to exit, and return where the kill landed."""
    start = time.monotonic()
    proc = psutil.Popen(command(run_dir), cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    while time.monotonic() - start < at_s and proc.poll() is None:
        time.sleep(0.05)
    if proc.poll() is not None:
        return {"at_s": round(at_s, 1), "signal": target, "step": "-", "phase": "after the end", "killed": False}
    ranks = ranks_of(proc)
    step, phase = file_phase(run_dir)
    victims = {"one_rank": ranks[-1:], "every_rank": ranks, "launcher": [proc]}[target] or [proc]
    # Before the ranks start (and after they end) the launching process is the chain's bookkeeping.
    phase = (stack_phase(ranks[0].pid) if ranks else "chain bookkeeping" if step == "-" else None) or phase
    tree = [proc, *proc.children(recursive=True)]
    for v in victims:
        try:
            v.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    killed_at = time.monotonic()
    # The user's rerun comes right away, while what is left of the killed launch may still be running
    # (its launcher's ranks, or the ranks of a killed launcher): how long that lingers is measured
    # beside the rerun, and whatever still runs once the rerun has finished is killed and reported.
    lingered = {}

    def watch() -> None:
        psutil.wait_procs(tree, timeout=600)
        lingered["s"] = round(time.monotonic() - killed_at, 1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return {"at_s": round(at_s, 1), "signal": target, "step": step, "phase": phase, "killed": True,
            "_tree": tree, "_watcher": watcher, "_lingered": lingered}


def settle(point: dict) -> dict:
    """After the rerun: what was left of the killed launch, how long it lived on."""
    tree, watcher, lingered = point.pop("_tree", []), point.pop("_watcher", None), point.pop("_lingered", {})
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    if watcher is not None:
        watcher.join(timeout=30)
    point["left_running_after_rerun"] = len(left)
    point["lingered_s"] = lingered.get("s")
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kill_matrix"))
    parser.add_argument("--signals", default="one_rank,every_rank,launcher",
                        help="what a kill may hit, drawn per point: one_rank, every_rank, launcher")
    args = parser.parse_args()
    out = args.out / f"seed{args.seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with open(out / "base.log", "w") as log:
        base_s, _ = run_to_end(out / "base", log)
    rng = random.Random(args.seed)
    points = []
    for i in range(args.points):
        at_s = rng.uniform(0.0, base_s)
        target = rng.choice(args.signals.split(","))
        run_dir = out / f"point{i}"
        with open(out / f"point{i}.log", "w") as log:
            started = time.monotonic()
            point = kill_point(run_dir, at_s, target, log)
            _, launches = run_to_end(run_dir, log)
            settle(point)
            point["extra_s"] = round(time.monotonic() - started - base_s, 1)
            point["launches"] = launches
        point.update(compare(out / "base", run_dir))
        points.append(point)
        print(json.dumps({"point": i, **point}), file=sys.stderr, flush=True)
        if point["identical"] and not point["duplicated_steps"] and not point["missing_steps"]:
            shutil.rmtree(run_dir)
    print(json.dumps({"seed": args.seed, "base_s": round(base_s, 1), "points": points,
                      "identical": sum(p["identical"] and not p["duplicated_steps"] and not p["missing_steps"]
                                       for p in points),
                      "killed": sum(p["killed"] for p in points),  # the others came after the run's end
                      "phases": sorted({p["phase"] for p in points if p["killed"]})}))


if __name__ == "__main__":
    main()
