"""Whether a chain's next step can work, judged before it starts from the final figures of the steps
before it: the one-line refusals of pipeline.on_weak_step. Used by the chain (rlhf.chain.pipeline) and,
in a launch of several ranks, by each step's worker (rlhf.worker).

    python launch.py pipeline=e2e   # the chain asks weak_step before each step
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import OmegaConf

from rlhf.config import STEPS, Config

# Every refusal of a weak step ends with this: how to run the step anyway (and how a caller that
# collects refusals, such as the benchmarks, tells one from another error).
RUN_ANYWAY = "or pipeline.on_weak_step=warn runs it anyway"
# The fix that makes the user's rule PPO's only reward. A rule cannot be gamed, so PPO reuses each
# rollout batch for 4 update passes (TRL's num_ppo_epochs), which a task learned slowly from a 0/1
# reward needs; against a reward model the chain keeps one, as more find its mistakes sooner
# (docs/design-notes.md has the figures).
def rule_reward_fix(name: str) -> str:
    """The overrides that make the user's rule the chain's step ``name``'s only reward."""
    return (f"pipeline.{name}.step.reward_fn=rule pipeline.{name}.step.reward_model_weight=0 "
            f"pipeline.{name}.step.ppo_epochs=4")
# PPO's start check (rlhf.runners.ppo_judge.policy_check): sampled answers per select prompt, 1024 for the
# default 256 prompts.
POLICY_CHECK_SAMPLES = 4


# Held-out greedy answers cut at the budget above this share make an accuracy that measures the budget.
CUT_ANSWERS = 0.5


def cut_answers(final: dict, budget: int | None, key: str = "step.max_new_tokens") -> str | None:
    """What a step's held-out accuracy is worth when most of its greedy answers ran into the generation
    budget without ending (eval/truncated_frac): the rule judged them cut, before their final answer.
    Not said of a step its loss plateau stopped: that model did not learn the answers, long or short,
    and a larger budget only lengthens what it gets wrong (its stop names the likely cause). The budget
    is named without its value in ``key=value`` form: that form is a printed fix, and following it
    would change nothing."""
    cut = max((v for k, v in final.items() if k.endswith("truncated_frac") and not k.endswith("_before")
               and k.startswith(("eval/", "select/"))), default=None)
    if cut is None or cut <= CUT_ANSWERS or budget is None or "early_stop_patience" in str(final.get("stopped_by", "")):
        return None
    return (f"{cut:.0%} of the held-out greedy answers reached the budget {key} ({budget} tokens) without ending: "
            f"the rule judged them cut before their final answer, so the accuracy measures the budget, not the "
            f"model; raise {key}={2 * budget}")


