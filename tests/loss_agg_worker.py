"""One process of tests/test_loss_agg.py: the gradients of PPO's update (rlhf.runners.ppo_update.ppo_update,
real DeepSpeed engines) on one fixed rollout batch of 8 answers, for every advantage estimator and
every loss aggregation, and for each objective and rollout correction (VARIANTS) with GRPO, with the batch split as the world asks: on one rank as micro 8 x
accumulation 1 and as micro 4 x accumulation 2; on two ranks as micro 4 x accumulation 1 per rank.
Rank 0 writes {split: {"estimator/agg/role": gradient}} to OUT.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 python tests/loss_agg_worker.py OUT
    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank --master_port PORT tests/loss_agg_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import sys

import deepspeed
import torch
import torch.distributed as dist

from rlhf import engine as engine_factory
from rlhf import losses, models
from rlhf.config import compose_config, to_schema
from rlhf.generation.rollout import Experience, Scores, answer_logits, position_ids
from rlhf.generation.sampling import Sampling
from rlhf.runners.ppo_update import ppo_update
from rlhf.worker import quiet_libraries

ROWS, PROMPT, ANSWER, EOS, PAD = 8, 5, 6, 2, 1
# The objectives and rollout corrections beside PPO's clipped surrogate, each with GRPO's advantages
# and the aggregation it takes by default: the step settings of each.
VARIANTS = {"gspo": {"policy_loss": "gspo"}, "cispo": {"policy_loss": "cispo"}, "clip_higher": {"clip_eps_high": 0.28},
            "tis": {"rollout_correction": "tis"}, "mis": {"rollout_correction": "mis", "rollout_correction_cap": 1.5},
            "icepop": {"rollout_correction": "icepop", "rollout_correction_low": 0.8, "rollout_correction_cap": 1.25}}
# Answer lengths: short and long answers mixed, two cut at the budget without an eos.
LENGTHS = torch.tensor([1, 6, 3, 6, 2, 5, 4, 6])


def batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (ROWS, PROMPT), generator=g)
    response = torch.randint(3, vocab, (ROWS, ANSWER), generator=g)
    mask = (torch.arange(ANSWER) < LENGTHS[:, None]).float()
    for i, n in enumerate(LENGTHS.tolist()):
        if i % 4 != 3:  # rows 3 and 7 are cut at the budget; the others end with eos
            response[i, n - 1] = EOS
    response = torch.where(mask.bool(), response, PAD)
    seq = torch.cat([prompt, response], 1)
    attn = torch.cat([torch.ones_like(prompt), mask.long()], 1)
    return seq, attn, response, mask, g


def main(out: str) -> None:
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    quiet_libraries()
    splits = {"micro8x1": (8, 1), "micro4x2": (4, 2)} if world == 1 else {"2ranks_micro4x1": (4, 1)}
    base = ["step=ppo", "model=tiny-llama", "hardware=cpu" if world == 1 else "hardware=cpu-2rank",
            "hardware.precision=fp32", "optim.grad_clip=0", "step.samples_per_prompt=2", "step.entropy_coef=0.01",
            f"step.max_new_tokens={ANSWER}", f"step.rollout_batch_size_per_device={ROWS // world}",
            "step.reward_fn=rule", "step.reward_model_weight=0", "step.micro_batch_size_per_device=4"]
    path = models.resolve_path(to_schema(compose_config(base)).model)
    tokenizer = models.load_tokenizer(path)
    results = {}
    for split, (micro, accumulation) in splits.items():
        cfg = to_schema(compose_config([*base, f"step.micro_batch_size_per_device={micro}",
                                        f"step.gradient_accumulation_steps={accumulation}"]))
        torch.manual_seed(0)  # the critic's new score head: the same in every process and split
        actor, _ = engine_factory.build_train_engine(models.load_causal_lm(path, tokenizer), cfg, 1)
        critic, _ = engine_factory.build_train_engine(models.load_reward_model(path, tokenizer), cfg, 1,
                                                      lr=cfg.step.critic_lr, use_lora=False)
        start_weights = {e: [p.detach().clone() for p in e.module.parameters()] for e in (actor, critic)}
        grads = {}
        for role, eng in (("actor", actor), ("critic", critic)):
            # What the optimizer is handed: every micro-batch accumulated and, on 2 ranks, averaged.
            eng.optimizer.register_step_pre_hook(lambda opt, *_, role=role, grads=grads: grads.__setitem__(
                role, torch.cat([p.grad.flatten().clone() for group in opt.param_groups for p in group["params"]])))

        seq, attn, response, mask, g = batch(actor.module.config.vocab_size)
        pos, start = position_ids(attn), PROMPT - 1
        with torch.no_grad():
            logp = losses.token_logprobs(answer_logits(actor.module, seq, attn, pos, start), response, 0.7)
        # Old and reference log-probs off the current policy, so that ratios differ from 1 and some clip.
        old = logp + 0.3 * torch.randn(logp.shape, generator=g)
        ref = logp + 0.3 * torch.randn(logp.shape, generator=g)
        score, values = torch.randn(ROWS, generator=g), torch.randn(ROWS, ANSWER, generator=g)
        mine = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        # The sampler's log-probs a little off the trainer's old ones: the corrections weigh, cap and drop.
        sampler = old + 0.2 * torch.randn(old.shape, generator=g)
        combos = [(f"{name}/{agg}", name, {"loss_agg": agg}) for name in losses.ESTIMATORS for agg in losses.LOSS_AGGS]
        combos += [(variant, "grpo", {"loss_agg": None, "clip_eps_low": None, "clip_eps_high": None,
                                      "old_logprobs": "recompute", **settings}) for variant, settings in VARIANTS.items()]
        for key, name, settings in combos:
            estimator = losses.ESTIMATORS[name]
            step_cfg = dataclasses.replace(cfg.step, advantage_estimator=name, kl_in=None, kl_estimator=None,
                                           global_batch_size=None, **settings)
            kl = losses.kl_penalty(old, ref, step_cfg.kl_estimator) * mask
            advantages, returns = estimator.fn(losses.AdvantageInputs(
                score=score, kl=kl, kl_coef=0.05 if step_cfg.kl_in == "reward" else 0.0, mask=mask,
                values=values, group_size=2, gamma=1.0, lam=0.95, whiten=True))
            weights = None
            if step_cfg.rollout_correction != "none":
                weights = losses.rollout_correction(old, sampler, mask, step_cfg.rollout_correction,
                                                    step_cfg.rollout_correction_low, step_cfg.rollout_correction_cap)[0]
            truncated = ~(response == EOS).any(-1)
            exp = Experience(
                seq=seq[mine], attn=attn[mine], pos=pos[mine], response=response[mine], mask=mask[mine],
                loss_mask=mask[mine], truncated=truncated[mine], eos_id=EOS, start=start, sampling=Sampling.of(step_cfg),
                old_logprobs=old[mine], ref_logprobs=ref[mine],
                old_values=values[mine] if estimator.needs_critic else None, advantages=advantages[mine],
                returns=returns[mine] if returns is not None else None, kl=kl[mine].sum(-1), kl_k1=kl[mine].sum(-1),
                prompts=[""] * (ROWS // world), answers=[""] * (ROWS // world), scores=Scores(total=score[mine]),
                generate_s=0.0, is_weights=None if weights is None else weights[mine])
            grads.clear()
            ppo_update(actor, critic if estimator.needs_critic else None, exp, step_cfg, 0.1,
                       torch.Generator().manual_seed(rank), None)
            for role, grad in grads.items():
                results.setdefault(split, {})[f"{key}/{role}"] = grad
            with torch.no_grad():  # every combination starts from the same weights
                for eng, weights in start_weights.items():
                    for p, w in zip(eng.module.parameters(), weights, strict=True):
                        p.copy_(w)
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
