"""One process of tests/test_sequence.py: the loss and every parameter's gradient, as the optimizer
receives them from real DeepSpeed engines at ZeRO 0-3, of the three kinds of loss the training steps
take from ``rlhf.sequence.per_token`` (SFT's token-mean NLL, the DPO family's summed answer log-probs,
the reward model's last-token score), for tiny random models of several families, on right-padded
rows whose width does not divide the group. On one rank the rows run whole; on two ranks with
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
from rlhf.models import RewardModel
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


def loss(kind: str, model, ids, mask, answer) -> torch.Tensor:
    if kind == "sft":  # the token-mean NLL over the answers (SFT)
        labels = torch.where(answer.bool(), ids, -100)
        nll = sequence.per_token(model, ids, mask, sequence.next_tokens(labels, -100), lambda out, t: torch.nn.functional.cross_entropy(
            out.logits.transpose(1, 2).float(), t, ignore_index=-100, reduction="none"))
        return nll[:, :-1].sum() / (labels[:, 1:] != -100).sum()
    if kind == "logp":  # summed answer log-probs, paired as chosen/rejected (the DPO family)
        logp = sequence.per_token(model, ids, mask, sequence.next_tokens(ids),
                                  lambda out, t: losses.token_logprobs(out.logits, t))
        seq = (logp[:, :-1] * answer[:, 1:]).sum(-1)
        return -torch.nn.functional.logsigmoid(0.1 * (seq[:2] - seq[2:])).mean()
    values = sequence.per_token(model, ids, mask, None, lambda out, t: out)  # the reward model's score
    scores = losses.gather_at(values, losses.end_indices(mask))
    return losses.pairwise_loss(scores[:2], scores[2:])


def main(out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    world = dist.get_world_size()
    torch.set_num_threads(1)
    quiet_libraries()
    if world > 1:
        sequence.setup(world)
    ids, mask, answer = rows()
    found = {}
    for family in FAMILIES:
        for kind in ("sft", "logp", "reward"):
            for stage in range(4):
                torch.manual_seed(0)
                lm = AutoModelForCausalLM.from_config(config(family))
                if kind == "reward":
                    torch.manual_seed(0)
                    lm = RewardModel.from_config(config(family))
                names = [n for n, _ in lm.named_parameters()]
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
                found[f"{family}/{kind}/{stage}"] = (value.item(), grads)
                engine.destroy()
    if dist.get_rank() == 0:
        torch.save(found, out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
