"""Step 2, reward model: setup -> loop -> save.

A causal-LM backbone (any checkpoint, an SFT output too) with a scalar head, trained with the
pairwise loss -log sigmoid(chosen - rejected) on the reward part of the blend, scored at the last
real token (or DeepSpeed-Chat's mean over diverging tokens), optionally with a chosen^2 +
rejected^2 regularizer. Evaluates accuracy, mean chosen / rejected scores and margin before
training, every ``step.eval_every_steps`` and after each epoch; on the shipped synthetic task also
how often the model agrees with the rule. Saves a folder that
``AutoModelForSequenceClassification.from_pretrained(out, num_labels=1)`` loads.

    python launch.py step=reward model=tiny-opt
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from tqdm import tqdm

from rlhf import losses, models
from rlhf.checkpoint import StopRequest
from rlhf.config import Config
from rlhf.data import synthetic
from rlhf.data.tokenize import PairCollator, pair_dataset
from rlhf.distributed import mean_over_ranks
from rlhf.runners import common


def pair_scores(engine, batch: dict, score_at: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss before regularization, chosen scores, rejected scores) of a PairCollator batch."""
    values = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    half = values.shape[0] // 2
    scores = losses.gather_at(values, losses.end_indices(batch["attention_mask"]))
    chosen, rejected = scores[:half], scores[half:]
    if score_at == "last":
        return losses.pairwise_loss(chosen, rejected), chosen, rejected
    ids, mask = batch["input_ids"], batch["attention_mask"]
    span = losses.divergence_mask(ids[:half], ids[half:], mask[:half], mask[half:])
    return losses.pairwise_loss_divergence(values[:half], values[half:], span), chosen, rejected


@torch.no_grad()
def evaluate(engine, loader, score_at: str) -> dict[str, float]:
    engine.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=engine.device)  # pairs, correct, chosen, rejected, loss
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss, chosen, rejected = pair_scores(engine, batch, score_at)
        sums += torch.stack([torch.tensor(float(len(chosen)), device=sums.device), (chosen > rejected).sum().double(),
                             chosen.sum().double(), rejected.sum().double(), loss.double() * len(chosen)])
    dist.all_reduce(sums)
    engine.train()
    n = sums[0].clamp(min=1)
    return {"eval/acc": (sums[1] / n).item(), "eval/chosen_score": (sums[2] / n).item(),
            "eval/rejected_score": (sums[3] / n).item(), "eval/margin": ((sums[2] - sums[3]) / n).item(),
            "eval/loss": (sums[4] / n).item()}


