"""PPO's set-up: the four roles (actor, reference, critic, reward model) through the one engine
factory, and the prompts (train loader, held-out halves, PPO-ptx batches). rlhf.runners.ppo builds
them once at the start of a run.

    python launch.py step=ppo actor.path=<sft out>/model critic.path=<reward out>/model
"""

from __future__ import annotations

from dataclasses import dataclass

from datasets import Dataset
from torch.utils.data import DataLoader, DistributedSampler

from rlhf import engine as engine_factory
from rlhf import losses, models, rewards
from rlhf.config import STEPS, Config, ConfigError
from rlhf.data.blend import DataReport, data_rule, heldout_split, load_step_data, load_text_sources, named_rule
from rlhf.data.tokenize import PadCollator, sft_dataset
from rlhf.generation.rollout import left_pad, prompt_dataset
from rlhf.runners.common import count_params, write_data_report


@dataclass
class Roles:
    """PPO's models and scorers, built once (build_roles): engines for the actor and its frozen
    reference, the critic (None for critic-free estimators) and the frozen reward model (None without
    a reward-model weight); the reward rule and the rule that judges greedy answers."""

    tokenizer: object
    actor_path: str
    actor: object
    ref: object
    critic: object | None
    reward: object | None
    rule_fn: object | None
    eval_rule: object | None
    ds_configs: dict
    n_actor: int
    n_critic: int


@dataclass
class Prompts:
    """PPO's data: the train prompts' loader (prompts repeated samples_per_prompt times, left-padded),
    the held-out halves (select/* picks the best actor; eval/* reports), the PPO-ptx batches, the
    number of PPO steps and the data report."""

    loader: DataLoader
    sampler: DistributedSampler
    count: int
    select: list[dict]
    report_half: list[dict]
    ptx: object | None
    steps: int
    report: DataReport


def checked_tokenizer(cfg: Config) -> tuple[object, str, str, str]:
    """The actor's tokenizer (left padding) and the actor, critic and reward paths; refuses a critic or
    reward model of another tokenizer (it would score the actor's token ids as noise)."""
    actor_path = models.checkpoint_path(cfg.actor.path) or models.resolve_path(cfg.model)
    reward_path = models.checkpoint_path(cfg.reward.path or cfg.critic.path)
    if problems := models.ppo_role_problems(cfg):
        raise ConfigError("; ".join(problems))
    # Critic-free estimators (GRPO, RLOO, REINFORCE++) build no critic: no model, optimizer or checkpoint.
    critic_path = (models.checkpoint_path(cfg.critic.path) or reward_path or actor_path) \
        if losses.ESTIMATORS[cfg.step.advantage_estimator].needs_critic else ""
    tokenizer = models.load_tokenizer(actor_path, cfg.model.trust_remote_code)
    for role, path in (("critic", critic_path), ("reward", reward_path if cfg.step.reward_model_weight > 0 else "")):
        if path and path != actor_path:
            why = models.tokenizer_mismatch(tokenizer, models.load_tokenizer(path, cfg.model.trust_remote_code))
            if why:
                raise ConfigError(f"PPO's {role} model {path} uses another tokenizer than the actor {actor_path} "
                                  f"({why}): it would score the actor's token ids as noise. Train the reward model "
                                  "from a model of the actor's family")
    tokenizer.padding_side = "left"
    return tokenizer, actor_path, critic_path, reward_path