def weak_step(pipe, name: str, step: Config, chain_dir: Path, steps: list[str]) -> str | None:
    """Why the chain's step ``name`` cannot work, judged from the final figures of the steps before it
    in ``chain_dir`` and the chain's floors (``pipe``: its pipeline settings); None if nothing says so.
    One line: the figure, why it dooms the step, and the override that fixes it."""
    def final(prev: str | None) -> dict:
        return chain_final(chain_dir, prev) if prev in steps else {}

    spec, at = STEPS[name], steps.index(name)
    # The steps judged are found by what they make (the spec's chain_inputs), never by their names.
    rm_step = spec.source_of("critic.path")
    if "reward_accuracy" in spec.checks and rm_step:
        rm = final(rm_step).get("eval/acc")
        if pipe.reward_min_accuracy and rm is not None and rm < pipe.reward_min_accuracy \
                and step.step.reward_model_weight > 0:
            stopped = str(final(rm_step).get("stopped_by", ""))
            # The fix changes what ended the reward step: a cap is raised; a plateau is a model that
            # has learned what these pairs teach, so only more pairs or the rule can help.
            longer = ("it stopped learning on these pairs (" + stopped + "): train it on more pairs"
                      if "early_stop_patience" in stopped else
                      "train it longer (" + cap_fix(rm_step, stopped, chain_dir) + ") or on more pairs")
            weak = (f"the reward model's held-out pairwise accuracy {rm:.3f} is below pipeline.reward_min_accuracy="
                    f"{pipe.reward_min_accuracy}: PPO finds and exploits a weak reward model's mistakes. ")
            if not step.data.rule:
                return weak + longer[0].upper() + longer[1:]
            # The user's rule is the reward the model only approximates, and cannot be gamed: the first
            # fix where there is one (a longer schedule or more pairs may not reach the floor at all).
            return (weak + f"Reward PPO with your rule instead ({step.data.rule}; it cannot be gamed, so each rollout "
                    f"batch gets 4 update passes): {rule_reward_fix(name)}; or {longer}")
    # The step right before, where it trains the policy on reference answers (SFT): its figures are
    # judged as soon as they exist.
    sup = steps[at - 1] if at and STEPS[steps[at - 1]].supervised_policy else None
    # The policy's accuracy dooms PPO whatever comes between, so that no reward model trains for a PPO
    # that cannot start.
    judged = [s for s in (steps[at:] if sup else [name]) if "policy_accuracy" in STEPS[s].checks]
    policy = sup or (spec.source_of("actor.path") if judged else None)
    if judged and policy and (why := _policy_too_weak(pipe, final(policy), chain_dir, policy)):
        return why
    if pipe.sft_beyond_constant and sup and (why := _only_a_constant(final(sup), chain_dir, sup)):
        return why
    if pipe.sft_loss_still_falling and sup:
        sft = final(sup)
        f = chain_dir / sup / "metrics.jsonl"
        losses = [row["eval/loss"] for row in map(json.loads, f.open()) if "eval/loss" in row] if f.exists() else []
        # Whether SFT's own stop rule fired: it reads the select half (select/accuracy).
        step_stop = sft.get("select/accuracy_bar", _stop_at_accuracy(chain_dir, sup))
        reached = sft.get("select/accuracy", -1.0) >= step_stop
        if len(losses) >= 2 and not reached and losses[-2] > 0:
            drop = (losses[-2] - losses[-1]) / losses[-2]
            if drop > pipe.sft_loss_still_falling:
                return (f"{STEPS[sup].label} stopped with its held-out loss still falling ({losses[-2]:.3f} -> {losses[-1]:.3f}, "
                        f"{drop:.0%} over its last evaluation interval, more than pipeline.sft_loss_still_falling="
                        f"{pipe.sft_loss_still_falling}"
                        + (f"; held-out accuracy {sft['select/accuracy']:.1%} < {step_stop}"
                           if step_stop < 2 and "select/accuracy" in sft else "")
                        + "): it was not ready. " + sft_fix(sft, chain_dir, sup))
    return None


def _policy_too_weak(pipe, sft: dict, chain_dir: Path, policy: str) -> str | None:
    """The policy's held-out accuracy by the rule (the figures of ``policy``, the chain's step that
    trained it) below pipeline.min_policy_accuracy: PPO samples almost no right answer to reinforce.
    The fix follows what ended that step, so that following it changes that."""
    acc = sft.get("eval/accuracy")
    if not pipe.min_policy_accuracy or acc is None or acc >= pipe.min_policy_accuracy:
        return None
    return (f"the {STEPS[policy].label} policy's held-out accuracy by the rule is {acc:.1%}, below "
            f"pipeline.min_policy_accuracy={pipe.min_policy_accuracy}: PPO can only reinforce right answers it "
            "samples, and it samples almost none. " + sft_fix(sft, chain_dir, policy))