@torch.no_grad()
def rule_check(engine, tokenizer, prompts: list[str], answers_per_prompt: int, seed: int) -> dict[str, float]:
    """Score the right answer and near misses of each prompt; compare the ranking with the rule's.

    ``rule_agreement``: of all (right, wrong) answer pairs of the same prompt, the fraction the
    model orders right; ``rule_auc``: how well one score threshold separates right from wrong
    across prompts -- what PPO needs, since it compares rewards of different prompts.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    cands = [(p, synthetic.candidate_answers(p, answers_per_prompt, rng)) for p in prompts]
    per_rank = -(-len(cands) // world)
    mine = [cands[i % len(cands)] for i in range(rank * per_rank, (rank + 1) * per_rank)]  # equal work per rank
    engine.eval()
    scores, labels, agree, pairs = [], [], 0, 0
    for prompt, answers in mine:
        seqs = [tokenizer(prompt).input_ids + tokenizer(a, add_special_tokens=False).input_ids
                + [tokenizer.eos_token_id] for a, _ in answers]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        values = engine(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device))
        s = losses.gather_at(values, losses.end_indices(mask.to(engine.device))).cpu()
        y = torch.tensor([label for _, label in answers])
        diff = s[y == 1].unsqueeze(1) - s[y == 0].unsqueeze(0)
        agree += int((diff > 0).sum())
        pairs += diff.numel()
        scores.append(s)
        labels.append(y)
    engine.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, (torch.cat(scores), torch.cat(labels), agree, pairs))
    all_scores = torch.cat([g[0] for g in gathered])
    all_labels = torch.cat([g[1] for g in gathered])
    total_agree, total_pairs = sum(g[2] for g in gathered), sum(g[3] for g in gathered)
    return {"eval/rule_agreement": total_agree / max(total_pairs, 1),
            "eval/rule_auc": losses.auc(all_scores, all_labels)}


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg = dist.get_rank(), dist.get_world_size(), cfg.step
    model_path, tokenizer = common.model_and_tokenizer(cfg)

    train_ds, eval_ds, eval_prompts, _ = common.step_data(
        cfg, "reward", tokenizer, {"max_seq_len": step_cfg.max_seq_len},
        lambda rows, split, rep: pair_dataset(rows, tokenizer, step_cfg.max_seq_len, rep, split, cfg.data.on_bad_row))
    collate = PairCollator(tokenizer.pad_token_id)
    loader, sampler = common.train_loader(train_ds, cfg, rank, world, collate)
    evaluation = common.eval_loader(eval_ds, cfg, rank, world, collate)
    # The rule check runs only where the rule knows every eval prompt (the shipped tasks).
    rule_prompts = list(dict.fromkeys(eval_prompts))
    if step_cfg.rule_check_answers == 0 or any(synthetic.parse_prompt(p) is None for p in rule_prompts):
        rule_prompts = []
    total_steps = common.plan_steps(cfg, len(loader), len(train_ds))

    engine, n_params, ckpt = common.train_engine(cfg, models.load_reward_model, model_path, tokenizer, total_steps, "reward")
    if rank == 0:
        common.say(f"[reward] {len(train_ds)} train pairs, {len(eval_ds)} eval pairs, {total_steps} optimizer steps of "
              f"{step_cfg.global_batch_size} pairs, {n_params / 1e6:.2f}M parameters")
    state, resumed, logger = common.start_loop(ckpt, cfg, rank, total_steps, ("loss", "acc", "chosen", "rejected"), "reward")
    stop = StopRequest()

    def full_eval(step: int, epoch: int) -> dict[str, float]:
        metrics = evaluate(engine, evaluation, step_cfg.score_at)
        if rule_prompts:
            metrics.update(rule_check(engine, tokenizer, rule_prompts, step_cfg.rule_check_answers, cfg.data.seed))
        logger.log({**metrics, "epoch": epoch}, step=step)
        if rank == 0:
            common.say(f"[reward] step {step} " + " ".join(f"{k[5:]}={v:.4f}" for k, v in metrics.items()))
        return metrics

    # -------------------------------------------------------------------------------- loop
    if not resumed:
        state.first = state.last = full_eval(0, 0)
    meter = common.Throughput(cfg, n_params, world)
    meter.micro = state.window_micro
    skip = state.batch_index

    bar = tqdm(total=state.total_steps, initial=state.step, desc="reward",
               disable=rank != 0 or not cfg.logging.progress_bar)
    for epoch in range(state.epoch, step_cfg.epochs):
        for index, batch in common.micro_batches(loader, sampler, epoch, skip, engine.device):
            loss, chosen, rejected = pair_scores(engine, batch, step_cfg.score_at)
            if step_cfg.score_regularizer:
                loss = loss + step_cfg.score_regularizer * losses.score_regularizer(chosen, rejected)
            value, boundary = common.optimize(engine, loss, ckpt, state, epoch, index, meter, batch, "reward loss")
            window = state.window
            window["loss"] += value
            window["acc"] += losses.pairwise_accuracy(chosen, rejected).item()
            window["chosen"] += chosen.mean().item()
            window["rejected"] += rejected.mean().item()
            if not boundary:
                continue
            state.step += 1
            bar.update(1)
            if state.step % step_cfg.log_every_steps == 0 or state.step == state.total_steps:
                metrics = mean_over_ranks({k: v / meter.micro for k, v in window.items()})
                metrics.update(lr=engine.get_lr()[0], epoch=epoch, **meter.summary(step_cfg.global_batch_size))
                logger.log(metrics, step=state.step)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", acc=f"{metrics['acc']:.3f}")
                state.window = dict.fromkeys(window, 0.0)
            if step_cfg.eval_every_steps and state.step % step_cfg.eval_every_steps == 0:
                state.last, state.last_eval_step = full_eval(state.step, epoch), state.step
            if state.step >= state.total_steps:
                break
            ckpt.after_step(state.step, state.at(epoch, index + 1, meter.micro), stop, logger, "reward")
        skip = 0
        if state.last_eval_step != state.step:
            state.last, state.last_eval_step = full_eval(state.step, epoch + 1), state.step
        if state.step >= state.total_steps:
            break
        # The epoch boundary: a resume trains the remaining epochs.
        ckpt.save(state.step, state.at(epoch + 1, 0, meter.micro))
    bar.close()

    # -------------------------------------------------------------------------------- save
    return common.finish(cfg, engine, tokenizer, rank, state.step, state.first, state.last, logger)
