"""Speed of one PPO step on CPU, in the setting the field's CPU figures use.

One process; a random OPT (hidden 256, 4 layers, 8 heads, ffn 1024, vocab 8192) as actor,
reference, critic and reward model; 4 prompts of 64 tokens, 64 sampled tokens each (eos
suppressed: no early stop); bf16; 2 warm-up steps then 20 measured. Runs the real PPO runner and
prints one JSON line of medians: generate, experience (generate plus the scoring forwards), train
and whole-step seconds, and samples/s. The field's best-known CPU figure for this setting is about
0.48 s per step on one thread (8.3 samples/s).

    python bench/ppo_step.py
    python bench/ppo_step.py --steps 10 hardware.torch_threads=2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = ["model=tiny-opt", "model.name=bench-opt-256", "model.hidden_size=256", "model.num_layers=4",
         "model.num_heads=8", "model.ffn_size=1024", "model.vocab_size=8192", "model.max_positions=256"]
PROMPT_TOKENS, NEW_TOKENS, PROMPTS = 64, 64, 4


def write_prompts(folder: Path, tokenizer, n: int) -> None:
    """Prompts of exactly PROMPT_TOKENS tokens (bos included), in DeepSpeed-Chat's columns."""
    rng = random.Random(0)
    rows = []
    while len(rows) < n:
        words = " ".join(rng.choice(string.ascii_lowercase) for _ in range(PROMPT_TOKENS))
        prompt = f" Human: {words}"
        ids = tokenizer(prompt).input_ids[:PROMPT_TOKENS]
        prompt = tokenizer.decode(ids, skip_special_tokens=True)
        if len(tokenizer(prompt).input_ids) == PROMPT_TOKENS:
            rows.append({"prompt": prompt, "chosen": " a", "rejected": " b"})
    for split in ("train", "eval"):
        with open(folder / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps (after 2 warm-up steps)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from rlhf import models
    from rlhf.config import compose_config, to_schema
    from rlhf.launch import run

    total = args.steps + 2
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_cfg = to_schema(compose_config(MODEL)).model
        path = models.resolve_path(model_cfg)
        (tmp / "data").mkdir()
        # Every PPO part of the split must hold enough prompts for `total` steps of PROMPTS each.
        write_prompts(tmp / "data", models.load_tokenizer(path), PROMPTS * total * 4)
        overrides = [*MODEL, "step=ppo", "hardware.precision=bf16", f"data.sources=[{{path: {tmp / 'data'}}}]",
                     f"actor.path={path}", f"critic.path={path}", f"reward.path={path}",
                     f"step.rollout_batch_size_per_device={PROMPTS}", f"step.micro_batch_size_per_device={PROMPTS}",
                     f"step.max_prompt_len={PROMPT_TOKENS}", f"step.max_new_tokens={NEW_TOKENS}",
                     f"step.min_new_tokens={NEW_TOKENS}", f"step.max_steps={total}", "step.eval_prompts=0",
                     "step.eval_every_steps=0", "step.save_model=false", "logging.progress_bar=false",
                     "step.log_every_steps=1000", *args.overrides, f"run_dir={tmp / 'run'}"]
        cfg = compose_config(overrides)
        run(cfg)
        rows = [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl") if "step_s" in line][2:]
    med = {k: statistics.median(r[k] for r in rows) for k in ("generate_s", "experience_s", "train_s", "step_s")}
    from rlhf.launch_step import cpu_bf16

    print(json.dumps({"setting": "opt h256 l4 v8192, 4 prompts x 64 + 64 new tokens, bf16, CPU",
                      "cpu_bf16": cpu_bf16(),  # emulated bf16 makes every figure ~20x slower
                      "threads": cfg.hardware.torch_threads, "measured_steps": len(rows),
                      "answer_tokens": statistics.median(r["answer_len"] for r in rows),
                      **{k: round(v, 4) for k, v in med.items()},
                      "samples_per_s": round(PROMPTS / med["step_s"], 2), "reference_s_per_step": 0.48,
                      "ratio_to_reference": round(med["step_s"] / 0.48, 3)}))


if __name__ == "__main__":
    main()