def sft_fix(sft: dict, chain_dir: Path, name: str) -> str:
    """The override that changes what ended the chain's step ``name`` (SFT) that was not ready: its
    loss-plateau stop (a plateau at near-zero accuracy points to a learning rate too high for the
    task, docs/design-notes.md), or its cap on steps or epochs."""
    stopped, label, keys = str(sft.get("stopped_by", "")), STEPS[name].label, f"pipeline.{name}."
    cfg = _step_config(chain_dir, name)
    if why := cut_answers(sft, cfg.get("step", {}).get("max_new_tokens"), f"{keys}step.max_new_tokens"):
        return "Not the training: " + why
    if "early_stop_patience" in stopped:
        # A start over at the configured rate lowered once (the step's own drops continue a plateaued
        # model and do not replace it).
        lr = cfg.get("optim", {}).get("lr")
        factor = cfg.get("step", {}).get("plateau_lr_factor", 3)
        lower = f"{keys}optim.lr={lr / factor:.2g} " if lr else ""
        return (f"{label} stopped on its loss plateau ({stopped}); the likely cause is a learning rate too high for "
                f"the task: {lower}{keys}step.early_stop_patience=0 (a lower rate, trained until its "
                "accuracy bar or its epoch cap)")
    return f"{label} stopped at its cap" + (f" ({stopped})" if stopped else "") + ": train it longer, " + \
        cap_fix(name, stopped, chain_dir)


def cap_fix(name: str, stopped: str, chain_dir: Path) -> str:
    """The override that doubles the cap that ended the chain's step ``name`` (``stopped``: its
    final figures' stopped_by): step.max_steps where that cap stopped it, else step.epochs."""
    step = _step_config(chain_dir, name).get("step", {})
    if "max_steps" in stopped and step.get("max_steps", -1) > 0:
        return f"pipeline.{name}.step.max_steps={2 * step['max_steps']}"
    return f"pipeline.{name}.step.epochs={2 * step.get('epochs', 1)}"


def _step_config(chain_dir: Path, name: str):
    """The chain's step ``name``'s resolved config ({} where it has none)."""
    f = chain_dir / name / "config.yaml"
    return OmegaConf.load(f) if f.exists() else {}


# A printed fix is a run of overrides of the chain's steps, separated by spaces: the first run in a
# message is its fix, later runs are alternatives (printed_fixes reads them).
_FIX_OVERRIDE = re.compile(rf"^pipeline\.({'|'.join(map(re.escape, STEPS))})\.[\w.]+=[^\s,;()]+")


def printed_fixes(message: str) -> list[list[str]]:
    """The fixes a refusal prints, in its order, each as the overrides to add to the command line:
    runs of ``pipeline.<step>.<key>=<value>`` words (what a user copies). The chain's floors
    (``pipeline.<key>=``) and the run-anyway switch are not fixes and are not read."""
    fixes: list[list[str]] = []
    run: list[str] = []
    for word in message.split():
        match = _FIX_OVERRIDE.match(word.lstrip("("))
        if match:
            run.append(match.group(0))
            continue
        if run:
            fixes.append(run)
            run = []
    return fixes + ([run] if run else [])


def with_fix(overrides: list[str], fix: list[str]) -> list[str]:
    """``overrides`` with each of ``fix``'s keys set to the fix's value (appended where absent): the
    command line a user has after copying a printed fix onto it."""
    keys = {o.split("=", 1)[0] for o in fix}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + fix