def build_prompts(cfg: Config, tokenizer, rank: int, world: int) -> Prompts:
    step_cfg = cfg.step
    report = DataReport()
    train_rows, eval_rows = load_step_data(cfg.data, cfg.step.name, report, tokenizer)
    train_prompts = prompt_dataset(train_rows, tokenizer, step_cfg.max_prompt_len, report, "train",
                                   cfg.data.long_prompts)
    # Held-out prompts, halved: keeping the best actor and the hacking warning read one half
    # (select/*), every reported figure (before, after, the output's) comes from the other (eval/*).
    select, report_half = (
        prompt_dataset(eval_rows.select(part), tokenizer, step_cfg.max_prompt_len, report, "eval",
                       cfg.data.long_prompts) for part in heldout_split(eval_rows["prompt"], cfg.data.seed, step_cfg.eval_prompts))
    per_step = step_cfg.rollout_batch_size_per_device // step_cfg.samples_per_prompt
    sampler = DistributedSampler(train_prompts, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed,
                                 drop_last=True)
    loader = DataLoader(train_prompts, batch_size=per_step, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: left_pad([x for x in b for _ in range(step_cfg.samples_per_prompt)],
                                                      tokenizer.pad_token_id))
    steps = len(loader) * step_cfg.epochs
    if step_cfg.max_steps > 0:
        steps = min(steps, step_cfg.max_steps)
    if steps == 0:
        raise ValueError(f"{len(train_prompts)} prompts make no PPO step of {per_step} prompts per device")
    ptx = None
    if step_cfg.ptx_coef > 0:
        ptx_len = step_cfg.max_prompt_len + step_cfg.max_new_tokens
        if cfg.data.ptx_sources:  # unsupervised text: next-token loss on all of it, cut to the rollout length
            ids = [(tokenizer(t).input_ids + [tokenizer.eos_token_id])[:ptx_len] for t in load_text_sources(cfg.data)]
            ptx_ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
        else:
            ptx_rows, _ = load_step_data(cfg.data, STEPS[cfg.step.name].source_of("actor.path"), report, tokenizer)
            ptx_ds = sft_dataset(ptx_rows, tokenizer, ptx_len, "all", report, "ptx", cfg.data.on_bad_row)
        ptx_loader = DataLoader(ptx_ds, batch_size=step_cfg.micro_batch_size_per_device, drop_last=True,
                                sampler=DistributedSampler(ptx_ds, num_replicas=world, rank=rank, seed=cfg.seed),
                                collate_fn=PadCollator(tokenizer.pad_token_id))
        ptx = iter(_forever(ptx_loader))
    if rank == 0:
        write_data_report(cfg, cfg.step.name, report)
    return Prompts(loader, sampler, len(train_prompts), select, report_half, ptx, steps, report)


def build_roles(cfg: Config, tokenizer, paths: tuple[str, str, str], eval_prompts: list[dict],
                total_updates: int) -> Roles:
    """Load the four models through the one engine factory (sharded while loading under ZeRO-3) and
    resolve the reward rule and the rule that judges greedy answers."""
    step_cfg, (actor_path, critic_path, reward_path) = cfg.step, paths
    # The data's rule (data.rule, or the shipped tasks' on their prompts) measures greedy accuracy and
    # the truth of the rollouts even when it is not part of the reward: the check against the truth.
    truth = data_rule(cfg.data, [p["prompt"] for p in eval_prompts], tokenizer)
    rule_fn = None
    if step_cfg.reward_fn == rewards.DATA_RULE:
        if truth is None:
            raise ConfigError("step.reward_fn=rule but no rule scores these prompts: set data.rule="
                              "package.module:function, or give step.reward_fn such a reference")
        rule_fn = truth
    elif step_cfg.reward_fn:
        rule_fn = named_rule(step_cfg.reward_fn, "step.reward_fn", cfg.data, tokenizer)
    dtype, trust = engine_factory.model_dtype(cfg), cfg.model.trust_remote_code
    with engine_factory.loading_context(cfg):
        actor_model = models.load_causal_lm(actor_path, tokenizer, dtype, 0.0, trust)
        ref_model = models.load_causal_lm(actor_path, tokenizer, dtype, 0.0, trust)
        critic_model = models.load_reward_model(critic_path, tokenizer, dtype, 0.0, trust) if critic_path else None
        reward_model = (models.load_reward_model(reward_path, tokenizer, dtype, 0.0, trust)
                        if step_cfg.reward_model_weight > 0 else None)
    actor, actor_ds = engine_factory.build_train_engine(actor_model, cfg, max(total_updates, 1))
    # Updated without dropout, LoRA's included: the ratio's old and new log-probs and the reference's
    # are all of the same dropout-free forward.
    engine_factory.disable_dropout(actor.module)
    ref, ref_ds = engine_factory.build_frozen_engine(ref_model, cfg, offload=step_cfg.offload_reference)
    critic, critic_ds = (engine_factory.build_train_engine(critic_model, cfg, max(total_updates, 1),
                                                           lr=step_cfg.critic_lr, use_lora=False)
                         if critic_model is not None else (None, None))
    reward, reward_ds = (engine_factory.build_frozen_engine(reward_model, cfg, offload=step_cfg.offload_reward)
                         if reward_model is not None else (None, None))
    ds_configs = {k: v for k, v in {"actor": actor_ds, "reference": ref_ds, "critic": critic_ds,
                                    "reward": reward_ds}.items() if v}
    return Roles(tokenizer, actor_path, actor, ref, critic, reward, rule_fn, truth or rule_fn, ds_configs,
                 count_params(actor.module), count_params(critic.module) if critic else 0)


def _forever(loader):
    """The loader's batches without end, a new shuffle per pass: PPO-ptx draws one per update."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
