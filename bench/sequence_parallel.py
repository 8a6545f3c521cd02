"""Sequence parallelism on 2 CPU ranks: tokens/s and peak memory per rank of SFT training steps on
long rows, with each row split over both ranks (parallel.sequence=2) against the same 2 ranks each
running whole rows of its own (parallel.sequence=1), in one run of this script, one after the other.

Both ways train the same random llama (fp32, ZeRO-2, 1 thread per rank) through the SFT runner's own
loss (rlhf.runners.sft.lm_loss) on random rows of --seq tokens, one row per rank and micro batch
whole, one row per group split. Per way and rank: tokens/s over the timed steps (after --warmup) and
the growth of the process's peak resident memory from just before the first step (activations,
logits, gradients, optimizer states: what a step adds to the loaded model). Prints one JSON line with
both ways and the ratios split / whole.

    python bench/sequence_parallel.py                         # 4,096-token rows
    python bench/sequence_parallel.py --seq 8192 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rss_gb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 2**20


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf import sequence
    from rlhf.runners.sft import lm_loss
    from rlhf.worker import quiet_libraries

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    quiet_libraries()
    sequence.setup(args.sp)
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dist.get_world_size(),
          "zero_optimization": {"stage": 2}, "steps_per_print": 10**9, "gradient_clipping": 1.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=ds)
    g = torch.Generator().manual_seed(sequence.data_rank(rank))  # the ranks of a group read the same row
    base = _rss_gb()
    times = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        dist.barrier()
        start = time.perf_counter()
        engine.backward(lm_loss(engine, batch))
        engine.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    timed = sum(times[args.warmup:])
    rows = sequence.data_world(dist.get_world_size()) * args.steps  # distinct rows trained over all ranks
    found = {"rank": rank, "tokens_per_s": rows * args.seq / timed, "step_s": timed / args.steps,
             "peak_growth_gb": peak - base}
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, found)
    if rank == 0:
        Path(args.out).write_text(json.dumps(shares))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per way")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    ways = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sp in (("whole", 1), ("split", 2)):
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                   __file__, "--worker", "--sp", str(sp), "--out", str(out), *sys.argv[1:]]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
            ranks = json.loads(out.read_text())
            ways[name] = {"tokens_per_s": ranks[0]["tokens_per_s"], "step_s": ranks[0]["step_s"],
                          "peak_growth_gb_per_rank": [round(r["peak_growth_gb"], 3) for r in ranks]}
    whole, split = ways["whole"], ways["split"]
    print(json.dumps({"seq": args.seq, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, **ways,
                      "tokens_per_s_split_over_whole": split["tokens_per_s"] / whole["tokens_per_s"],
                      "peak_growth_split_over_whole": max(split["peak_growth_gb_per_rank"])
                      / max(whole["peak_growth_gb_per_rank"])}))


if __name__ == "__main__":
    main()