def _only_a_constant(sft: dict, chain_dir: Path, name: str) -> str | None:
    """SFT ended no better than the best constant answer, beyond the noise of two evaluations of its
    report prompts (two standard errors of their difference, over their real number): it learned
    which answer is common, not the task. Both figures are of the report half, which neither SFT's
    stop rule nor the choice of the constant (the best of 16 on the select half) read, so neither is
    optimistic. Neither a reward model nor PPO learns what SFT could not."""
    acc, constant, n = sft.get("eval/accuracy"), sft.get("eval/constant_accuracy"), sft.get("eval/prompts")
    if acc is None or constant is None or not n or constant < 0.05:  # no answer is often right: nothing to confuse
        return None
    n = int(n)
    stopped = str(sft.get("stopped_by", ""))
    sft, label, keys = _step_config(chain_dir, name), STEPS[name].label, f"pipeline.{name}."
    noise = 2 * (2 * constant * (1 - constant) / n) ** 0.5
    if acc - constant > noise:
        return None
    # Where a cap ended SFT, following the fix must also raise that cap, or the next run stops there again.
    cap = (" " + cap_fix(name, stopped, chain_dir)) if "the cap" in stopped else ""
    # A count task's SFT sat at the constant's accuracy at lr 3e-3 for 4,000 steps (also with twice
    # the layers, or 4x the patience); at 1e-3 it passed its bar after 2,355 (59%, constant 41%).
    lr = sft.get("optim", {}).get("lr")
    lower = f"{keys}optim.lr={lr / 3:.2g} " if lr else ""
    return (f"{label}'s held-out accuracy {acc:.1%} is within the noise ({noise:.1%} over {n} prompts) of always giving "
            f"the best single answer ({constant:.1%}): the model learned which answer is common, not the task, "
            f"and RLHF seldom teaches what {label} could not. Try a lower learning rate trained until its accuracy "
            f"bar or its epoch cap ({lower}{keys}step.early_stop_patience=0{cap}), a larger model, or more or "
            "simpler rows")


def reward_misjudges_policy(pipe, figures: dict, scored: list[dict], rule: str, run_dir: Path) -> str | None:
    """Why PPO should not train against this reward model, judged at PPO's start from the reward
    model's scores of the policy's own sampled answers (``figures``: rlhf.runners.ppo_judge.policy_check's,
    ``scored``: its rows, best-scored first); None if the AUC by the rule reaches
    ``pipe.reward_min_policy_auc``. Held-out pairs can be ranked perfectly by a model that has never
    seen the mistakes this policy makes; PPO then climbs their scores."""
    auc = figures.get("select/policy_rm_auc")
    if not pipe.reward_min_policy_auc or auc is None or auc != auc or auc >= pipe.reward_min_policy_auc:
        return None
    rights = sorted(r["rm_score"] for r in scored if r["rule"] == 1)
    median_right = rights[len(rights) // 2] if rights else float("-inf")
    wrong = next((r for r in scored if r["rule"] == 0 and r["rm_score"] > median_right), None)
    example = (f", e.g. {wrong['prompt'].strip()!r} -> {wrong['answer'].strip()!r} scored {wrong['rm_score']:.2f}, above "
               f"the median right answer's {median_right:.2f}" if wrong else "")
    rm_step = STEPS[run_dir.name].source_of("critic.path") if run_dir.name in STEPS else None
    reward = chain_final(run_dir.parent, rm_step) if rm_step else {}
    pairs = reward.get("eval/acc")
    held_out = f" (on its held-out pairs: {pairs:.3f})" if pairs is not None else ""
    # The reward model may already have trained on the policy's own answers (step.policy_pairs_prompts).
    own = int(reward.get("policy_pairs_prompts", 0))
    keys = f"pipeline.{rm_step}." if rm_step else ""
    more = (f"Train it on the policy's answers to more prompts than {own} ({keys}step.policy_pairs_prompts="
            f"{4 * own}), or add answers like these to your pairs as rejected" if own else
            "Add answers like these to your pairs as rejected, or let the chain draw them "
            f"({keys}step.policy_pairs_prompts=4096)")
    return (f"the reward model separates the policy's own sampled answers, right from wrong by the rule, with AUC "
            f"{auc:.3f}{held_out}, below pipeline.reward_min_policy_auc={pipe.reward_min_policy_auc}: it scores "
            f"mistakes this policy makes as right{example}, and PPO would learn them. {more} "
            f"({run_dir / 'policy_check.jsonl'} has every scored answer), or reward PPO "
            f"with the rule ({rule}; it cannot be gamed, so each rollout batch gets 4 update passes): "
            f"{rule_reward_fix(run_dir.name)}")


# Prompts the start check samples groups for, and the least fraction of them whose answers must score
# differently: a group whose answers all score alike has every group advantage 0, so below it almost
# every rollout batch trains on nothing but the KL (and dynamic sampling would draw 20 batches per step).
GROUP_CHECK_PROMPTS = 32
MIN_GROUP_SIGNAL = 0.05


def no_group_signal(signal: dict, step_cfg, prefix: str = "") -> str | None:
    """Why a group estimator cannot learn from the start policy (rlhf.runners.ppo_judge.group_signal's
    figures): almost every prompt's sampled answers score alike; None otherwise or without figures.
    ``prefix`` goes before the keys of the fix (pipeline.ppo. in a chain)."""
    frac = signal.get("select/policy_signal_frac")
    if frac is None or frac >= MIN_GROUP_SIGNAL:
        return None
    mean, k = signal["select/policy_group_score_mean"], step_cfg.samples_per_prompt
    state = ("its answers score the same on almost every prompt" if 0 < mean < 1 else
             f"it gets almost every prompt {'right' if mean >= 1 else 'wrong'} every time (mean score {mean:.3f})")
    return (f"only {frac:.1%} of the start policy's groups of {k} sampled answers score differently, below "
            f"{MIN_GROUP_SIGNAL:.0%}: {state}, so their {step_cfg.advantage_estimator} advantages are all 0 and "
            f"there is nothing to learn from. Sample more answers per prompt ({prefix}step.samples_per_prompt={2 * k}) or "
            f"at a higher temperature ({prefix}step.temperature), or start from a policy that solves some of the prompts "
            f"(train SFT longer, or on answers shaped like the rule expects)")


def chain_settings(step_dir: Path):
    """The pipeline settings of the chain whose step runs in ``step_dir`` (rlhf.config.PipelineConfig),
    read from the chain's config.yaml in the folder above; None for a step run on its own."""
    from rlhf.config import PipelineConfig

    chain_config = step_dir.parent / "config.yaml"
    if not chain_config.exists() or "pipeline" not in (chain := OmegaConf.load(chain_config)):
        return None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PipelineConfig), chain.pipeline))


