"""One process of tests/test_sequence.py: the loss and every parameter's gradient, as the optimizer
receives them from real DeepSpeed engines at ZeRO 0-3, of the runners' own loss code (SFT's lm_loss,
the preference runner's summed answer log-probs under DPO's loss, the reward runner's pairwise loss),
for tiny random models of several families, on right-padded rows whose width does not divide the
group. On one rank the rows run whole; on two ranks with
parallel.sequence=2 each rank runs half of every row. Rank 0 writes {"family/loss/zero": (loss,
{name: gradient})} to OUT.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 python tests/sequence_worker.py OUT
    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank --master_port PORT tests/sequence_worker.py OUT
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf import losses, sequence
from rlhf.data.tokenize import IGNORE_INDEX
from rlhf.models import RewardModel
from rlhf.runners import preference, reward, sft
from rlhf.worker import quiet_libraries

ROWS, WIDTH, VOCAB = 4, 13, 96
LENGTHS = [13, 7, 10, 4]  # one row fills the width; the others end early, padded on the right
# Each family with heads that divide 2 and key/value heads that do (llama, qwen2: 4 over 2) or
# are divided by it (mistral: 4 over 1, copied to both ranks).
FAMILIES = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=8),
}

# Every loss at every ZeRO stage on llama; every loss at stage 2 on the other families; SFT with
# gradient checkpointing at stages 0 and 3.
CASES = [("llama", kind, stage, False) for kind in ("sft", "logp", "reward") for stage in range(4)] + \
    [(family, kind, 2, False) for family in FAMILIES if family != "llama" for kind in ("sft", "logp", "reward")] + \
    [("llama", "sft", stage, True) for stage in (0, 3)]


def config(family: str):
    spec = dict(FAMILIES[family])
    kind = spec.pop("model_type")
    return AutoConfig.for_model(kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa", num_labels=1,
                                **spec)


def rows():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (ROWS, WIDTH), generator=g)
    mask = (torch.arange(WIDTH) < torch.tensor(LENGTHS)[:, None]).long()
    answer = mask * (torch.arange(WIDTH) >= 3).long()  # the first 3 tokens are the prompt
    return ids * mask, mask, answer


def loss(kind: str, engine, ids, mask, answer) -> torch.Tensor:
    """The step's own loss code on the rows: the SFT runner's, the preference runner's summed answer
    log-probs under DPO's loss (rows 0-1 chosen, 2-3 rejected), the reward runner's pairwise loss."""
    if kind == "sft":
        return sft.lm_loss(engine, {"input_ids": ids, "attention_mask": mask,
                                    "labels": torch.where(answer.bool(), ids, IGNORE_INDEX)})
    if kind == "logp":
        logp = preference.pair_logprobs(engine, {"input_ids": ids, "attention_mask": mask, "answer_mask": answer})
        return losses.dpo_sigmoid(0.1 * (logp[:2] - logp[2:]), 1.0, 0.0).mean()
    return reward.pair_scores(engine, {"input_ids": ids, "attention_mask": mask}, "last")[0]


def main(out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    world = dist.get_world_size()
    torch.set_num_threads(1)
    quiet_libraries()
    if world > 1:
        sequence.setup(world)
    ids, mask, answer = rows()
    found, widths = {}, []
    for family, kind, stage, checkpointing in CASES:
        torch.manual_seed(0)
        lm = RewardModel.from_config(config(family)) if kind == "reward" else \
            AutoModelForCausalLM.from_config(config(family))
        if checkpointing:  # the backward recomputes each layer's forward: its attention sliced again
            lm.gradient_checkpointing_enable({"use_reentrant": False})
        names = [n for n, _ in lm.named_parameters()]
        # The width of the rows the model ran: whole on one rank, this rank's slice with two.
        (lm.hf_model if kind == "reward" else lm).get_input_embeddings().register_forward_hook(
            lambda m, i, o: widths.append(i[0].shape[1]))
        ds = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
              "train_batch_size": ROWS * world, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.SGD(lm.parameters(), lr=0.0),
                                          config=ds)
        value = loss(kind, engine, ids, mask, answer)
        engine.backward(value)
        grads = {n: safe_get_full_grad(p).clone() for n, p in zip(names, engine.module.parameters(),
                                                                  strict=True)}
        engine.step()
        found[f"{family}/{kind}/{stage}" + ("/checkpointing" if checkpointing else "")] = (value.item(), grads)
        engine.destroy()
    if dist.get_rank() == 0:
        torch.save({**found, "widths": widths}, out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
