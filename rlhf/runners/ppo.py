"""Step 3, RLHF with PPO: setup -> loop (experience, update, judge) -> save.

Four roles through the one engine factory: the actor (trainable, from the SFT output) and its
frozen reference copy, the critic (trainable, from the reward model) and the frozen reward model.
Each PPO step samples answers to a batch of left-padded prompts, scores them (reward model and/or
a reward function such as the shipped task's rule), turns the scores into advantages by
step.advantage_estimator -- GAE against the critic, or a critic-free GRPO, RLOO, REINFORCE++ (then
no critic is built) -- with the KL to the reference in the reward or in the loss (step.kl_in), and
runs ppo_epochs of clipped policy (and value) updates. The parts live beside this file:

    ppo_setup       roles (actor, reference, critic, reward model) and prompts, built once
    ppo_experience  rollouts and scoring -> Experience (advantages included)
    ppo_update      the policy and value losses over micro-batches
    ppo_judge       evaluations, best actor, warnings, start check (a callback the run calls)

The RL math is in rlhf/losses/ (advantages.py, policy.py, tokens.py).

    python launch.py step=ppo actor.path=<sft out>/model critic.path=<reward out>/model
    python launch.py step=ppo step.advantage_estimator=rloo step.samples_per_prompt=4 actor.path=... critic.path=...
    python launch.py step=ppo step.reward_fn=rule step.reward_model_weight=0 actor.path=<sft out>/model
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf import losses
from rlhf.chain import readiness
from rlhf.checkpoint import (
    Checkpointer,
    gather_state_dict,
    param_fingerprint,
    save_hf_model,
    set_rng_state,
)
from rlhf.config import Config, ConfigError, ppo_updates_per_step, role_models
from rlhf.generation.sampling import Sampling
from rlhf.models import ModelSizes, model_sizes
from rlhf.observe.logging import peak_memory_gb
from rlhf.preflight import memory
from rlhf.runners import loop
from rlhf.runners.common import finish, open_logger, say
from rlhf.runners.ppo_experience import make_experience, rollout_metrics
from rlhf.runners.ppo_judge import Judge
from rlhf.runners.ppo_setup import Prompts, Roles, build_prompts, build_roles, checked_tokenizer
from rlhf.runners.ppo_update import ppo_update


@dataclass
class Setup:
    """What the loop works with, built once by run()."""

    cfg: Config
    roles: Roles
    prompts: Prompts
    # The rollouts' sampling (the start check draws the same way).
    sampling: Sampling
    # ZeRO-3's way to generate (rlhf.preflight.memory.generation_gathering): the pre-flight's choice.
    gathering: int
    judge: Judge
    ckpt: Checkpointer
    logger: object
    # The policy's and the critic's (and reward model's) sizes, as the pre-flight read them: each
    # phase's arithmetic in the step's figures.
    sizes: tuple[ModelSizes, ModelSizes]


@dataclass
class PPOState:
    """What a PPO run carries from one step to the next and over a resume. A checkpoint holds it as the
    dict ``saved`` writes (its keys, with the judge's best/warnings/history, are the on-disk format a
    resume reads); the KL controller, the running reward moments and the update's shuffling generator
    go there as their state dicts."""

    kl_ctl: losses.AdaptiveKLController
    moments: losses.RunningMoments
    generator: torch.Generator
    # The actor's and reference's (sum, sum of squares) at the start: how far the weights moved.
    fingerprints: dict[str, tuple]
    # The EMA actor's weights (rank 0), None without step.ema_decay.
    ema: dict | None
    first: dict
    last: dict
    step: int = 0
    # Where the loop goes on: the epoch and the prompt batches of it already trained on.
    epoch: int = 0
    batch_index: int = 0
    last_eval_step: int = 0
    # The latest rollout batch's KL to the reference (not saved: a resumed run measures it anew).
    last_kl: float = float("nan")
    # The RNG state the checkpoint saved, restored where the straight run was; None when fresh.
    rng: dict | None = None

    @classmethod
    def new(cls, cfg: Config, ema: dict | None, fingerprints: dict[str, tuple]) -> PPOState:
        step_cfg = cfg.step
        return cls(losses.AdaptiveKLController(step_cfg.kl_coef, step_cfg.kl_target, step_cfg.kl_horizon),
                   losses.RunningMoments(), torch.Generator().manual_seed(cfg.seed), fingerprints, ema, {}, {})

    def saved(self, judge: Judge, epoch: int, batch_index: int) -> dict:
        return {"step": self.step, "epoch": epoch, "batch_index": batch_index, "first": self.first, "last": self.last,
                "last_eval_step": self.last_eval_step, "fingerprints": self.fingerprints, **judge.state_dict(),
                "kl_ctl": self.kl_ctl.state_dict(), "moments": self.moments.state_dict(),
                "generator": self.generator.get_state(), "ema": self.ema}

    def restore(self, saved: dict, judge: Judge) -> None:
        """Take up a checkpoint's state (``saved``, as Checkpointer.load gives it, "rng" included)."""
        self.step, self.epoch, self.batch_index = saved["step"], saved["epoch"], saved["batch_index"]
        self.first, self.last, self.last_eval_step = saved["first"], saved["last"], saved["last_eval_step"]
        self.fingerprints = {k: tuple(v) for k, v in saved["fingerprints"].items()}
        judge.load_state_dict(saved)
        self.kl_ctl.load_state_dict(saved["kl_ctl"])
        self.moments.load_state_dict(saved["moments"])
        self.generator.set_state(saved["generator"])
        self.ema = saved["ema"] if self.ema is not None else None
        self.rng = saved["rng"]


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, run_dir, step_cfg = dist.get_rank(), Path(cfg.run_dir), cfg.step
    tokenizer, *paths = checked_tokenizer(cfg)
    prompts = build_prompts(cfg, tokenizer, rank, dist.get_world_size())
    roles = build_roles(cfg, tokenizer, tuple(paths), prompts.report_half, prompts.steps * ppo_updates_per_step(cfg))
    ema = _ema_init(roles.actor, step_cfg.ema_decay, cfg.lora.rank)
    sampling, gathering = Sampling.of(step_cfg), memory.generation_gathering(cfg)
    if rank == 0:
        (run_dir / "ds_config.json").write_text(json.dumps(roles.ds_configs, indent=2))
        say(_plan_line(cfg, roles, prompts))
    ckpt = Checkpointer(run_dir, {"actor": roles.actor, **({"critic": roles.critic} if roles.critic else {})},
                        cfg.checkpoint.every_steps, cfg.checkpoint.keep_last)
    resumed = ckpt.load() if cfg.resume == "auto" else None
    logger = open_logger(cfg, rank, fresh=resumed is None)
    # Outside a chain no gate binds the start check; in one, the chain's readiness rule does.
    gate, stop_on_gate = readiness.ppo_start_gate(run_dir, cfg.data.rule or "synthetic")
    judge = Judge(cfg, roles, prompts, logger, gathering, sampling, gate, stop_on_gate)
    setup = Setup(cfg, roles, prompts, sampling, gathering, judge, ckpt, logger,
                  tuple(model_sizes(m) for m in role_models(cfg)))

    # -------------------------------------------------------------------------------- loop
    fingerprints = {} if resumed else {"actor": param_fingerprint(roles.actor), "reference": param_fingerprint(roles.ref)}
    state = PPOState.new(cfg, ema, fingerprints)
    if resumed:
        state.restore(resumed, judge)
        logger.truncate_after(state.step)
        if rank == 0:
            say(f"[ppo] resumed at PPO step {state.step} (epoch {state.epoch}, prompt batch {state.batch_index})")
    else:
        state.first = state.last = judge.start(prompts.steps)
    loop.train(cfg, state, ckpt, logger, PPOSteps(setup, state))

    # -------------------------------------------------------------------------------- save
    return _finish(setup, state)