def chain_final(chain_dir: Path, step: str) -> dict:
    """A chain step's final figures ({} if it has none)."""
    f = chain_dir / step / "final_metrics.json"
    return json.loads(f.read_text()) if f.exists() else {}


def constant_answer_accuracy(rule, prompts: list[str], answers: list[str], top: int = 16) -> tuple[float, str]:
    """The accuracy by ``rule`` on ``prompts`` of the best single answer given to all of them, among
    the ``top`` most frequent of ``answers`` (the training answers), and that answer: what a policy
    that ignores its prompt scores. Where one answer is often right (a count, a yes or no), a policy
    that learned only that answer passes an absolute accuracy bar at its first evaluation."""
    from collections import Counter

    best = (0.0, "")
    for answer, _ in Counter(answers).most_common(top):
        best = max(best, (sum(rule(p, answer) for p in prompts) / len(prompts), answer))
    return best


def accuracy_bar(stop_at: float, constant: float) -> float:
    """SFT's accuracy stop: ``stop_at`` (step.stop_at_accuracy) of the way from the best constant
    answer's accuracy to 1; ``stop_at`` itself where no constant answer scores."""
    return constant + stop_at * (1.0 - constant)


def _stop_at_accuracy(chain_dir: Path, name: str) -> float:
    """The chain's step ``name``'s step.stop_at_accuracy from its resolved config (2, never reached, if unset)."""
    value = _step_config(chain_dir, name).step.get("stop_at_accuracy")
    return 2.0 if value is None else float(value)


def ppo_start_gate(step_dir: Path, rule: str) -> tuple:
    """How a chain judges PPO's start check (rlhf.runners.ppo_judge.Judge's ``gate`` and
    ``stop_on_gate``): reward_misjudges_policy against the chain's floor, stopping the step where
    pipeline.on_weak_step=stop; (None, True) for a step run on its own, which no floor binds."""
    pipe = chain_settings(step_dir)
    if pipe is None:
        return None, True
    return (lambda figures, scored: reward_misjudges_policy(pipe, figures, scored, rule, step_dir),
            pipe.on_weak_step == "stop")
