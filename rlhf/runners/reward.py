"""Step 2, reward model: setup -> loop -> save.

A causal-LM backbone (any checkpoint, an SFT output too) with a scalar head, trained with the
pairwise loss -log sigmoid(chosen - rejected) on the reward part of the blend, scored at the last
real token (or DeepSpeed-Chat's mean over diverging tokens), optionally with a chosen^2 +
rejected^2 regularizer. Evaluates accuracy, mean chosen / rejected scores and margin before
training, every ``step.eval_every_steps`` and after each epoch; and how often the model agrees
with the data's rule (the shipped tasks' near misses, or a user's ``data.rule`` on the eval pairs). Saves a folder that
``AutoModelForSequenceClassification.from_pretrained(out, num_labels=1)`` loads.

    python launch.py step=reward model=tiny-opt
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset, concatenate_datasets

from rlhf import engine as engine_factory
from rlhf import losses, models, sequence
from rlhf.checkpoint import save_hf_model
from rlhf.config import Config
from rlhf.data import synthetic
from rlhf.data.blend import DataReport, data_rule, heldout_split, load_step_data, named_rule
from rlhf.data.tokenize import PairCollator, pair_dataset
from rlhf.distributed import first_copies, rank_share
from rlhf.generation import rollout
from rlhf.runners import common, loop

# The policy's answers for its pairs are drawn at temperature 1, wider than PPO's sampling (0.7 by
# default): the pairs should hold the mistakes PPO may reach as the policy moves, not only its likeliest.
POLICY_TEMPERATURE = 1.0


def _scores(values: torch.Tensor, _) -> torch.Tensor:
    return values  # a reward model's output is already one score per token


def pair_scores(engine, batch: dict, score_at: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss before regularization, chosen scores, rejected scores) of a PairCollator batch."""
    values = sequence.per_token(engine, batch["input_ids"], batch["attention_mask"], None, _scores)
    half = values.shape[0] // 2
    scores = losses.gather_at(values, losses.end_indices(batch["attention_mask"]))
    chosen, rejected = scores[:half], scores[half:]
    if score_at == "last":
        return losses.pairwise_loss(chosen, rejected), chosen, rejected
    ids, mask = batch["input_ids"], batch["attention_mask"]
    span = losses.divergence_mask(ids[:half], ids[half:], mask[:half], mask[half:])
    return losses.pairwise_loss_divergence(values[:half], values[half:], span), chosen, rejected


def evaluate(engine, loader, score_at: str) -> dict[str, float]:
    """Pairwise accuracy (chosen scored above rejected), mean scores, their margin, and the loss."""
    def figures(batch: dict) -> tuple:
        loss, chosen, rejected = pair_scores(engine, batch, score_at)
        return (chosen > rejected).float(), chosen, rejected, loss.expand(len(chosen))

    m = common.mean_eval(engine, loader, ("acc", "chosen_score", "rejected_score", "loss"), figures)
    return {**m, "eval/margin": m["eval/chosen_score"] - m["eval/rejected_score"]}


def shipped_candidates(prompts: list[str], answers_per_prompt: int, seed: int) -> list[tuple[str, list]]:
    """The shipped tasks' check: per prompt the right answer and near misses, labeled 1 and 0."""
    rng = random.Random(seed)
    return [(p, synthetic.candidate_answers(p, answers_per_prompt, rng)) for p in prompts]


def rule_candidates(rows, rule) -> list[tuple[str, list]]:
    """A user's rule (data.rule) on the eval pairs: each pair's two answers labeled by the rule's scores."""
    return [(r["prompt"], [(r["chosen"], rule(r["prompt"], r["chosen"])), (r["rejected"], rule(r["prompt"], r["rejected"]))])
            for r in rows]


