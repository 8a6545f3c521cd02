"""DPO, DeepSpeed-Chat's alternative to steps 2-3: setup -> loop -> save.

The policy (from the SFT output, ``actor.path``) learns straight from the reward part's preference
pairs, with no reward model and no rollouts: the loss (rlhf.losses.DPO_LOSSES: sigmoid, ipo,
robust) pushes up beta * [(log pi(chosen) - log pi(rejected)) - (the same under the frozen
reference)]. The reference's log-probs are computed once before training and the reference freed
(``step.reference_logprobs=precompute``), or scored on every batch (``online``). Logs the implicit
rewards beta * log(pi / ref) of chosen and rejected answers, their margin and the preference
accuracy; on data a rule knows, greedy held-out accuracy too. Saves a folder that
``AutoModelForCausalLM.from_pretrained`` loads, like SFT.

    python launch.py step=dpo actor.path=<sft out>/model
    python launch.py pipeline=dpo                          # SFT -> DPO
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from rlhf import engine as engine_factory
from rlhf import losses, memory, models, rollout
from rlhf.config import Config
from rlhf.data.tokenize import PairCollator, pair_dataset
from rlhf.runners import common, loop


def pair_logprobs(engine, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the chosen and of the rejected answers of a PairCollator batch."""
    logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = losses.sequence_logprob(logits, batch["input_ids"], batch["answer_mask"])
    half = logp.shape[0] // 2
    return logp[:half], logp[half:]


def dpo_loss(policy: tuple, ref: tuple, chosen_tokens: torch.Tensor, step_cfg) -> tuple[torch.Tensor, dict]:
    """The step's loss, mean over pairs (plus step.nll_coef x the chosen answers' NLL), and the
    per-pair implicit rewards beta * log(pi / ref)."""
    chosen, rejected = step_cfg.beta * (policy[0] - ref[0]), step_cfg.beta * (policy[1] - ref[1])
    margin = losses.dpo_margin(policy[0], policy[1], ref[0], ref[1])
    loss = losses.DPO_LOSSES[step_cfg.loss](margin, step_cfg.beta, step_cfg.label_smoothing).mean()
    if step_cfg.nll_coef:
        loss = loss + step_cfg.nll_coef * losses.answer_nll(policy[0], chosen_tokens)
    return loss, {"chosen": chosen.detach(), "rejected": rejected.detach()}