def _plan_line(cfg: Config, roles: Roles, prompts: Prompts) -> str:
    step_cfg = cfg.step
    return (f"[ppo] {prompts.count} prompts, {prompts.steps} PPO steps of {step_cfg.rollout_batch_size_per_device} "
            f"rollouts per device, {ppo_updates_per_step(cfg)} micro-batch updates each; "
            f"{step_cfg.advantage_estimator} advantages, KL ({step_cfg.kl_estimator}) in the {step_cfg.kl_in}, old "
            f"log-probs: {step_cfg.old_logprobs}; actor "
            f"{roles.n_actor / 1e6:.2f}M, critic {f'{roles.n_critic / 1e6:.2f}M' if roles.critic else 'none'} "
            f"parameters; reward: {'reward model' if roles.reward else ''}"
            f"{' + ' if roles.reward and roles.rule_fn else ''}{step_cfg.reward_fn or ''}")


class PPOSteps:
    """PPO's hooks for the driver (rlhf.runners.loop.train): a step is a prompt batch's rollouts and
    their updates, several optimizer steps of two engines; with step.dynamic_sampling it draws further
    prompt batches of its epoch. Its figures are logged every step; its evaluations are the judge's, on
step.eval_every_steps and at the run's end."""

    # Its cadence is in PPO steps; an epoch is one more pass over the prompts, judged like any step.
    evaluates_each_epoch = False

    def __init__(self, setup: Setup, state: PPOState):
        self.setup, self.state, self.start_epoch = setup, state, state.epoch
        self.metrics: dict[str, float] = {}

    @property
    def total(self) -> int:
        return self.setup.prompts.steps

    def batches(self, epoch: int, skip: int):
        rng = self.state.rng if epoch == self.start_epoch else None
        return _prompt_batches(self.setup.prompts, epoch, rng, skip)

    def step(self, epoch: int, index: int, batch: dict, more) -> tuple[int, bool]:
        consumed = [index]

        def draw_more():  # step.dynamic_sampling's further prompt batches
            following = next(more, None)
            if following is not None:
                consumed.append(following[0])
            return None if following is None else following[1]

        self.metrics = train_step(self.setup, self.state, batch, epoch, draw_more)
        _ema_update(self.state.ema, self.setup.roles.actor, self.setup.cfg.step.ema_decay)
        return consumed[-1], True  # the last prompt batch this step used: a resume goes on after it

    def record(self, epoch: int, index: int) -> dict[str, str]:
        setup, state, metrics = self.setup, self.state, self.metrics
        state.last_kl = metrics["kl"]
        setup.ckpt.stop_if_nonfinite(state.step, self.saved(epoch, index + 1), "PPO loss", metrics["loss"],
                                     unit="PPO step")
        setup.logger.log(metrics, step=state.step)
        if dist.get_rank() == 0 and state.step % setup.cfg.step.log_every_steps == 0:
            keys = ("reward/score_mean", "rollout/rule_accuracy", "kl", "policy_loss", "value_loss", "kl_loss", "step_s")
            say(f"[ppo] step {state.step}/{self.total} " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics))
        return {"score": f"{metrics['reward/score_mean']:.3f}", "kl": f"{metrics['kl']:.3f}"}

    def evaluate(self, epoch: int, final: bool) -> bool:
        self.state.last = self.setup.judge.evaluate(self.state.step, final, self.total)
        return bool(self.setup.judge.stopped_by)

    def saved(self, epoch: int, index: int) -> dict:
        return self.state.saved(self.setup.judge, epoch, index)