@torch.no_grad()
def rule_check(engine, tokenizer, cands: list[tuple[str, list]]) -> dict[str, float]:
    """Score each prompt's candidate answers; compare the model's ordering with the rule's labels.

    ``rule_agreement``: of all answer pairs of the same prompt that the rule ranks (one labeled
    higher), the fraction the model orders the same way; ``rule_auc`` (right/wrong labels only):
    how well one score threshold separates right from wrong across prompts -- what PPO needs, since
    it compares rewards of different prompts.
    """
    # The ranks that share each sequence (parallel.sequence) score the same candidates; one of them counts.
    rank, world = sequence.data_rank(dist.get_rank()), sequence.data_world(dist.get_world_size())
    mine, counted = rank_share(cands, rank, world), first_copies(len(cands), rank, world)
    if dist.get_rank() % sequence.size():
        counted = 0
    engine.eval()
    scores, labels, agree, pairs = [], [], 0, 0
    for j, (prompt, answers) in enumerate(mine):
        seqs = [tokenizer(prompt).input_ids + tokenizer(a, add_special_tokens=False).input_ids
                + [tokenizer.eos_token_id] for a, _ in answers]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        values = sequence.per_token(engine, ids.to(engine.device), mask.to(engine.device), None, _scores)
        s = losses.gather_at(values, losses.end_indices(mask.to(engine.device))).cpu()
        if j >= counted:  # a wrapped-round copy: scored for ZeRO-3's equal forwards, counted once elsewhere
            continue
        y = torch.tensor([float(label) for _, label in answers])
        ranked = y.unsqueeze(1) > y.unsqueeze(0)  # [i, j]: the rule puts answer i above answer j
        agree += int(((s.unsqueeze(1) > s.unsqueeze(0)) & ranked).sum())
        pairs += int(ranked.sum())
        scores.append(s)
        labels.append(y)
    engine.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (torch.cat(scores) if scores else torch.zeros(0),
                                      torch.cat(labels) if labels else torch.zeros(0), agree, pairs))
    all_scores = torch.cat([g[0] for g in gathered])
    all_labels = torch.cat([g[1] for g in gathered])
    total_agree, total_pairs = sum(g[2] for g in gathered), sum(g[3] for g in gathered)
    out = {"eval/rule_agreement": total_agree / max(total_pairs, 1), "eval/rule_pairs": float(total_pairs)}
    if bool(((all_labels == 0) | (all_labels == 1)).all()):
        out["eval/rule_auc"] = losses.auc(all_scores, all_labels)
    return out


def rule_check_candidates(cfg: Config, eval_prompts: list[str], tokenizer) -> list:
    """The rule check's answers, on the reported half's prompts: on the shipped tasks, the right answer
    and near misses of each prompt; with a user's rule (data.rule), the eval pairs as the rule ranks
    them; none where no rule knows the prompts or step.rule_check_answers is 0."""
    if not cfg.step.rule_check_answers:
        return []
    prompts = list(dict.fromkeys(eval_prompts[i] for i in heldout_split(eval_prompts, cfg.data.seed)[1]))
    if not cfg.data.rule and all(synthetic.parse_prompt(p) is not None for p in prompts):
        return shipped_candidates(prompts, cfg.step.rule_check_answers, cfg.data.seed)
    if cfg.data.rule:
        rows = load_step_data(cfg.data, cfg.step.name, DataReport(), tokenizer)[1]
        return rule_candidates(rows.select(heldout_split(rows["prompt"], cfg.data.seed)[1]), named_rule(cfg.data.rule, "data.rule", cfg.data, tokenizer))
    return []


