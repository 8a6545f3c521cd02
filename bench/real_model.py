"""A real pretrained model made measurably better on a CPU: run the RLVR preset on SmolLM2-135M-Instruct
(`make real-model` installs it), then score the instruct model it started from and the model it wrote
with plain transformers ``generate`` (greedy, the model's own chat template; not our decode loop) on
questions neither the run's training nor its held-out selection saw. Prints one JSON line: accuracy
before and after at the run's answer budget and at a long one, the gain in points, the run's wall time
and its dry-run forecast.

    python bench/real_model.py                                   # the demo: GRPO on two-digit sums
    python bench/real_model.py --data arithmetic-words           # the word problems ending '#### n'
    python bench/real_model.py --run-dir runs/rlvr/X --no-train  # score a finished run again
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASKS = {"arithmetic": False, "arithmetic-words": True}  # data option -> the words form


def test_rows(data: str, n: int) -> list[dict]:
    """``n`` questions of the task beyond its shipped train and eval rows (the generator deals pairs in
    one order, so rows past the shipped ones share no pair of numbers with them)."""
    from rlhf.data.synthetic import SIZES, generate_arithmetic

    n_train, n_eval = SIZES["words" if TASKS[data] else "arithmetic"]
    return generate_arithmetic(n_train, n_eval + n, 0, words=TASKS[data])["eval"][n_eval:]


@torch.no_grad()
def accuracy(folder: str, rows: list[dict], max_new_tokens: int, batch: int = 50) -> tuple[float, list[str]]:
    """Greedy accuracy by the math verifier, through transformers' AutoTokenizer, chat template and
    generate alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.rewards.verifiers import math_score

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    answers = []
    for i in range(0, len(rows), batch):
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for r in rows[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        answers += tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    right = [math_score(r["prompt"], a, r["answer"]) for r, a in zip(rows, answers, strict=True)]
    return sum(right) / len(rows), answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="smollm2-135m-instruct_rlvr-cpu")
    ap.add_argument("--data", default="arithmetic", choices=sorted(TASKS))
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--no-train", action="store_true", help="score the model already in --run-dir")
    ap.add_argument("--questions", type=int, default=150, help="at most 150: the pairs left after train and eval")
    ap.add_argument("--long-budget", type=int, default=128, help="a second answer budget, for answers the run's cuts")
    ap.add_argument("overrides", nargs="*", help="more launch.py overrides for the run")
    args = ap.parse_args()
    run_dir = args.run_dir or ROOT / "runs" / "bench-real-model" / args.data
    launch = [sys.executable, str(ROOT / "launch.py"), f"experiment={args.experiment}", f"data={args.data}",
              f"run_dir={run_dir}", "logging.progress_bar=false", *args.overrides]
    wall = None
    dry = subprocess.run([*launch, "launch.dry_run=true"], capture_output=True, text=True)
    totals = re.findall(r"^\s+total\s+([\d.]+) (s|min|h)\b", dry.stdout, re.M)
    forecast_s = sum(float(v) * {"s": 1, "min": 60, "h": 3600}[u] for v, u in totals) if totals else None
    if not args.no_train:
        start = time.perf_counter()
        subprocess.run(launch, check=True)
        wall = time.perf_counter() - start

    from rlhf.config import compose_config, to_schema
    from rlhf.models import resolve_path

    cfg = to_schema(compose_config([f"experiment={args.experiment}", f"data={args.data}", "step=ppo",
                                    f"+stage=[{args.experiment}/ppo]", *args.overrides]))
    rows = test_rows(args.data, args.questions)
    start_folder, end_folder = resolve_path(cfg.model), str(run_dir / "ppo" / "model")
    result = {"model": cfg.model.name, "data": args.data, "questions": len(rows), "cpu": _cpu()}
    for budget in (cfg.step.max_new_tokens, args.long_budget):
        before, _ = accuracy(start_folder, rows, budget)
        after, answers = accuracy(end_folder, rows, budget)
        result[f"budget_{budget}"] = {"start": round(before, 4), "end": round(after, 4),
                                      "gain_points": round(100 * (after - before), 1), "examples": answers[:3]}
    result.update(wall_min=round(wall / 60, 2) if wall else None,
                  dry_run_forecast_min=round(forecast_s / 60, 2) if forecast_s else None,
                  wall_over_forecast=round(wall / forecast_s, 3) if wall and forecast_s else None)
    print(json.dumps(result), flush=True)


def _cpu() -> str:
    from rlhf.preflight.probes import cpu_bf16

    return cpu_bf16()


if __name__ == "__main__":
    main()
