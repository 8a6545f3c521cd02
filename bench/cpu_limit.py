"""How close each phase of the RL step runs to what this CPU can do.

First the machine's own limits, measured here: the rate of ``torch.nn.functional.linear`` at the
model's own layer shapes (every linear of its decoder layers and its vocabulary head, from the model's
config) at the row counts each phase feeds them -- one row per sequence in a decoding step, every
position of the batch in the scoring forwards and the updates -- in fp32 and bf16, with 1 thread and
with every core; the memory bandwidth (STREAM's triad); and torch's fused AdamW over as many
parameters as the model has (the runner's optimizer: its floor). Then GRPO steps of the real runner
(`python launch.py step=ppo ...`, against the rule, no critic) on the model, and each phase's
achieved rate from the step's own figures (``generate_tflops``, ``scoring_tflops``,
``update_tflops``: the matrix-product FLOPs of the work done, rlhf.runners.ppo.phase_flops) as a share
of the ceiling at its shapes; the last step is profiled (``logging.profile_step``) for the
optimizer's time against its floor and for the share of the step spent outside the model's
arithmetic (copies and casts, cache writes, and the host's own time between operators).

A decoding step reads every weight once: at small batches the bandwidth floor (weights' bytes /
bandwidth) binds before the matmul rate; the table says which floor binds at the run's batch.

    python bench/cpu_limit.py                                         # tiny-llama and SmolLM2-135M, 1 and 2 threads
    python bench/cpu_limit.py --models smollm2-135m-instruct --threads 2 --steps 3

Prints a markdown table per model and one JSON line. SmolLM2 needs `make real-model`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUIET = ["logging.progress_bar=false", "resume=never"]
# Each model's GRPO step: the real model as the RLVR preset trains it (64 rollouts of up to 32 tokens,
# from the instruct model); the tiny one from a short SFT of its random start, on the shipped task.
GRPO = ["step.advantage_estimator=grpo", "step.reward_fn=rule", "step.reward_model_weight=0",
        "step.eval_every_steps=0", "step.eval_prompts=8", "step.eval_micro_batch_size_per_device=8"]
MODELS = {
    "tiny-llama": {"model": ["model=tiny-llama"], "sft": True,
                   "ppo": ["step.samples_per_prompt=4", "step.rollout_batch_size_per_device=32",
                           "step.micro_batch_size_per_device=16"]},
    "smollm2-135m-instruct": {"model": ["model=smollm2-135m-instruct", "data=arithmetic",
                                        "+stage=[smollm2-135m-instruct_rlvr-cpu/ppo]"], "sft": False, "ppo": []},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_rate(sizes, layer_rows: int, head_rows: int, dtype: torch.dtype, threads: int,
                budget_s: float = 1.0) -> float:
    """FLOP/s of the model's matrix products: each distinct linear of its layers at ``layer_rows`` rows
    and the head at ``head_rows``, timed on random operands, weighted as often as the model runs them;
    total FLOPs over total time."""
    torch.set_num_threads(threads)
    counts: dict[tuple[int, int], int] = {}
    for _, fan_in, fan_out in sizes.layer_linears:
        counts[(fan_in, fan_out)] = counts.get((fan_in, fan_out), 0) + 1
    shapes = [(i, o, layer_rows, n) for (i, o), n in counts.items()] + [(sizes.hidden_size, sizes.vocab_size,
                                                                           head_rows, 1)]
    flops = seconds = 0.0
    with torch.no_grad():
        for fan_in, fan_out, rows, times in shapes:
            x, w = torch.randn(rows, fan_in, dtype=dtype), torch.randn(fan_out, fan_in, dtype=dtype)
            # Into one output tensor: the products' own rate, not a fresh output's first-touch page faults.
            y = torch.empty(rows, fan_out, dtype=dtype)
            torch.matmul(x, w.t(), out=y)  # first call: the library picks its kernel
            n, start = 0, time.perf_counter()
            while n < 3 or time.perf_counter() - start < budget_s / len(shapes):
                torch.matmul(x, w.t(), out=y)
                n += 1
            flops += 2 * rows * fan_in * fan_out * times
            seconds += (time.perf_counter() - start) / n * times
    return flops / seconds


def bandwidth(threads: int, mib: int = 512) -> float:
    """Bytes/s of STREAM's triad (c = a + 2 b over ``mib`` MiB arrays; two reads and a write counted):
    the best of 5."""
    torch.set_num_threads(threads)
    a, b = torch.ones(mib * 2**20 // 4), torch.ones(mib * 2**20 // 4)
    c = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.add(a, b, alpha=2.0, out=c)
        best = min(best, time.perf_counter() - start)
    return 3 * a.numel() * 4 / best


def adamw_ms(params: int, threads: int) -> float:
    """Milliseconds of torch's fused AdamW (the runner's optimizer on CPU) over ``params`` fp32 parameters in
    one tensor: the fastest this machine steps that many, the best of 3."""
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.ones(params))
    p.grad = torch.ones(params)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run_grpo(name: str, threads: int, steps: int, out: Path) -> tuple[list[dict], dict]:
    """The runner's GRPO steps (the first is a warm-up) and the profile of the last."""
    spec = MODELS[name]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    base = [sys.executable, "launch.py", *spec["model"], f"hardware.torch_threads={threads}", *QUIET]
    actor = []
    if spec["sft"]:
        sft = out / "sft"
        if not (sft / "model").exists():
            subprocess.run([*base, "step=sft", "step.max_steps=40", f"run_dir={sft}"], cwd=ROOT, env=env, check=True,
                           capture_output=True)
        actor = [f"actor.path={sft / 'model'}"]
    run_dir = out / f"grpo_{threads}t"
    done = subprocess.run([*base, "step=ppo", *GRPO, *spec["ppo"], *actor, f"step.max_steps={steps}",
                           f"logging.profile_step={steps}", f"run_dir={run_dir}"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: the GRPO run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in rows if "generate_tflops" in r], json.loads((run_dir / "profile" / "summary.json").read_text())


def measure(name: str, threads: int, steps: int, precision: str, out: Path) -> dict:
    from rlhf.config import compose_config, to_schema
    from rlhf.models import model_sizes

    cfg = to_schema(compose_config([*MODELS[name]["model"], "step=ppo", *GRPO, *MODELS[name]["ppo"]]))
    sizes, step = model_sizes(cfg.model), cfg.step
    rows, width, answer = step.rollout_batch_size_per_device, step.max_prompt_len + step.max_new_tokens, step.max_new_tokens
    # Rows per product: the rollout batch (or its generation chunks) when generating and scoring, a
    # micro batch in the updates; at most max_prompt_len + max_new_tokens positions each.
    scored, micro = step.generation_batch_size_per_device or rows, step.micro_batch_size_per_device
    logged, profile = run_grpo(name, threads, steps, out / name)
    measured = logged[1:] or logged  # the first step warms the allocator and the kernels' choices
    dtype = DTYPES[precision]
    # The ceilings at each phase's shapes: a decoding step feeds one row per sequence; the scoring
    # forwards and the updates every position of the batch (the head on the answer's only).
    decode_peak = matmul_rate(sizes, scored, scored, dtype, threads)
    scoring_peak = matmul_rate(sizes, scored * width, scored * answer, dtype, threads)
    update_peak = matmul_rate(sizes, micro * width, micro * answer, dtype, threads)
    # The other precision's rate at the update's shapes: what a switch of hardware.precision could gain.
    other = "bf16" if precision == "fp32" else "fp32"
    update_other = matmul_rate(sizes, micro * width, micro * answer, DTYPES[other], threads)
    memory, optimizer_floor = bandwidth(threads), adamw_ms(sizes.params, threads)
    weight_bytes = sizes.params * dtype.itemsize
    decode_flops = 2 * scored * (sizes.layer_params + sizes.head_params)
    median = {k: statistics.median(r[k] for r in measured) for k in
              ("generate_tflops", "scoring_tflops", "update_tflops", "tflops", "step_s", "generate_s", "train_s")}
    wall = profile["wall_ms"]
    kinds = profile["by_kind_ms"]
    optimizer_ms = kinds.get("optimizer", 0.0)
    outside = profile["idle_ms"] + kinds.get("copy_cast", 0.0) + kinds.get("cache_write", 0.0)
    return {
        "model": name, "threads": threads, "precision": precision, "rows": rows, "width": width,
        "matmul_gflops_decode": round(decode_peak / 1e9, 1), "matmul_gflops_scoring": round(scoring_peak / 1e9, 1),
        "matmul_gflops_update": round(update_peak / 1e9, 1), f"matmul_gflops_update_{other}": round(update_other / 1e9, 1),
        "bandwidth_gbs": round(memory / 1e9, 1),
        # Which floor binds a decoding step at this batch: its FLOPs at the matmul rate, or its weights' bytes.
        "decode_floor_ms": {"compute": round(decode_flops / decode_peak * 1e3, 2),
                            "memory": round(weight_bytes / memory * 1e3, 2)},
        "generate_share": round(median["generate_tflops"] * 1e12 / decode_peak, 3),
        "scoring_share": round(median["scoring_tflops"] * 1e12 / scoring_peak, 3),
        "update_share": round(median["update_tflops"] * 1e12 / update_peak, 3),
        "optimizer_ms": round(optimizer_ms, 1), "optimizer_floor_ms": round(optimizer_floor, 1),
        "optimizer_share": round(optimizer_floor / optimizer_ms, 3) if optimizer_ms else None,
        "outside_model_share": round(outside / wall, 3), "host_idle_share": round(profile["idle_ms"] / wall, 3),
        "profile_kinds_ms": {k: round(v, 1) for k, v in kinds.items()}, "profile_wall_ms": round(wall, 1),
        "step_s": round(median["step_s"], 2), "tflops": round(median["tflops"], 4), "steps_measured": len(measured),
    }


def table(results: list[dict]) -> str:
    lines = ["| model | threads | matmul GFLOP/s decode / scoring / update | triad GB/s | decode step floor ms, "
             "compute / memory | generation | scoring | update | optimizer ms (floor) | outside the model's "
             "arithmetic (host) | step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        floor = r["decode_floor_ms"]
        opt = f"{r['optimizer_ms']} ({r['optimizer_floor_ms']})" if r["optimizer_ms"] else "-"
        lines.append(f"| {r['model']} | {r['threads']} | {r['matmul_gflops_decode']} / {r['matmul_gflops_scoring']} / "
                     f"{r['matmul_gflops_update']} | {r['bandwidth_gbs']} | {floor['compute']} / {floor['memory']} | "
                     f"{r['generate_share']:.0%} | {r['scoring_share']:.0%} | {r['update_share']:.0%} | {opt} | "
                     f"{r['outside_model_share']:.0%} ({r['host_idle_share']:.0%}) | {r['step_s']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, os.cpu_count() or 1])
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run; the first is a warm-up, the last profiled")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="cpu_limit_"))
    from rlhf.preflight.probes import cpu_bf16

    results = [measure(m, t, args.steps, "fp32", out) for m in args.models for t in sorted(set(args.threads))]
    print(table(results))
    print(json.dumps({"cpu_bf16": cpu_bf16(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "results": results}))


if __name__ == "__main__":
    main()
