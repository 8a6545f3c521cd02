"""SimPO, a reference-free alternative to steps 2-3: setup -> loop -> save.

The policy (from the SFT output, ``actor.path``) learns from the reward part's preference pairs
with SimPO's loss (Meng, Xia and Chen 2024; rlhf.losses.simpo): the implicit reward of an answer is
its average log-likelihood times ``step.beta``, and the chosen answer's must beat the rejected one's
by the margin ``step.gamma``. No reference model and no reward model: one model in memory. Logs the
rewards, their margin and the preference accuracy; on data a rule knows, greedy held-out accuracy
too. Saves a folder that ``AutoModelForCausalLM.from_pretrained`` loads, like SFT.

    python launch.py step=simpo actor.path=<sft out>/model
    python launch.py pipeline=simpo                          # SFT -> SimPO
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf import losses, memory, models, rollout
from rlhf.config import Config
from rlhf.runners import common, loop
from rlhf.runners.dpo import pair_logprobs, preference_data


def pair_loss(engine, batch: dict, step_cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair SimPO losses and the chosen and rejected rewards of a PairCollator batch."""
    chosen_logp, rejected_logp = pair_logprobs(engine, batch)
    tokens = batch["answer_mask"].sum(-1).to(chosen_logp.dtype)  # answer tokens, eos included
    half = tokens.shape[0] // 2
    return losses.simpo(chosen_logp, rejected_logp, tokens[:half], tokens[half:], step_cfg.beta, step_cfg.gamma)


@torch.no_grad()
def evaluate(engine, loader, step_cfg) -> dict[str, float]:
    """Loss, preference accuracy (chosen's reward above rejected's), rewards and their margin."""
    engine.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=engine.device)  # pairs, correct, chosen, rejected, loss
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss, chosen, rejected = pair_loss(engine, batch, step_cfg)
        sums += torch.stack([torch.tensor(float(len(loss)), device=sums.device), (chosen > rejected).sum().double(),
                             chosen.sum().double(), rejected.sum().double(), loss.sum().double()])
    dist.all_reduce(sums)
    engine.train()
    n = sums[0].clamp(min=1)
    return {"eval/loss": (sums[4] / n).item(), "eval/pref_acc": (sums[1] / n).item(),
            "eval/chosen_reward": (sums[2] / n).item(), "eval/rejected_reward": (sums[3] / n).item(),
            "eval/margin": ((sums[2] - sums[3]) / n).item()}


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg = dist.get_rank(), dist.get_world_size(), cfg.step
    model_path, tokenizer, train_ds, eval_ds, collate, rule, accuracy_prompts = preference_data(cfg)
    gathering = memory.generation_gathering(cfg)
    loader, sampler = common.train_loader(train_ds, cfg, rank, world, collate)
    evaluation = common.eval_loader(eval_ds, cfg, rank, world, collate)
    total_steps = common.plan_steps(cfg, len(loader), len(train_ds))
    engine, n_params, ckpt = common.train_engine(cfg, models.load_causal_lm, model_path, tokenizer, total_steps, "actor",
                                                 dropout=0.0 if step_cfg.disable_dropout else None)
    if rank == 0:
        common.say(f"[simpo] {len(train_ds)} train pairs, {len(eval_ds)} eval pairs, {total_steps} optimizer steps of "
                   f"{step_cfg.global_batch_size} pairs, {n_params / 1e6:.2f}M parameters; beta {step_cfg.beta}, "
                   f"gamma {step_cfg.gamma}")
    state, resumed, logger = common.start_loop(ckpt, cfg, rank, total_steps,
                                               ("loss", "pref_acc", "chosen_reward", "rejected_reward"), "simpo")

    def ready(epoch: int) -> bool:
        """Evaluate (SimPO has no readiness rule: it trains its full length)."""
        metrics = evaluate(engine, evaluation, step_cfg)
        if accuracy_prompts:
            metrics.update(rollout.evaluate(engine, None, rule, accuracy_prompts, tokenizer, step_cfg.max_new_tokens,
                                            step_cfg.eval_micro_batch_size_per_device, gathering))
        state.last, state.last_eval_step = metrics, state.step
        logger.log({**metrics, "epoch": epoch}, step=state.step)
        if rank == 0:
            common.say(f"[simpo] step {state.step} " + " ".join(f"{k[5:]}={v:.4f}" for k, v in metrics.items()))
        return False

    def micro_step(batch: dict) -> tuple:
        loss, chosen, rejected = pair_loss(engine, batch, step_cfg)
        return loss.mean(), {"pref_acc": (chosen > rejected).float().mean().item(),
                             "chosen_reward": chosen.mean().item(), "rejected_reward": rejected.mean().item()}

    # -------------------------------------------------------------------------------- loop
    if not resumed:
        ready(0)
        state.first = state.last
    loop.train(cfg, engine, loader, sampler, ckpt, state, logger, n_params, micro_step, ready, "SimPO loss",
               derive=lambda m: {"margin": m["chosen_reward"] - m["rejected_reward"]}, postfix=("loss", "pref_acc"))

    # -------------------------------------------------------------------------------- save
    return common.finish(cfg, engine, tokenizer, rank, state.step, state.first, state.last, logger)