def _prompt_batches(prompts: Prompts, epoch: int, rng: dict | None, skip: int):
    """The epoch's prompt batches with their index, after the first ``skip`` (consumed before the
    checkpoint a run resumed from), with the checkpoint's ``rng`` (None: nothing to restore) put back
    where the checkpoint saved it: at the epoch boundary before the loader draws its seed, mid-epoch
    after it."""
    prompts.sampler.set_epoch(epoch)
    if rng is not None and skip == 0:
        set_rng_state(rng)
    batches = iter(prompts.loader)
    if rng is not None and skip:
        set_rng_state(rng)
    for index, batch in enumerate(batches):
        if index >= skip:
            yield index, batch


def train_step(setup: Setup, state: PPOState, batch: dict, epoch: int, draw_more=None) -> dict[str, float]:
    """One PPO step: rollouts and their scores, the updates, and the step's figures (rollout
    statistics over all ranks, losses, phase times, throughput); the KL controller moves after it."""
    cfg, roles, kl_ctl = setup.cfg, setup.roles, state.kl_ctl
    step_cfg, world = cfg.step, dist.get_world_size()
    t0 = time.perf_counter()
    exp = make_experience(roles, batch, setup.sampling, step_cfg, kl_ctl, state.moments, setup.gathering, draw_more)
    t1 = time.perf_counter()
    train = ppo_update(roles.actor, roles.critic, exp, step_cfg, kl_ctl.value, state.generator, setup.prompts.ptx)
    t2 = time.perf_counter()
    metrics = {**rollout_metrics(exp, roles.eval_rule), **train, "kl_coef": kl_ctl.value}
    kl_ctl.update(metrics["kl"], step_cfg.rollout_batch_size_per_device * world)
    t3 = time.perf_counter()
    n_seq, seq_len = exp.seq.shape
    flops = phase_flops(setup.sizes, n_seq, seq_len, exp.mask.shape[1], step_cfg, roles.critic is not None,
                        roles.reward is not None)
    scoring_s = max(t1 - t0 - exp.generate_s, 1e-9)
    metrics.update({"generate_s": exp.generate_s, "experience_s": t1 - t0, "train_s": t2 - t1, "other_s": t3 - t2,
                    "step_s": t3 - t0, "samples_per_s": n_seq * world / (t3 - t0),
                    "tflops": sum(flops.values()) / (t3 - t0) / 1e12,
                    "generate_tflops": flops["generate"] / max(exp.generate_s, 1e-9) / 1e12,
                    "scoring_tflops": flops["scoring"] / scoring_s / 1e12, "update_tflops": flops["update"] / (t2 - t1) / 1e12,
                    "lr": roles.actor.get_lr()[0], "epoch": epoch, "memory_gb": peak_memory_gb(cfg.hardware.accelerator)})
    return metrics


