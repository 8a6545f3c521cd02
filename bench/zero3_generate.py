"""Rollout generation under ZeRO-3 against ZeRO-0, 2 CPU ranks, same model and lengths.

Runs the real PPO runner (bench/ppo_step.py's setting: a random OPT h256 x 4 layers, 4 prompts per
rank of 64 tokens, 64 sampled tokens, eos suppressed, bf16) through the DeepSpeed launcher on 2 CPU
ranks, at ZeRO-0 and at ZeRO-3 in each way of generating (``step.zero3_generation``: the actor
gathered whole, in tensor-parallel slices over both ranks, layer by layer), and prints one JSON line
per launch with the per-phase medians, alternating the settings over --rounds launches, then each
ZeRO-3 way's median generation time over ZeRO-0's (target for gather, the pre-flight's choice for
this model: <= 1.2).

    python bench/zero3_generate.py
    python bench/zero3_generate.py --steps 10 --rounds 5 --ways gather tp
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ppo_step import MODEL, runner_step_times  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per stage (after 2 warm-up steps)")
    ap.add_argument("--rounds", type=int, default=3, help="launches per setting, alternating them")
    ap.add_argument("--ways", nargs="+", default=["gather"], choices=["gather", "tp", "layerwise"],
                    help="ZeRO-3 ways of generating to measure against ZeRO-0")
    args = ap.parse_args()
    from rlhf.preflight.probes import cpu_bf16

    # Two ranks on a 2-core machine drift by 20-30% between launches (seen: ZeRO-0 generation at
    # 0.30 s in one launch and 0.45 s in the next, same code): the settings alternate over rounds and
    # the ratio is that of the medians over rounds, so that a slow spell does not land on one setting.
    settings = {"zero0": ["zero=0"], **{f"zero3 {way}": ["zero=3", f"step.zero3_generation={way}"] for way in args.ways}}
    gen = {name: [] for name in settings}
    for round_ in range(args.rounds):
        for name, overrides in settings.items():
            med, _, _ = runner_step_times(MODEL, args.steps, overrides=[
                "hardware=cpu-2rank", *overrides, f"launch.master_port={free_port()}"])
            gen[name].append(med["generate_s"])
            print(json.dumps({"round": round_, "setting": name, "ranks": 2, **{k: round(v, 4) for k, v in med.items()}}),
                  flush=True)
    median = {name: statistics.median(times) for name, times in gen.items()}
    print(json.dumps({**{f"{name} over zero0 generate": round(median[name] / median["zero0"], 3)
                         for name in settings if name != "zero0"},
                      "target_gather": 1.2, "rounds": args.rounds, "cpu_bf16": cpu_bf16()}))


if __name__ == "__main__":
    main()
