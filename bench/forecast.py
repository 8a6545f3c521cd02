"""The time and cost forecast (rlhf/preflight/forecast/) beside DeepSpeed-Chat's published figures and the
project's own GPU measurements, every cell with its ratio. No randomness, no network: the same
commit prints the same table.

Published figures: applications/DeepSpeed-Chat/README.md in microsoft/DeepSpeedExamples -- Table 1
(step 3, OPT-1.3B ... 175B actors with an OPT-350M critic and reward model, 1x V100 ... 64x
A100-80G) and the three end-to-end breakdowns (steps 1, 2 and 3 of OPT-1.3B on 1x A6000, OPT-13B on
8x A100-40G, OPT-66B on 64x A100-80G). Table 1's conditions (training/step3_rlhf_finetuning/
BenckmarkSetting.md): one epoch of 264,292 prompts of 256 tokens with 256 generated, generation
batch = training batch, one PPO epoch, the largest batch that fits up to 1024 rollouts per step;
modelled here with the memory pre-flight choosing that batch. Own figures: docs/benchmarks.md (bench/gpu.sh
on one H200).

    python bench/forecast.py            # the table, then one JSON line with the summary
    python bench/forecast.py --json     # one JSON line per cell
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf.config import compose_config as compose  # noqa: E402
from rlhf.config import to_schema  # noqa: E402
from rlhf.preflight import forecast, memory  # noqa: E402

DAY = 24.0
# Table 1: (actor, hardware preset) -> (hours, dollars or None).
TABLE1 = {
    ("opt-1.3b", "v100-32g"): (1.8 * DAY, None),
    ("opt-1.3b", "a6000"): (1.1 * DAY, None),
    ("opt-6.7b", "a6000"): (5.6 * DAY, None),
    ("opt-1.3b", "a100-40g"): (15.4, None),
    ("opt-6.7b", "a100-40g"): (3.4 * DAY, None),
    ("opt-1.3b", "a100-80g"): (11.7, None),
    ("opt-6.7b", "a100-80g"): (1.7 * DAY, None),
    ("opt-13b", "a100-80g"): (4.9 * DAY, None),
    ("opt-1.3b", "8xa100-40g"): (2.0, None),
    ("opt-6.7b", "8xa100-40g"): (5.7, None),
    ("opt-13b", "8xa100-40g"): (10.8, None),
    ("opt-30b", "8xa100-40g"): (1.85 * DAY, None),
    ("opt-1.3b", "8xa100-80g"): (1.4, 45),
    ("opt-6.7b", "8xa100-80g"): (4.1, 132),
    ("opt-13b", "8xa100-80g"): (9.0, 290),
    ("opt-30b", "8xa100-80g"): (18.0, 580),
    ("opt-66b", "8xa100-80g"): (2.1 * DAY, 1620),
    ("opt-1.3b", "64xa100-80g"): (31 / 60, None),
    ("opt-6.7b", "64xa100-80g"): (51 / 60, None),
    ("opt-13b", "64xa100-80g"): (1.25, 320),
    ("opt-30b", "64xa100-80g"): (4.0, 1024),
    ("opt-66b", "64xa100-80g"): (7.5, 1920),
    ("opt-175b", "64xa100-80g"): (20.0, 5120),
}
# The benchmark's prompts. BenckmarkSetting.md: "The total training samples we have here is 264292
# ... the total training tokens per epoch is 135,317,504" (= 264,292 x (256 + 256)); the README's
# "67.5M query tokens" is 264k prompts of 256 tokens as well. The README's "(131.9k queries with
# sequence length 256)" beside it contradicts both (131.9k x 256 = 33.8M); this table used it
# until commit 3e5cbf2, which halved every Table 1 forecast.
BENCH_PROMPTS = 264_292
# The end-to-end examples: experiment file -> published hours of steps 1, 2 and 3.
E2E = {
    "opt-1.3b_a6000": {"sft": 2900 / 3600, "reward": 670 / 3600, "ppo": 1.2},
    "opt-13b_8xa100-40g": {"sft": 2.5, "reward": 0.25, "ppo": 10.8},
    "opt-66b_64xa100-80g": {"sft": 82 / 60, "reward": 5 / 60, "ppo": 7.5},
}
# The examples' train rows. OPT-1.3B on one GPU: Dahoas/rm-static, main.py's default data (76,256
# train rows, its dataset card). OPT-13B and 66B: the six-dataset blend of their scripts
# (training_scripts/opt/single_node/run_13b.sh: rm-static, full-hh-rlhf, synthetic-instruct-gptj-
# pairwise, rlhf-reward-datasets, webgpt_comparisons, SHP), split 2,4,4, whose step-3 part is the
# benchmark's 264,292 prompts: their step-3 hours (10.8 and 7.5) are Table 1's cells for the same
# hardware.
E2E_ROWS = {"opt-1.3b_a6000": 76_256, "opt-13b_8xa100-40g": round(BENCH_PROMPTS / 0.4),
            "opt-66b_64xa100-80g": round(BENCH_PROMPTS / 0.4)}


def cell_config(actor: str, hardware: str, batch: int, zero: int, offload_reference: bool, lora_only: bool,
                generation: str = "auto"):
    return to_schema(compose([f"step.zero3_generation={generation}",
        "step=ppo", f"model={actor}", f"hardware={hardware}", f"zero={zero}", "+stage=[dschat/ppo,dschat-opt-rm/ppo]",
        f"step.rollout_batch_size_per_device={batch}", f"step.micro_batch_size_per_device={batch}",
        "step.gradient_accumulation_steps=1", "step.ppo_epochs=1", "step.epochs=1",
        "step.old_logprobs=recompute",  # DeepSpeed-Chat scores the actor's log-probs in a forward pass
        "step.eval_every_steps=0",  # its step 3 (main.py) evaluates nothing while it trains
        f"step.offload_reference={str(offload_reference).lower()}", f"lora.only_optimize_lora={str(lora_only).lower()}"]))


def fitting_config(actor: str, hardware: str):
    """DeepSpeed-Chat's rule, "the largest batch that does not run out of memory, up to 1024 rollouts
    per step", over the ways of fitting (full weights trained beside the LoRA adapters as its scripts
    do, or adapters only; ZeRO stage; the reference offloaded or not; under ZeRO-3 the actor gathered
    whole or in tensor-parallel slices over a node for generation), by the memory pre-flight; of the
    ways that reach that batch, the one the forecast finds fastest. Its hybrid engine always gathers
    the actor to generate (whole, or in --inference_tp_size slices: run_66b.sh), so generating layer
    by layer is a way only where no gathered one fits at any batch."""
    world = to_schema(compose([f"hardware={hardware}"])).world_size
    stages = (0, 3) if world == 1 else (2, 3) if actor == "opt-1.3b" else (3,)
    for generations in (("gather", "tp") if world > 1 else ("gather",), ("layerwise",)):
        fitting = []
        for lora_only in (False, True):
            for zero in stages:
                for generation in generations if zero == 3 else generations[:1]:  # nothing gathered below 3
                    for offload in (False, True):
                        for batch in (64, 32, 16, 8, 4, 2, 1):
                            if batch * world > 1024:
                                continue
                            cfg = cell_config(actor, hardware, batch, zero, offload, lora_only, generation)
                            if memory.verdict(memory.estimate(cfg), cfg.hardware.memory_per_device_gb)[0]:
                                fitting.append(cfg)
                                break
        if fitting:
            return max(fitting, key=lambda c: (c.step.rollout_batch_size_per_device,
                                               -forecast.forecast(c, part_rows=BENCH_PROMPTS).seconds))
    return None


def e2e_config(experiment: str, step: str):
    stages = {"sft": "[dschat/sft", "reward": "[dschat/reward,dschat-opt-rm/reward", "ppo": "[dschat/ppo,dschat-opt-rm/ppo"}
    # As in Table 1's cells: DeepSpeed-Chat's step 3 evaluates nothing while it trains.
    quiet = ["step.eval_every_steps=0"] if step == "ppo" else []
    return to_schema(compose([f"experiment={experiment}", f"step={step}", f"+stage={stages[step]},{experiment}/{step}]",
                              *quiet]))


def own_configs() -> dict:
    """bench/gpu.sh's SFT and PPO runs on one H200: random OPTs with the 1.3B and 350M numbers, on
    its rows of exact lengths (SFT 512 tokens, half prompt; PPO prompts of 256 tokens), with the
    measured seconds per step (warm-up and evaluations excluded) and those lengths."""
    shape = {"family": "opt", "num_layers": 24, "hidden_size": 2048, "num_heads": 32, "ffn_size": 8192,
             "vocab_size": 50272, "max_positions": 2048}
    model = ["model=tiny-opt", *(f"model.{k}={v}" for k, v in shape.items())]
    def sft(micro: int):
        return to_schema(compose([*model, "hardware=h200", "step=sft", f"step.micro_batch_size_per_device={micro}",
                                  "step.max_seq_len=512", "step.max_steps=1"]))

    def ppo(graph: bool):
        return to_schema(compose([*model, "hardware=h200", "step=ppo", "critic.model=opt-350m",
                                  "step.rollout_batch_size_per_device=64", "step.micro_batch_size_per_device=16",
                                  "step.max_prompt_len=256", "step.max_new_tokens=256", "step.max_steps=1",
                                  # The measured runs took the sampler's log-probs (the default then;
                                  # bf16's auto now recomputes them with one more actor forward).
                                  "step.old_logprobs=rollout", f"step.decode_graph={str(graph).lower()}"]))

    # docs/benchmarks.md, `bash bench/gpu.sh`: phases sft, sft_micro4x, ppo, ppo_graph.
    return {"sft 16 rows": (sft(16), 0.231, (512, 256)), "sft 64 rows": (sft(64), 0.573, (512, 256)),
            "ppo": (ppo(False), 4.02, (512, 256)), "ppo decode_graph": (ppo(True), 2.64, (512, 256))}


def generated(cfg) -> str:
    """How a ZeRO-3 cell's actor generates, for its setting column."""
    way = memory.generation_gathering(cfg)
    return "" if cfg.zero.stage != 3 else {0: ", generation layer by layer", 1: ", generation gathered whole"}.get(
        way, f", generation in {way} tensor-parallel slices")