@torch.no_grad()
def policy_pairs(cfg: Config, tokenizer, policy_path: str, report: DataReport) -> tuple[list[dict], dict[str, float]]:
    """Pairs from the policy's own answers, labelled by the data's rule (step.policy_pairs_prompts).

    Held-out pairs show the mistakes their writer thought of; PPO climbs the reward model's scores of
    the mistakes this policy makes (a shift task's reward model scored 1.000 on its pairs and 0.87 AUC
    on the SFT policy's answers). So, as InstructGPT collected comparisons of SFT samples, the policy
    samples step.policy_pairs_answers answers for each of step.policy_pairs_prompts train prompts;
    each distinct answer the rule scores below the prompt's best (the best sampled one, or the row's
    chosen where the rule scores it higher) becomes a rejected answer against that best. Written to
    policy_pairs.jsonl, which a resumed run reads back, so it trains on the same pairs; prompts too
    long to answer are counted in ``report`` (split "policy pairs"). Returns the pairs and their
    figures; none where no rule knows the prompts.
    """
    step_cfg, rank, world = cfg.step, dist.get_rank(), dist.get_world_size()
    cache = Path(cfg.run_dir) / "policy_pairs.jsonl"
    if cache.exists():
        lines = cache.read_text().splitlines()
        return [json.loads(line) for line in lines[1:]], json.loads(lines[0])
    rows = load_step_data(cfg.data, cfg.step.name, DataReport(), tokenizer)[0].shuffle(seed=cfg.data.seed)
    rows = rows.select(range(min(step_cfg.policy_pairs_prompts, len(rows))))
    rule = data_rule(cfg.data, rows["prompt"], tokenizer)
    if rule is None:
        return [], {}
    best_known = {r["prompt"]: r["chosen"] for r in rows}
    # Room for an answer as long as the longest right one, and two tokens more to be wrong by length.
    longest = max(len(tokenizer(a, add_special_tokens=False).input_ids) for a in best_known.values())
    max_new = longest + 2
    prompts = rollout.prompt_dataset(rows, tokenizer, step_cfg.max_seq_len - max_new - 1, report, "policy pairs")
    todo = [p for p in prompts for _ in range(step_cfg.policy_pairs_answers)]
    mine = rank_share(todo, rank, world)
    with engine_factory.loading_context(cfg):
        model = models.load_causal_lm(policy_path, tokenizer, engine_factory.model_dtype(cfg), 0.0,
                                      cfg.model.trust_remote_code)
    policy, _ = engine_factory.build_frozen_engine(model, cfg)
    drawn: list[tuple[str, str]] = []
    # ZeRO-3 gathers layer by layer here: the pre-flight did not plan a whole gathered policy.
    for batch, _, _, answers in rollout.sampled_answers(policy, mine, tokenizer, step_cfg.eval_micro_batch_size_per_device,
                                                        cfg.seed + rank, max_new_tokens=max_new, do_sample=True,
                                                        temperature=POLICY_TEMPERATURE):
        drawn += zip(batch["prompts"], answers, strict=True)
    del policy, model
    gc.collect()
    gathered = [None] * world
    dist.all_gather_object(gathered, drawn)
    answers: dict[str, list[str]] = {}
    for prompt, answer in [d for part in gathered for d in part][:len(todo)]:  # without the padding
        answers.setdefault(prompt, []).append(answer)
    pairs, right = [], 0
    for prompt, sampled in answers.items():
        scored = [(rule(prompt, a), a) for a in sampled]
        right += sum(s >= 1 for s, _ in scored)
        best_score, best = max(scored, key=lambda t: t[0])
        known = rule(prompt, best_known[prompt])
        if known > best_score:
            best_score, best = known, best_known[prompt]
        pairs += [{"prompt": prompt, "chosen": best, "rejected": a}
                  for s, a in {a: (s, a) for s, a in scored}.values() if s < best_score]
    figures = {"policy_pairs": float(len(pairs)), "policy_pairs_prompts": float(len(answers)),
               "policy_sampled_accuracy": right / max(len(todo), 1)}
    if rank == 0:
        cache.write_text("\n".join(json.dumps(x) for x in [figures, *pairs]) + "\n")
    return pairs, figures


def with_policy_pairs(cfg: Config, tokenizer, policy_path: str, train_ds, report: DataReport) -> tuple:
    """The train pairs with those of the policy's own answers added (policy_pairs), and their figures;
    unchanged where step.policy_pairs_prompts is 0 or no rule knows the prompts."""
    if not cfg.step.policy_pairs_prompts:
        return train_ds, {}
    pairs, own = policy_pairs(cfg, tokenizer, policy_path, report)
    if pairs:
        train_ds = concatenate_datasets([train_ds, pair_dataset(Dataset.from_list(pairs), tokenizer,
                                                                cfg.step.max_seq_len, report, "policy pairs")])
    if dist.get_rank() == 0 and own:  # data_report.json again, with the policy pairs' drops
        (Path(cfg.run_dir) / "data_report.json").write_text(json.dumps(report.as_dict(), indent=2))
        common.say(f"[reward] the policy's own answers on {own['policy_pairs_prompts']:.0f} train prompts: "
                   f"{own['policy_sampled_accuracy']:.1%} right by the rule; {own['policy_pairs']:.0f} pairs "
                   "of a wrong one against a right one added (policy_pairs.jsonl)")
    return train_ds, own


