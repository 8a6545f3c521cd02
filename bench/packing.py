"""SFT micro-step time with packed rows (step.packing) against padded rows, measured in the same process.

The same micro batches of the same shipped rows through the same model (its own copy per way, fp32,
the hardware preset's thread count): forward, backward and an AdamW step, without a KV cache as the
SFT runner trains; once through PadCollator and once through PackCollator, taking turns batch by batch
(and which goes first) so that drift in machine load hits both alike. Prints one JSON line: seconds
per micro step (median after --warmup), the share of padding in the padded batches, and the ratio
packed / padded (below 1: packing is faster).

    python bench/packing.py                                       # tiny-llama, the shipped sort task
    python bench/packing.py data=synthetic-mix                    # tasks of different lengths
    python bench/packing.py data=synthetic-mix step.micro_batch_size_per_device=64
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="micro batches timed per way")
    ap.add_argument("--warmup", type=int, default=5, help="micro batches per way left out of the median")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import torch

    from rlhf import models
    from rlhf.config import compose_config, to_schema
    from rlhf.data.blend import DataReport, load_step_data
    from rlhf.data.tokenize import PackCollator, PadCollator, sft_dataset

    cfg = to_schema(compose_config(args.overrides))
    if cfg.hardware.torch_threads:
        torch.set_num_threads(cfg.hardware.torch_threads)
    path = models.resolve_path(cfg.model)
    models.check_packed_rows(path, cfg.model.trust_remote_code)
    tok = models.load_tokenizer(path)
    rows, _ = load_step_data(cfg.data, "sft", DataReport())
    ds = sft_dataset(rows, tok, cfg.step.max_seq_len, cfg.step.loss_on, DataReport(), "train")
    micro = cfg.step.micro_batch_size_per_device
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    batches = [[ds[i] for i in order[k * micro:(k + 1) * micro]] for k in range(args.warmup + args.steps)]

    torch.manual_seed(cfg.seed)
    model = models.load_causal_lm(path, tok, torch.float32, cfg.model.dropout).train()
    ways = {"padded": PadCollator(tok.pad_token_id), "packed": PackCollator()}
    trained = {name: copy.deepcopy(model) for name in ways}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=cfg.optim.lr, fused=True) for name, m in trained.items()}
    times = {name: [] for name in ways}
    real = padded = 0
    for k, rows_k in enumerate(batches):
        for name in (list(ways) if k % 2 else list(ways)[::-1]):
            batch = ways[name](rows_k)
            start = time.perf_counter()
            trained[name](**batch, use_cache=False).loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
            if name == "padded" and k >= args.warmup:
                real += int(batch["attention_mask"].sum())
                padded += batch["attention_mask"].numel()
    per_step = {name: statistics.median(t[args.warmup:]) for name, t in times.items()}
    print(json.dumps({
        "model": cfg.model.name, "data": cfg.data.name, "micro_batch": micro, "micro_steps": args.steps,
        "threads": torch.get_num_threads(), "tokens_per_micro_batch": round(real / args.steps, 1),
        "padding_share": round(1 - real / padded, 3), "padded_s_per_micro_step": round(per_step["padded"], 5),
        "packed_s_per_micro_step": round(per_step["packed"], 5),
        "ratio_packed_over_padded": round(per_step["packed"] / per_step["padded"], 3)}))


if __name__ == "__main__":
    main()