def chosen_tokens(batch: dict) -> torch.Tensor:
    """Answer tokens (eos included) of each chosen answer, the first half of a PairCollator batch."""
    mask = batch["answer_mask"]
    return mask[: mask.shape[0] // 2].sum(-1)


def preferred(r: dict[str, torch.Tensor]) -> torch.Tensor:
    """1 where the chosen answer's implicit reward is above the rejected one's, 0.5 on a tie (at the
    start policy = reference, so the accuracy starts at chance, 0.5)."""
    return (r["chosen"] > r["rejected"]).float() + 0.5 * (r["chosen"] == r["rejected"]).float()


@torch.no_grad()
def precompute_reference(ref, ds, collate, batch_size: int):
    """ds with the reference's summed log-probs of each pair's answers as columns ref_chosen /
    ref_rejected. Each rank scores its share; the shares are gathered so that every rank holds all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref.eval()
    # No shuffle: the share is a fixed slice; padded to equal length (ZeRO-3 ranks must run alike).
    mine = list(DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False))
    found: dict[int, tuple[float, float]] = {}
    for i in range(0, len(mine), batch_size):
        idx = mine[i:i + batch_size]
        batch = {k: v.to(ref.device) for k, v in collate([ds[j] for j in idx]).items()}
        chosen, rejected = pair_logprobs(ref, batch)
        found.update(zip(idx, zip(chosen.float().tolist(), rejected.float().tolist(), strict=True), strict=True))
    shares = [None] * world
    dist.all_gather_object(shares, found)
    merged = {k: v for share in shares for k, v in share.items()}
    return ds.add_column("ref_chosen", [merged[i][0] for i in range(len(ds))]).add_column(
        "ref_rejected", [merged[i][1] for i in range(len(ds))])


@torch.no_grad()
def evaluate(engine, ref, loader, step_cfg) -> dict[str, float]:
    """Loss, preference accuracy (chosen's implicit reward above rejected's), rewards and margin."""
    engine.eval()
    sums = torch.zeros(6, dtype=torch.float64, device=engine.device)  # pairs, correct, chosen, rejected, loss, logp
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        policy = pair_logprobs(engine, batch)
        reference = (batch["ref_chosen"], batch["ref_rejected"]) if ref is None else pair_logprobs(ref, batch)
        loss, r = dpo_loss(policy, reference, chosen_tokens(batch), step_cfg)
        n = len(r["chosen"])
        sums += torch.stack([torch.tensor(float(n), device=sums.device), preferred(r).sum().double(),
                             r["chosen"].sum().double(), r["rejected"].sum().double(), loss.double() * n,
                             policy[0].sum().double()])
    dist.all_reduce(sums)
    engine.train()
    n = sums[0].clamp(min=1)
    return {"eval/loss": (sums[4] / n).item(), "eval/pref_acc": (sums[1] / n).item(),
            "eval/chosen_reward": (sums[2] / n).item(), "eval/rejected_reward": (sums[3] / n).item(),
            "eval/margin": ((sums[2] - sums[3]) / n).item(), "eval/chosen_logp": (sums[5] / n).item()}


def preference_data(cfg: Config) -> tuple:
    """What a preference step (DPO, SimPO) starts from: the policy's path (actor.path, an SFT output)
    and tokenizer, the reward part's tokenized pairs (train, eval) with their collator, and the
    data's rule with the reported prompts it scores greedy answers on."""
    model_path = cfg.actor.path or models.resolve_path(cfg.model)
    tokenizer = models.load_tokenizer(model_path, cfg.model.trust_remote_code)
    max_len = cfg.step.max_seq_len
    train_ds, eval_ds, eval_prompts, report = common.step_data(
        cfg, cfg.step.name, tokenizer, {"max_seq_len": max_len},
        lambda rows, split, rep: pair_dataset(rows, tokenizer, max_len, rep, split, cfg.data.on_bad_row))
    rule, accuracy_prompts = common.greedy_check(cfg, eval_prompts, tokenizer, report)
    return (model_path, tokenizer, train_ds, eval_ds, PairCollator(tokenizer.pad_token_id, answer_mask=True), rule,
            accuracy_prompts)


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg = dist.get_rank(), dist.get_world_size(), cfg.step
    model_path, tokenizer, train_ds, eval_ds, collate, rule, accuracy_prompts = preference_data(cfg)
    gathering = memory.generation_gathering(cfg)

    dtype = engine_factory.model_dtype(cfg)
    with engine_factory.loading_context(cfg):
        ref_model = models.load_causal_lm(model_path, tokenizer, dtype, 0.0, cfg.model.trust_remote_code)
    ref, ref_ds = engine_factory.build_frozen_engine(ref_model, cfg, offload=step_cfg.offload_reference)
    if step_cfg.reference_logprobs == "precompute":
        # One pass over every pair, then the reference is gone: training holds one model.
        train_ds = precompute_reference(ref, train_ds, collate, step_cfg.eval_micro_batch_size_per_device)
        eval_ds = precompute_reference(ref, eval_ds, collate, step_cfg.eval_micro_batch_size_per_device)
        del ref, ref_model
        ref = None
    loader, sampler = common.train_loader(train_ds, cfg, rank, world, collate)
    evaluation = common.eval_loader(eval_ds, cfg, rank, world, collate)
    total_steps = common.plan_steps(cfg, len(loader), len(train_ds))

    # The reference is scored without dropout (eval mode); so is the policy unless step.disable_dropout=false.
    engine, n_params, ckpt = common.train_engine(cfg, models.load_causal_lm, model_path, tokenizer, total_steps, "actor",
                                                 frozen={"reference": ref_ds},
                                                 dropout=0.0 if step_cfg.disable_dropout else None)
    if rank == 0:
        common.say(f"[dpo] {len(train_ds)} train pairs, {len(eval_ds)} eval pairs, {total_steps} optimizer steps of "
                   f"{step_cfg.global_batch_size} pairs, {n_params / 1e6:.2f}M parameters; loss {step_cfg.loss}, "
                   f"beta {step_cfg.beta}, reference log-probs {step_cfg.reference_logprobs}")
    state, resumed, logger = common.start_loop(ckpt, cfg, rank, total_steps,
                                               ("loss", "pref_acc", "chosen_reward", "rejected_reward"), "dpo")

    def full_eval(step: int, epoch: int) -> dict[str, float]:
        metrics = evaluate(engine, ref, evaluation, step_cfg)
        if accuracy_prompts:
            metrics.update(rollout.evaluate(engine, None, rule, accuracy_prompts, tokenizer, step_cfg.max_new_tokens,
                                            step_cfg.eval_micro_batch_size_per_device, gathering))
        logger.log({**metrics, "epoch": epoch}, step=step)
        if rank == 0:
            common.say(f"[dpo] step {step} " + " ".join(f"{k[5:]}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def ready(epoch: int) -> bool:
        """Evaluate; DPO has no readiness rule: it trains its full length."""
        state.last, state.last_eval_step = full_eval(state.step, epoch), state.step
        return False

    def micro_step(batch: dict) -> tuple:
        policy = pair_logprobs(engine, batch)
        if ref is None:
            reference = (batch["ref_chosen"], batch["ref_rejected"])
        else:
            with torch.no_grad():
                reference = pair_logprobs(ref, batch)
        loss, r = dpo_loss(policy, reference, chosen_tokens(batch), step_cfg)
        return loss, {"pref_acc": preferred(r).mean().item(), "chosen_reward": r["chosen"].mean().item(),
                      "rejected_reward": r["rejected"].mean().item()}

    # -------------------------------------------------------------------------------- loop
    if not resumed:
        state.first = state.last = full_eval(0, 0)
    loop.train(cfg, engine, loader, sampler, ckpt, state, logger, n_params, micro_step, ready, "DPO loss",
               derive=lambda m: {"margin": m["chosen_reward"] - m["rejected_reward"]}, postfix=("loss", "pref_acc"))

    # -------------------------------------------------------------------------------- save
    return common.finish(cfg, engine, tokenizer, rank, state.step, state.first, state.last, logger)
