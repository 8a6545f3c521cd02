"""PPO's judge: a callback object the run calls at its start, at each evaluation and at its end.

It answers the held-out prompts greedily (select/* picks the best actor and feeds the warnings,
eval/* is what gets reported), keeps the best-evaluated actor in best_model/ and makes it the output,
warns once of reward hacking, and at the start checks the reward model on the policy's own sampled
answers. What a failed start check does comes from whoever configures the judge (``gate``: a
chain's readiness rule, rlhf.chain.readiness.ppo_start_gate; none for a step run on its own): the judge
and the runner do not look for a chain themselves.

    python launch.py step=ppo step.reward_fn=rule step.eval_every_steps=25 actor.path=... critic.path=...
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import torch
import torch.distributed as dist

from rlhf import losses, rewards
from rlhf.chain import readiness
from rlhf.checkpoint import save_hf_model
from rlhf.config import Config, ConfigError
from rlhf.distributed import cat_over_ranks, first_copies, rank_share
from rlhf.generation.rollout import evaluate, sampled_answers
from rlhf.generation.sampling import Sampling
from rlhf.runners.common import as_select, say
from rlhf.runners.ppo_experience import sequence_scores
from rlhf.runners.ppo_setup import Prompts, Roles


@torch.no_grad()
def policy_check(roles: Roles, prompts: Prompts, cfg: Config, sampling: Sampling,
                 gathering: int) -> tuple[dict[str, float], list]:
    """The reward model judged on the policy's own answers before any update:
    readiness.POLICY_CHECK_SAMPLES answers per select prompt, sampled as the rollouts are, scored by
    the reward model and by the rule (sequence_scores);
    the AUC of the scores for the rule's right/wrong (select/policy_rm_auc). Held-out pairs show
    only the mistakes their writer thought of; PPO climbs the reward model's scores of the mistakes
    this policy makes. Returns the figures and this rank's scored rows, best-scored first. The draws
    (``sampling``, the rollouts') come from a forked RNG seeded by cfg.seed: the training run is the
    same with or without it."""
    step_cfg, rank, world = cfg.step, dist.get_rank(), dist.get_world_size()
    if roles.reward is None or roles.eval_rule is None or not rewards.knows(roles.eval_rule, [p["prompt"] for p in prompts.select]):
        return {}, []
    rows = [p for p in prompts.select for _ in range(readiness.POLICY_CHECK_SAMPLES)]
    mine = rank_share(rows, rank, world)
    chunk = step_cfg.generation_batch_size_per_device or step_cfg.rollout_batch_size_per_device
    scored: list[dict] = []
    device = roles.actor.device
    sampled = sampled_answers(roles.actor, mine, roles.tokenizer, chunk, cfg.seed + rank, sampling,
                              gathering=gathering, static=step_cfg.decode_graph)
    for batch, response, rmask, answers in sampled:
        seq = torch.cat([batch["input_ids"].to(device), response], 1)
        attn = torch.cat([batch["attention_mask"].to(device), rmask], 1)
        scores = sequence_scores(roles.reward, roles.eval_rule, seq, attn, batch["prompts"], answers, step_cfg, chunk)
        scored += [{"prompt": p, "answer": a, "rule": rule, "rm_score": round(r, 4)}
                   for p, a, rule, r in zip(batch["prompts"], answers, scores.fn.tolist(), scores.rm.tolist(),
                                            strict=True)]
    # Rank order is row order and the wrapped-round copies are the last rank's tail: each row once.
    both = cat_over_ranks(torch.tensor([[r["rm_score"], r["rule"]] for r in scored], dtype=torch.float32))[:len(rows)]
    scored = scored[:first_copies(len(rows), rank, world)]
    out = {"select/policy_sampled_accuracy": both[:, 1].mean().item()}
    if bool(((both[:, 1] == 0) | (both[:, 1] == 1)).all()):  # a right/wrong rule
        out["select/policy_rm_auc"] = losses.auc(both[:, 0], both[:, 1])
    return out, sorted(scored, key=lambda r: -r["rm_score"])


@torch.no_grad()
def group_signal(roles: Roles, prompts: Prompts, cfg: Config, sampling: Sampling, gathering: int) -> dict[str, float]:
    """For a group estimator (step.samples_per_prompt > 1): step.samples_per_prompt answers to each of
    the first readiness.GROUP_CHECK_PROMPTS select prompts, sampled as the rollouts are and scored by
    the reward PPO optimizes; the fraction of prompts whose answers scored differently
    (select/policy_signal_frac: the groups whose advantages are not all 0) and the mean score. {}
    for a single-sample estimator. The draws come from a forked RNG, as policy_check's."""
    step_cfg, rank, world = cfg.step, dist.get_rank(), dist.get_world_size()
    k = step_cfg.samples_per_prompt
    if k < 2:
        return {}
    chosen = prompts.select[:readiness.GROUP_CHECK_PROMPTS]
    mine = rank_share(chosen, rank, world)  # whole groups per rank
    rows = [p for p in mine for _ in range(k)]
    chunk = max(k, (step_cfg.generation_batch_size_per_device or step_cfg.rollout_batch_size_per_device) // k * k)
    device, totals = roles.actor.device, []
    for batch, response, rmask, answers in sampled_answers(roles.actor, rows, roles.tokenizer, chunk, cfg.seed + 7919 + rank,
                                                           sampling, gathering=gathering, static=step_cfg.decode_graph):
        seq = torch.cat([batch["input_ids"].to(device), response], 1)
        attn = torch.cat([batch["attention_mask"].to(device), rmask], 1)
        totals.append(sequence_scores(roles.reward, roles.rule_fn, seq, attn, batch["prompts"], answers, step_cfg,
                                      chunk).total)
    scores = torch.cat(totals).view(-1, k)[:first_copies(len(chosen), rank, world)]  # each prompt once
    from rlhf.runners.ppo_experience import signal_groups

    sums = cat_over_ranks(torch.tensor([[float(signal_groups(scores.flatten(), k).sum()), float(len(scores)),
                                         float(scores.sum())]], dtype=torch.float64)).sum(0)
    return {"select/policy_signal_frac": (sums[0] / sums[1]).item(),
            "select/policy_group_score_mean": (sums[2] / (sums[1] * k)).item()}


# The warnings' false-alarm level: one-sided, the tail of two standard errors of a normal estimate.
FALSE_ALARM = NormalDist().cdf(-2.0)


def hacking_warning(best: dict, now: dict, n_prompts: int, earlier: int = 1) -> str | None:
    """The reward model is being gamed: since the best evaluation, picked as the most accurate of
    ``earlier`` evaluations of the same ``n_prompts`` prompts, both
    (1) the rule's accuracy fell by more than z standard errors of the difference of two evaluations,
        sqrt(2 p (1 - p) / n) at p their mean accuracy, with z = Phi^-1(1 - FALSE_ALARM / earlier):
        the best of ``earlier`` is their maximum, and by the union bound noise alone puts a maximum of
        ``earlier`` that far above a new evaluation with probability at most FALSE_ALARM; and
    (2) the reward model's mean score rose by more than two standard errors of the difference, each
        from the spread of its scores over the prompts (eval/rm_score_std).
    Each condition alone is met by noise with probability at most FALSE_ALARM (2.3%), so noise alone
    fires the warning at any one evaluation with probability at most that (far less where the two
    noises are independent)."""
    keys = ("eval/accuracy", "eval/rm_score")
    if not all(k in d for d in (best, now) for k in keys):
        return None
    p = (best["eval/accuracy"] + now["eval/accuracy"]) / 2
    n = max(n_prompts, 1)
    z = NormalDist().inv_cdf(1 - FALSE_ALARM / max(earlier, 1))
    drop, rise = best["eval/accuracy"] - now["eval/accuracy"], now["eval/rm_score"] - best["eval/rm_score"]
    noise = z * (2 * max(p * (1 - p), 0.01) / n) ** 0.5
    rm_noise = 2 * ((best.get("eval/rm_score_std", 0.0) ** 2 + now.get("eval/rm_score_std", 0.0) ** 2) / n) ** 0.5
    if drop > noise and rise > rm_noise:
        return (f"reward hacking: the reward model's score on held-out greedy answers rose {best['eval/rm_score']:.3f} -> "
                f"{now['eval/rm_score']:.3f} (more than its {rm_noise:.3f} noise) while rule accuracy fell "
                f"{best['eval/accuracy']:.3f} -> {now['eval/accuracy']:.3f} (more than the {noise:.3f} noise of "
                f"{n_prompts} prompts below the best of {earlier} evaluations): the policy is learning the reward "
                "model's mistakes. Lower optim.lr, raise step.kl_coef or set step.kl_target, or train a better "
                "reward model")
    return None


def still_rising(history: list[tuple[int, float]], n_prompts: int, window: int = 4) -> str | None:
    """PPO ended while it was still learning: its last evaluation was its best, and the select half's
    accuracy rose over the last ``window`` evaluations by more than two standard errors of the
    difference between two evaluations of ``n_prompts`` prompts (noise alone rarely says so)."""
    if len(history) < window + 1:
        return None
    (start_step, start), (end_step, end) = history[-window - 1], history[-1]
    if end < max(acc for _, acc in history):
        return None
    noise = 2 * (2 * max(start * (1 - start), 0.01) / max(n_prompts, 1)) ** 0.5
    if end - start <= noise:
        return None
    return (f"PPO was still improving when it stopped: held-out accuracy rose {start:.3f} -> {end:.3f} over its last "
            f"{window} evaluations (steps {start_step} -> {end_step}, more than the {noise:.3f} noise of {n_prompts} "
            "prompts) and its last evaluation was its best. Train it longer: step.epochs=N (in a chain "
            "pipeline.ppo.step.epochs=N)")


def plateau(history: list[tuple[int, float]], patience: int) -> str | None:
    """Why PPO is done learning (``patience`` 0: never): the last ``patience`` evaluations have not
    beaten the best select-half accuracy, the one keep_best picks the output by (its first
    occurrence), or that best is 1.0, which no later actor can beat."""
    if not patience or not history:
        return None
    best_at = max(range(len(history)), key=lambda i: (history[i][1], -i))
    step, best = history[best_at]
    if best >= 1.0:
        return f"held-out accuracy reached 1.0 at step {step}, which no later actor can beat (step.early_stop_patience)"
    if len(history) - 1 - best_at < patience:
        return None
    return (f"held-out accuracy did not beat its best ({best:.4f}, step {step}) for {patience} evaluations "
            "(step.early_stop_patience)")


def unjudged_note(first: dict, last: dict, kl: float) -> str | None:
    """Without a rule, a rising reward score cannot be told from reward hacking: say so with the figures."""
    if "eval/accuracy" in last or "eval/rm_score" not in last or "eval/rm_score" not in first:
        return None
    return (f"the reward model's score on held-out greedy answers went {first['eval/rm_score']:.3f} -> "
            f"{last['eval/rm_score']:.3f} at a KL of {kl:.3f} to the reference; no rule scores these prompts "
            "(data.rule), so this run cannot tell learning from reward hacking: read the answers in "
            "samples.jsonl")


@dataclass
class Judge:
    """Greedy evaluations and what they decide: the best held-out evaluation so far ({} until the
    first: its step, its metrics and its select-half figures), the warnings said so far and every
    evaluation's (step, select accuracy). ``gate(figures, scored) -> why or None`` judges the start
    check; a reason stops the run where ``stop_on_gate``, else it becomes a warning."""

    cfg: Config
    roles: Roles
    prompts: Prompts
    logger: object
    gathering: int
    sampling: Sampling
    gate: Callable[[dict, list[dict]], str | None] | None = None
    stop_on_gate: bool = True
    best: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    history: list[tuple[int, float]] = field(default_factory=list)
    # Why the run is done before its last step (plateau's reason), "" while it is not.
    stopped_by: str = ""

    def state_dict(self) -> dict:
        """What a resume restores (the checkpoint's keys best, warnings, history)."""
        return {"best": self.best, "warnings": self.warnings, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.warnings, self.history = state["best"], state["warnings"], state.get("history", [])

    def warn(self, line: str, kind: str = "WARNING") -> None:
        """Keep ``line`` for the final figures' warnings and say it once (rank 0)."""
        self.warnings.append(line)
        if dist.get_rank() == 0:
            say(f"[ppo] {kind} {line}")

    def start(self, final_step: int) -> dict[str, float]:
        """The figures of step 0: the start check's, then the first evaluation's."""
        check = self.start_check()
        return {**self.evaluate(0, True, final_step), **check}

    def evaluate(self, step: int, reported: bool, final_step: int) -> dict[str, float]:
        """Greedy answers to the select half (select/*), and to the reported half (eval/*) where
        ``reported`` or where the select half makes this actor the best so far (it may be the output);
        keeps a new best actor in best_model/ and warns once of reward hacking."""
        cfg, roles, step_cfg = self.cfg, self.roles, self.cfg.step
        rank, run_dir = dist.get_rank(), Path(cfg.run_dir)
        samples: list[dict] = []
        greedy = functools.partial(evaluate, roles.actor, roles.reward, roles.eval_rule, tokenizer=roles.tokenizer,
                                   max_new_tokens=step_cfg.max_new_tokens,
                                   batch_size=step_cfg.eval_micro_batch_size_per_device, gathering=self.gathering)
        chosen = greedy(prompts=self.prompts.select, samples=samples)
        metrics = as_select(chosen)
        better = "eval/accuracy" in chosen and (not self.best or
                                                chosen["eval/accuracy"] > self.best["select"]["eval/accuracy"])
        if "eval/accuracy" in chosen:
            self.history.append((step, chosen["eval/accuracy"]))
            # At the last step the cap ends the run, whatever the plateau says.
            self.stopped_by = (plateau(self.history, step_cfg.early_stop_patience) or "") if step < final_step else ""
        # The last evaluation of the run (the cap's, or a plateau's) reports the last actor's figures.
        if reported or better or self.stopped_by:
            metrics.update(greedy(prompts=self.prompts.report_half))
        self.logger.log(metrics, step=step)
        if rank == 0 and metrics:
            say(f"[ppo] step {step} " + " ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in metrics.items()))
            with open(run_dir / "samples.jsonl", "a") as f:  # what the greedy answers look like, per evaluation
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in samples[:16])
        if "eval/accuracy" not in chosen:
            return metrics
        earlier = len(self.history) - 1  # the evaluations the best was picked from
        if self.best and (why := hacking_warning(self.best["select"], chosen, len(self.prompts.select), earlier)) \
                and not any("reward hacking" in w for w in self.warnings):
            self.warn(f"step {step}: {why}")
        if better:
            self.best = {"step": step, "metrics": metrics, "select": chosen}
            # Step 0's actor is the start (on disk as the SFT output); the final one is saved as model/ anyway.
            if self.keeps_best and 0 < step < final_step:
                save_hf_model(roles.actor, roles.tokenizer, run_dir / "best_model", merge_lora=cfg.lora.merge_on_save)
        return metrics

    @property
    def keeps_best(self) -> bool:
        return self.cfg.step.keep_best and self.roles.eval_rule is not None and self.cfg.step.save_model

    def start_check(self) -> dict[str, float]:
        """policy_check's and group_signal's figures, logged at step 0 with every scored answer in
        policy_check.jsonl; a reason from ``gate`` stops PPO here (``stop_on_gate``) or becomes a
        warning. Too few groups with a signal stops a chain's PPO alike and warns a step run alone."""
        figures, scored = policy_check(self.roles, self.prompts, self.cfg, self.sampling, self.gathering)
        signal = group_signal(self.roles, self.prompts, self.cfg, self.sampling, self.gathering)
        if not figures and not signal:
            return {}
        run_dir = Path(self.cfg.run_dir)
        self.logger.log({**figures, **signal}, step=0)
        if dist.get_rank() == 0 and figures:
            with open(run_dir / "policy_check.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in scored)
            say("[ppo] the reward model on the policy's own sampled answers: " +
                " ".join(f"{k.removeprefix('select/')}={v:.4f}" for k, v in figures.items()))
        if dist.get_rank() == 0 and signal:
            say(f"[ppo] groups of {self.cfg.step.samples_per_prompt} sampled answers whose scores differ: "
                f"{signal['select/policy_signal_frac']:.1%} of {min(len(self.prompts.select), readiness.GROUP_CHECK_PROMPTS)} "
                f"prompts (mean score {signal['select/policy_group_score_mean']:.3f})")
        # In a chain the fix is the chain's key (pipeline.ppo.step.X); a step alone is only warned.
        why = (self.gate and self.gate(figures, scored)) or readiness.no_group_signal(
            signal, self.cfg.step, "pipeline.ppo." if self.gate else "")
        if why and self.gate is not None and self.stop_on_gate:
            raise ConfigError(f"PPO stopped before its first update: {why}; {readiness.RUN_ANYWAY}")
        if why:
            self.warn(f"ran though it may not work{' (pipeline.on_weak_step=warn)' if self.gate else ''}: {why}")
        return {**figures, **signal}

    def closing_notes(self, first: dict, last: dict, last_kl: float) -> None:
        """How the run went, said at its end: no rule to judge it, or still improving when it stopped."""
        for note in (unjudged_note(first, last, last_kl), still_rising(self.history, len(self.prompts.select))):
            if note:
                self.warn(note, "NOTE")

    def choose_output(self, step: int, last: dict, final: dict) -> None:
        """Where the judge keeps the best actor, make it the output model/ (rank 0 moves the folders),
        after the last actor was saved there; ``final`` gets the output's figures."""
        if self.keeps_best and self.best and dist.get_rank() == 0:
            keep_best(Path(self.cfg.run_dir), self.best, step, last, final, self.warnings, self.roles.actor_path)


def keep_best(run_dir: Path, best: dict, step: int, last: dict, final: dict, warnings: list[str],
               start: str = "") -> None:
    """Make the best-evaluated actor the output (model/), the last one model_last/, and say which;
    when the best was the start (step 0), the output is a copy of ``start``, the actor's folder."""
    shutil.rmtree(run_dir / "model_last", ignore_errors=True)
    final.update({f"{k}_last": v for k, v in last.items()}, best_step=best["step"])
    if best["step"] == step:
        shutil.rmtree(run_dir / "best_model", ignore_errors=True)  # an earlier best, now beaten
        say(f"[ppo] output: the last actor (step {step}) had the best held-out accuracy, "
              f"{last['eval/accuracy']:.3f}")
    elif best["step"] == 0:
        why = (f"PPO never beat its start on held-out accuracy ({best['metrics']['eval/accuracy']:.3f} at step 0, "
               f"{last['eval/accuracy']:.3f} at the end)")
        if (Path(start) / "config.json").exists():  # the start is a local model folder: it is the best actor
            os.replace(run_dir / "model", run_dir / "model_last")
            shutil.copytree(start, run_dir / "model")
            final.update(best["metrics"])
            warnings.append(f"{why}; the output model/ is a copy of the start ({start}), the last actor is in "
                            "model_last/")
        else:
            warnings.append(f"{why}; the output is the last actor")
        say(f"[ppo] WARNING {warnings[-1]}")
    else:
        os.replace(run_dir / "model", run_dir / "model_last")
        os.replace(run_dir / "best_model", run_dir / "model")
        final.update(best["metrics"])
        say(f"[ppo] output: model/ is the actor of step {best['step']} (held-out accuracy "
              f"{best['metrics']['eval/accuracy']:.3f}, the best evaluation); the last actor ({last['eval/accuracy']:.3f}) "
              f"is in model_last/")