def ratio(forecast_h: float, published_h: float) -> float:
    return forecast_h / published_h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON line per cell instead of the table")
    args = ap.parse_args()
    rows = []
    for (actor, hardware), (hours, dollars) in TABLE1.items():
        cfg = fitting_config(actor, hardware)
        if cfg is None:
            rows.append({"table": "step 3", "cell": f"{actor} on {hardware}", "published_h": hours, "forecast_h": None,
                         "note": "does not fit by the memory pre-flight at any batch"})
            continue
        f = forecast.forecast(cfg, part_rows=BENCH_PROMPTS)
        rows.append({"table": "step 3", "cell": f"{actor} on {hardware}", "published_h": round(hours, 3),
                     "forecast_h": round(f.seconds / 3600, 3), "ratio": round(ratio(f.seconds / 3600, hours), 2),
                     "published_usd": dollars, "forecast_usd": None if f.cost is None else round(f.cost),
                     "setting": f"zero {cfg.zero.stage}, {cfg.step.rollout_batch_size_per_device} rollouts/device"
                                + generated(cfg)
                                + (", reference offloaded" if cfg.step.offload_reference else "")
                                + (", adapters only" if cfg.lora.only_optimize_lora else ""),
                     "phases_h": {k: round(v / 3600, 3) for k, v in f.phases.items()}})
    for experiment, published in E2E.items():
        for step, hours in published.items():
            cfg = e2e_config(experiment, step)
            f = forecast.forecast(cfg, rows=E2E_ROWS[experiment])
            rows.append({"table": "end to end", "cell": f"{experiment} step {step}", "published_h": round(hours, 3),
                         "forecast_h": round(f.seconds / 3600, 3), "ratio": round(ratio(f.seconds / 3600, hours), 2),
                         "setting": f.work, "phases_h": {k: round(v / 3600, 3) for k, v in f.phases.items()}})
    for name, (cfg, seconds, lengths) in own_configs().items():
        f = forecast.forecast(cfg, lengths=lengths)
        # The measured figure is a training step's: the evaluations before and after are not in it.
        per_step = (f.seconds - f.phases["evaluation"]) / f.steps
        rows.append({"table": "own H200", "cell": f"{name} s/step", "published_h": seconds, "forecast_h": round(per_step, 3),
                     "ratio": round(per_step / seconds, 2), "setting": f.work,
                     "phases_s": {k: round(v / f.steps, 3) for k, v in f.phases.items() if k != "evaluation"}})
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print("| table | cell | published | forecast | ratio | setting |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            unit = "s" if r["table"] == "own H200" else "h"
            fc = "-" if r["forecast_h"] is None else f"{r['forecast_h']:g} {unit}"
            print(f"| {r['table']} | {r['cell']} | {r['published_h']:g} {unit} | {fc} | {r.get('ratio', '-')} | "
                  f"{r.get('setting', r.get('note', ''))} |")
    published = [r for r in rows if r["table"] != "own H200" and r.get("ratio")]
    within2 = sum(0.5 <= r["ratio"] <= 2 for r in published)
    own = [r["ratio"] for r in rows if r["table"] == "own H200"]
    print(json.dumps({"published_cells": len([r for r in rows if r["table"] != "own H200"]),
                      "within_2x": within2, "share_within_2x": round(within2 / max(len(published), 1), 3),
                      "own_h200_ratios": own}))


if __name__ == "__main__":
    main()
