"""One process of tests/test_rollout_share.py: greedy evaluation (rlhf.generation.rollout.evaluate, a real
DeepSpeed engine) of 3 prompts on 2 ranks, where the second rank's share wraps round to the first
prompt. The rule scores the prompt alone (1 for "p0"), so the right figure is 1/3 whatever the
answers; then again with a head that never ends an answer (every one cut at the budget). Rank 0
writes both evaluations' figures to OUT as JSON.

    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank --master_port PORT tests/eval_share_worker.py \
        MODEL_DIR OUT
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from rlhf import engine as engine_factory
from rlhf import models
from rlhf.config import compose_config, to_schema
from rlhf.data.blend import DataReport
from rlhf.generation import rollout
from rlhf.worker import quiet_libraries


def main(path: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    quiet_libraries()
    cfg = to_schema(compose_config(["step=ppo", "model=tiny-llama", "hardware=cpu-2rank", "hardware.precision=fp32"]))
    tokenizer = models.load_tokenizer(path)
    tokenizer.padding_side = "left"
    actor, _ = engine_factory.build_frozen_engine(models.load_causal_lm(path, tokenizer), cfg)
    prompts = rollout.prompt_dataset([{"prompt": p} for p in ("p0", "p1", "p2")], tokenizer, 16, DataReport(), "eval")
    def figures() -> dict[str, float]:
        return rollout.evaluate(actor, None, lambda prompt, answer: float(prompt == "p0"), prompts, tokenizer,
                                max_new_tokens=2, batch_size=4)

    found = {"plain": figures()}
    # The eos row of the head zeroed: its logit is 0, below the largest of the others' (whose chance of
    # all being negative is 2^-vocabulary), so no answer ends within the budget.
    with torch.no_grad():
        actor.module.get_output_embeddings().weight[tokenizer.eos_token_id] = 0
    found["never_ends"] = figures()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(found, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