def heldout_halves(eval_ds, cfg: Config) -> tuple:
    """Held-out pairs, split by prompt: patience and the best model read one half (select/*), every
    reported figure comes from the other (eval/*). One prompt: no split, both read it."""
    select_rows, report_rows = heldout_split([tuple(ids[:n]) for ids, n in zip(eval_ds["chosen_ids"],
                                                                                eval_ds["prompt_len"], strict=True)],
                                             cfg.data.seed)
    if not select_rows:
        select_rows = report_rows = list(range(len(eval_ds)))
    return eval_ds.select(select_rows), eval_ds.select(report_rows)


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg = dist.get_rank(), dist.get_world_size(), cfg.step
    model_path, tokenizer = common.model_and_tokenizer(cfg)

    train_ds, eval_ds, eval_prompts, report = common.step_data(
        cfg, cfg.step.name, tokenizer, {"max_seq_len": step_cfg.max_seq_len},
        lambda rows, split, rep: pair_dataset(rows, tokenizer, step_cfg.max_seq_len, rep, split, cfg.data.on_bad_row))
    train_ds, own = with_policy_pairs(cfg, tokenizer, step_cfg.policy_path or model_path, train_ds, report)
    collate = PairCollator(tokenizer.pad_token_id)
    loader, sampler = common.train_loader(train_ds, cfg, rank, world, collate)
    selection, evaluation = (common.eval_loader(part, cfg, rank, world, collate) for part in heldout_halves(eval_ds, cfg))
    cands = rule_check_candidates(cfg, eval_prompts, tokenizer)
    total_steps = common.plan_steps(cfg, len(loader), len(train_ds))

    engine, n_params, ckpt = common.train_engine(cfg, models.load_reward_model, model_path, tokenizer, total_steps, "reward")
    if rank == 0:
        common.say(f"[reward] {len(train_ds)} train pairs, {len(eval_ds)} eval pairs, {total_steps} optimizer steps of "
              f"{step_cfg.global_batch_size} pairs, {n_params / 1e6:.2f}M parameters")
    state, resumed, logger = common.start_loop(ckpt, cfg, rank, total_steps, ("loss", "acc", "chosen", "rejected"), cfg.step.name)

    def full_eval(step: int, epoch: int) -> dict[str, float]:
        metrics = {**common.as_select(evaluate(engine, selection, step_cfg.score_at)),
                   **evaluate(engine, evaluation, step_cfg.score_at)}
        if cands:
            metrics.update(rule_check(engine, tokenizer, cands))
        logger.log({**metrics, "epoch": epoch}, step=step)
        if rank == 0:
            common.say(f"[reward] step {step} " + " ".join(f"{k.removeprefix('eval/')}={v:.4f}"
                                                           for k, v in metrics.items()))
        return metrics

    def ready(epoch: int) -> bool:
        """Evaluate; keep the model of a new best held-out accuracy; whether patience has run out."""
        state.last, state.last_eval_step = full_eval(state.step, epoch), state.step
        done = state.judge(state.last, "select/acc", True, step_cfg.early_stop_patience)
        if state.best_step == state.step and step_cfg.keep_best and step_cfg.save_model:
            save_hf_model(engine, tokenizer, Path(cfg.run_dir) / "best_model")
        return done

    def micro_step(batch: dict) -> tuple:
        loss, chosen, rejected = pair_scores(engine, batch, step_cfg.score_at)
        if step_cfg.score_regularizer:
            loss = loss + step_cfg.score_regularizer * losses.score_regularizer(chosen, rejected)
        return loss, {"acc": losses.pairwise_accuracy(chosen, rejected).item(), "chosen": chosen.mean().item(),
                      "rejected": rejected.mean().item()}

    # -------------------------------------------------------------------------------- loop
    if not resumed:
        state.first = state.last = full_eval(0, 0)
        state.judge(state.first, "select/acc", True, 0)
    loop.train(cfg, state, ckpt, logger, loop.Supervised(cfg, engine, loader, sampler, ckpt, state, logger, n_params,
                                                          micro_step, ready, "reward loss", postfix=("loss", "acc")))

    # -------------------------------------------------------------------------------- save
    def keep_best(final: dict) -> None:
        """model/ is the best evaluation's reward model, the last one model_last/ (rank 0 moves them);
        the figures of the policy's own pairs."""
        final.update(own)
        best = Path(cfg.run_dir) / "best_model"
        if rank != 0 or not best.exists():
            return
        if state.best_step == state.step or not step_cfg.keep_best:
            shutil.rmtree(best)
            return
        shutil.rmtree(Path(cfg.run_dir) / "model_last", ignore_errors=True)
        os.replace(Path(cfg.run_dir) / "model", Path(cfg.run_dir) / "model_last")
        os.replace(best, Path(cfg.run_dir) / "model")
        final.update({f"{k}_last": v for k, v in state.last.items()}, **state.best, best_step=state.best_step)
        common.say(f"[reward] output: model/ is the reward model of step {state.best_step} (held-out accuracy "
                   f"{state.best['eval/acc']:.4f}, the best evaluation by select/acc); the last one "
                   f"({state.last['eval/acc']:.4f}) is in model_last/")

    return common.finish(cfg, engine, tokenizer, rank, state.step, state.first, state.last, logger, keep_best,
                         stopped_by=state.stop_reason(cfg))