def phase_flops(sizes: tuple[ModelSizes, ModelSizes], rows: int, width: int, answer: int, step_cfg,
                critic: bool, reward: bool) -> dict[str, float]:
    """Matrix-product FLOPs of one PPO step's phases on one rank, as the work is done: every row of the
    batch to its full ``width`` (prompt + ``answer`` positions), padding included; 2 per parameter
    and position, the vocabulary head only where its logits are used; attention's scores left out
    (a few percent at rollout lengths). Generation: the prompt's prefill and one position per answer
    token, the head at each answer token. Scoring: the reference (and the actor with
    step.old_logprobs=recompute) with the head on the answer positions, the critic and the reward
    model without one. Updates: 3x a forward (forward and backward) per pass over the batch."""
    policy, value = sizes
    policy_pass = 2 * rows * (policy.layer_params * width + policy.head_params * answer)
    value_pass = 2 * rows * value.layer_params * width
    generate = 2 * rows * (policy.layer_params * (width - 1) + policy.head_params * answer)
    scoring = policy_pass * (2 if step_cfg.old_logprobs == "recompute" else 1) + value_pass * (critic + reward)
    update = 3 * step_cfg.ppo_epochs * (policy_pass + value_pass * critic)
    return {"generate": float(generate), "scoring": float(scoring), "update": float(update)}


def _finish(setup: Setup, state: PPOState) -> dict:
    """Save the actor (the judge picks the output model/ where it keeps the best actor), the critic and
    the EMA actor, and the final figures: how far the weights moved, every warning."""
    cfg, roles, judge = setup.cfg, setup.roles, setup.judge
    rank, run_dir = dist.get_rank(), Path(cfg.run_dir)
    # How far the weights moved, as |change| of (sum, sum of squares): 0 for the frozen reference.
    moved = {f"{role}_weight_change": max(abs(a - b) for a, b in zip(param_fingerprint(eng), state.fingerprints[role],
                                                                        strict=True))
             for role, eng in (("actor", roles.actor), ("reference", roles.ref))}
    judge.closing_notes(state.first, state.last, state.last_kl)

    def save_more(final: dict) -> None:
        if roles.critic is not None:
            save_hf_model(roles.critic, roles.tokenizer, run_dir / "critic")
        if state.ema is not None and rank == 0:
            _ema_save(state.ema, roles.actor, roles.tokenizer, run_dir / "model_ema")
            final["ema_dir"] = str(run_dir / "model_ema")
        judge.choose_output(state.step, state.last, final)

    # The list itself goes into the final figures: what the judge adds while choosing the output lands there.
    return finish(cfg, roles.actor, roles.tokenizer, rank, state.step, state.first,
                  {**state.last, **moved, "old_logprobs": cfg.step.old_logprobs, "warnings": judge.warnings}, setup.logger,
                  save_more, stopped_by=judge.stopped_by or None)


# ------------------------------------------------------------------------------------- EMA
def _ema_init(actor, decay: float, lora_rank: int) -> dict[str, torch.Tensor] | None:
    """A full-precision CPU copy of the actor's weights (rank 0), averaged after every PPO step."""
    if decay == 0:
        return None
    if lora_rank:
        raise ConfigError("step.ema_decay with lora.rank > 0 is not supported: average the merged model instead")
    state = gather_state_dict(actor)
    return {k: v.float() for k, v in state.items()} if state is not None else None


def _ema_update(ema, actor, decay: float) -> None:
    if ema is None and dist.get_rank() == 0 or decay == 0:
        return
    current = gather_state_dict(actor)  # every rank joins the gathers; rank 0 gets the tensors
    if current is not None:
        for name, value in current.items():
            if value.is_floating_point():
                ema[name].mul_(decay).add_(value.float(), alpha=1.0 - decay)


def _ema_save(ema, actor, tokenizer, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(actor.module.config)
    model.load_state_dict(ema, strict=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
