"""Tiny PPO runs through real DeepSpeed engines (zero 0 and 3, one process), the e2e chain and its
step-level resume, and the chat CLI."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlhf.config import ConfigError, to_schema
from rlhf.launch import run
from tests.conftest import check_margin, compose, run_cli, same_run, trajectory_overrides

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=64"]
PPO_FAST = ["step=ppo", "step.rollout_batch_size_per_device=16", "step.micro_batch_size_per_device=8",
            "step.max_steps=3", "step.eval_prompts=16", "step.eval_micro_batch_size_per_device=16",
            "step.max_new_tokens=6", "step.eval_every_steps=0", *QUIET]


@pytest.fixture(scope="module")
def sft_and_reward(tmp_path_factory):
    """A briefly trained SFT model and reward model, shared by the PPO tests."""
    base = tmp_path_factory.mktemp("chain")
    run(compose(["step=sft", "step.max_steps=40", *QUIET, *trajectory_overrides(), f"run_dir={base / 'sft'}"]))
    run(compose(["step=reward", "step.max_steps=40", "step.rule_check_answers=0", *QUIET, *trajectory_overrides(),
                 f"run_dir={base / 'reward'}"]))
    return base / "sft" / "model", base / "reward" / "model"


@pytest.mark.parametrize("zero,extra", [
    # recompute: old log-probs from a forward over the finished sequences; the default takes the sampler's.
    ("0", ["step.offload_reference=true", "step.offload_reward=true", "step.old_logprobs=recompute"]),
    ("3", []),
])
def test_ppo_runs_moves_the_actor_and_not_the_reference(tmp_path, sft_and_reward, zero, extra):
    sft, rm = sft_and_reward
    final = run(compose([*PPO_FAST, f"zero={zero}", *extra, f"actor.path={sft}", f"critic.path={rm}",
                         f"run_dir={tmp_path}"]))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "policy_loss" in r]
    assert len(steps) == 3
    for r in steps:
        for key in ("reward/score_mean", "reward/rm_score", "kl", "entropy", "clip_frac", "policy_loss",
                    "value_loss", "answer_len", "generate_s", "experience_s", "train_s", "samples_per_s", "tflops",
                    "generate_tflops", "scoring_tflops", "update_tflops", "rollout/rule_accuracy", "rollout/truncated_frac", "rollout/logprob_diff"):
            assert math.isfinite(r[key]), (key, r)
        assert r["generate_s"] <= r["experience_s"] <= r["step_s"]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-5), "actor and reference start identical"
    assert final["reference_weight_change"] == 0.0
    assert final["actor_weight_change"] > 0.0
    # The last actor differs from its SFT start (it is model/, or model_last/ when 3 steps did not beat
    # the start and model/ is a copy of it); the saved critic is a reward-model folder.
    last = tmp_path / ("model_last" if final.get("best_step") == 0 else "model")
    before, after = load_file(sft / "model.safetensors"), load_file(last / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "critic" / "config.json").exists()
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["actor"]["zero_optimization"]["stage"] == int(zero)
    if extra:  # offloaded frozen roles live partitioned in host memory
        assert ds["reference"]["zero_optimization"]["offload_param"]["device"] == "cpu"
        assert ds["reward"]["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.trajectory
def test_ppo_in_a_chain_stops_before_its_first_update_where_the_reward_model_misjudges_the_policy(
        tmp_path, sft_and_reward, monkeypatch, record_property):
    """Before any update PPO scores the policy's own sampled answers with the reward model and the
    rule: their AUC (select/policy_rm_auc), every row in policy_check.jsonl. In a chain whose floor
    (pipeline.reward_min_policy_auc) it misses, PPO stops with one line naming the figure, a wrong
    answer the model scores above the right ones, and the fixes; on_weak_step=warn runs it with the
    warning. The check draws from its own RNG: the run is the same without it."""
    from omegaconf import OmegaConf

    from rlhf.losses import auc
    from rlhf.runners import ppo_judge

    _, rm = sft_and_reward
    # A policy with right answers to sample (the shared 40-step one has none).
    run(compose(["step=sft", "step.max_steps=100", *QUIET, *trajectory_overrides(), f"run_dir={tmp_path / 'sft'}"]))
    args = [*PPO_FAST, "step.max_steps=2", f"actor.path={tmp_path / 'sft' / 'model'}", f"critic.path={rm}"]
    chain = tmp_path / "chain"
    chain.mkdir()
    OmegaConf.save({"pipeline": {"reward_min_policy_auc": 1.0}}, chain / "config.yaml")  # a floor nothing short of perfect meets
    with pytest.raises(ConfigError, match=r"PPO stopped before its first update: the reward model separates the "
                                          r"policy's own sampled answers, right from wrong by the rule, with AUC "
                                          r"(0\.\d+), .*below pipeline.reward_min_policy_auc=1.0.*"
                                          r"pipeline.ppo.step.reward_fn=rule.*pipeline.on_weak_step=warn") as err:
        run(compose([*args, f"run_dir={chain / 'ppo'}"]))
    rows = [json.loads(line) for line in open(chain / "ppo" / "policy_check.jsonl")]
    assert len(rows) == 4 * 16 and {r["rule"] for r in rows} <= {0.0, 1.0}
    # An AUC needs right and wrong answers among the 64 samples of the 100-step policy.
    right = sum(r["rule"] == 1.0 for r in rows)
    check_margin(record_property, "fewer of right, wrong sampled answers", min(right, len(rows) - right), 1)
    scores, truth = torch.tensor([r["rm_score"] for r in rows]), torch.tensor([r["rule"] for r in rows])
    assert f"AUC {auc(scores, truth):.3f}" in str(err.value)
    assert not (chain / "ppo" / "final_metrics.json").exists()

    OmegaConf.save({"pipeline": {"reward_min_policy_auc": 1.0, "on_weak_step": "warn"}}, chain / "config.yaml")
    final = run(compose([*args, f"run_dir={chain / 'warned'}"]))
    assert final["select/policy_rm_auc_before"] == pytest.approx(auc(scores, truth), abs=1e-6)
    assert any(w.startswith("ran though it may not work (pipeline.on_weak_step=warn): the reward model separates")
               for w in final["warnings"])
    monkeypatch.setattr(ppo_judge, "policy_check", lambda *a: ({}, []))
    run(compose([*args, f"run_dir={tmp_path / 'unchecked'}"]))
    same_run(chain / "warned", tmp_path / "unchecked", "policy_loss")


def test_scoring_in_generation_chunks_gives_the_same_step(tmp_path, sft_and_reward):
    """step.generation_batch_size_per_device splits generation and every scoring forward (reference,
    critic, reward model, and the actor's with step.old_logprobs=recompute) into chunks of rows: with
    rollouts at a temperature where every draw is the argmax the step's figures are those of one
    whole-batch pass."""
    sft, rm = sft_and_reward
    rows = {}
    for chunk in (0, 5):  # 16 rollouts: chunks of 5, 5, 5 and 1
        run(compose([*PPO_FAST, "step.max_steps=1", "step.temperature=0.001", "step.old_logprobs=recompute",
                     f"step.generation_batch_size_per_device={chunk}", f"actor.path={sft}", f"critic.path={rm}",
                     f"run_dir={tmp_path / str(chunk)}"]))
        rows[chunk] = next(json.loads(line) for line in open(tmp_path / str(chunk) / "metrics.jsonl")
                           if "policy_loss" in line)
    for key in ("answer_len", "reward/score_mean", "reward/rm_score", "kl", "policy_loss", "value_loss"):
        assert rows[5][key] == pytest.approx(rows[0][key], rel=1e-4, abs=1e-6), key
    # The entropy is of softmax(logits / 0.001): a last-bit difference between a 5-row and a 16-row
    # matrix product (AVX2 kernels: 2e-4 relative) is a thousand times larger there.
    assert rows[5]["entropy"] == pytest.approx(rows[0]["entropy"], rel=1e-2)


def test_ppo_keeps_its_best_actor_by_one_half_of_the_prompts_and_reports_the_other(tmp_path, sft_and_reward):
    """Every evaluation answers the select half (select/*), which alone picks the best actor; the
    reported half (eval/*) is answered at step 0, for each new best and at the end, so the output's
    reported accuracy comes from prompts the choice never read."""
    sft, _ = sft_and_reward
    final = run(compose([*PPO_FAST, "step.reward_fn=rule", "step.reward_model_weight=0", "step.max_steps=4",
                         "step.eval_every_steps=1", "step.advantage_estimator=grpo", "step.samples_per_prompt=4",
                         f"actor.path={sft}", f"run_dir={tmp_path}"]))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "select/accuracy" in line]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    record = -1.0
    for r in rows:
        new_best = r["select/accuracy"] > record
        record = max(record, r["select/accuracy"])
        assert ("eval/accuracy" in r) == (new_best or r["step"] in (0, 4)), r
    best = max(rows, key=lambda r: r["select/accuracy"])  # the first of equals, as the runner keeps it
    assert final["best_step"] == best["step"] and final["eval/accuracy"] == best["eval/accuracy"]
    assert final["eval/accuracy_before"] == rows[0]["eval/accuracy"]


def test_ppo_with_rule_reward_grpo_ema_and_ptx_text(tmp_path, sft_and_reward):
    sft, _ = sft_and_reward
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "train.jsonl").write_text("".join(
        json.dumps({"body": f"plain text number {i} for the pretraining loss"}) + "\n" for i in range(40)))
    final = run(compose([*PPO_FAST, "step.reward_fn=rule", "step.reward_model_weight=0", "step.ptx_coef=0.5",
                         f"data.ptx_sources=[{{path: {tmp_path / 'ptx'}, columns: {{text: body}}}}]",
                         "step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.ema_decay=0.9",
                         "step.kl_estimator=k3", "step.kl_target=0.1", f"actor.path={sft}", f"run_dir={tmp_path}"]))
    assert "eval/accuracy" in final and "eval/rm_score" not in final
    assert (tmp_path / "model_ema" / "config.json").exists()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "policy_loss" in line]
    assert rows[-1]["kl_coef"] != 0.05, "the adaptive controller moves the coefficient"
    assert all(r["ptx_loss"] > 0 for r in rows)
    # GRPO: no critic anywhere; its KL is a term of the loss (k3 by the paper), not of the reward.
    assert not (tmp_path / "critic").exists() and "value_loss" not in rows[0]
    assert set(json.loads((tmp_path / "ds_config.json").read_text())) == {"actor", "reference"}  # no reward model
    # k3 is never negative; the first update starts at the reference (only its second micro batch moved).
    assert all(r["kl_loss"] >= 0 for r in rows) and rows[0]["kl_loss"] < 0.01 and rows[-1]["kl_loss"] > 0


@pytest.mark.parametrize("estimator,extra", [
    ("rloo", ["step.samples_per_prompt=4"]),
    ("reinforce_pp", ["zero=3"]),
    ("reinforce_pp_baseline", ["step.samples_per_prompt=2", "step.kl_in=reward"]),
])
def test_critic_free_estimators_build_no_critic_and_move_the_actor(tmp_path, sft_and_reward, estimator, extra):
    sft, rm = sft_and_reward
    final = run(compose([*PPO_FAST, f"step.advantage_estimator={estimator}", *extra, f"actor.path={sft}",
                         f"critic.path={rm}", f"run_dir={tmp_path}"]))
    assert final["actor_weight_change"] > 0 and final["reference_weight_change"] == 0.0
    assert not (tmp_path / "critic").exists()
    assert "critic" not in json.loads((tmp_path / "ds_config.json").read_text())
    assert not any("critic" in p.name for p in (tmp_path / "checkpoints").rglob("*"))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "policy_loss" in line]
    assert "value_loss" not in rows[0] and "kl_loss" not in rows[0], "the KL is in the reward here"
    assert all(math.isfinite(r["policy_loss"]) and math.isfinite(r["kl_k1"]) for r in rows)


# A rule whose score is constant on three prompts in four (by their text): those groups carry no signal
# whatever the policy samples, so dynamic sampling must drop them and draw more prompts.
_HALF_SILENT_RULE = """
def score(prompt, answer):
    if sum(map(ord, prompt)) % 4:
        return 0.0
    return float(sum(map(ord, answer)) % 2)
"""


@pytest.mark.parametrize("extra", [
    ["step.policy_loss=gspo", "step.dynamic_sampling=true", "step.overlong_buffer=2"],
    ["step.policy_loss=cispo", "step.rollout_correction=tis"],
    ["step.clip_eps_high=0.28", "step.rollout_correction=icepop", "step.reward_fn=null"],
    ["step.rollout_correction=mis", "step.advantage_estimator=rloo"],
], ids=["gspo-dynamic-overlong", "cispo-tis", "clip_higher-icepop-gae", "rloo-mis"])
def test_rlvr_objectives_and_corrections_train_the_actor(tmp_path, sft_and_reward, monkeypatch, extra):
    """Each objective (GSPO, CISPO, PPO with clip-higher) and rollout correction trains through the PPO
    step. In fp32 the sampler's and a training forward's log-probs agree to rounding (by construction:
    the same weights and precision), so a correction changes no token; dynamic sampling meets groups
    without a signal in every step (the rule above) and draws more prompts to replace them."""
    sft, rm = sft_and_reward
    (tmp_path / "silent_rule.py").write_text(_HALF_SILENT_RULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    critic_free = ["step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.reward_fn=silent_rule:score",
                   "step.reward_model_weight=0"]
    final = run(compose([*PPO_FAST, *([] if "step.reward_fn=null" in extra else critic_free), *extra,
                         f"actor.path={sft}", f"critic.path={rm}", f"run_dir={tmp_path / 'run'}"]))
    assert final["actor_weight_change"] > 0 and final["reference_weight_change"] == 0.0
    assert final["stopped_by"] == "the cap step.max_steps=3", "every step's final figures say what ended it"
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "policy_loss" in line]
    assert len(rows) == 3 and all(math.isfinite(r["policy_loss"]) and math.isfinite(r["loss"]) for r in rows)
    if any("rollout_correction" in x for x in extra):
        assert final["old_logprobs"] == "recompute", "a correction weighs the sampler against a training forward"
        assert all(r["rollout/sampler_logprob_diff"] < 1e-4 and r["rollout/correction_changed_frac"] == 0.0
                   for r in rows)
    if "step.dynamic_sampling=true" in extra:
        assert all(r["rollout/zero_std_frac"] > 0 for r in rows)
        assert all(r["rollout/prompt_draws"] >= 2 for r in rows), "silent groups were replaced by more prompts"
        assert all(0.0 <= r["rollout/dynamic_fill_frac"] < 1.0 for r in rows)


@pytest.mark.parametrize("rule,silent", [("0.0", True), ("float(sum(map(ord, answer)) % 2)", False)])
def test_the_start_check_counts_the_groups_with_a_signal_and_warns_where_almost_none_has_one(
        tmp_path, sft_and_reward, monkeypatch, rule, silent):
    """A rule that scores every answer alike gives no group a signal (by construction): the start check
    says so with the fraction and the fix; one that scores by the answer's text splits almost every group."""
    sft, _ = sft_and_reward
    module = f"group_rule_{int(silent)}"  # a module of its own per case: an import is cached
    (tmp_path / f"{module}.py").write_text(f"def score(prompt, answer):\n    return {rule}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    final = run(compose([*PPO_FAST, "step.max_steps=1", "step.advantage_estimator=grpo", "step.samples_per_prompt=4",
                         f"step.reward_fn={module}:score", "step.reward_model_weight=0", f"actor.path={sft}",
                         f"run_dir={tmp_path / 'run'}"]))
    start = next(json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
                 if "select/policy_signal_frac" in line)
    warned = [w for w in final["warnings"] if "of the start policy's groups of 4 sampled answers score differently" in w]
    if silent:
        assert start["select/policy_signal_frac"] == 0.0 and start["select/policy_group_score_mean"] == 0.0
        assert len(warned) == 1 and "only 0.0%" in warned[0] and "step.samples_per_prompt=8" in warned[0]
        assert "wrong every time" in warned[0]
    else:
        assert start["select/policy_signal_frac"] > 0.5 and not warned


def test_rlvr_options_refuse_what_cannot_work_naming_the_key():
    def step(*overrides):
        return to_schema(compose(["step=ppo", *overrides])).step

    with pytest.raises(ConfigError, match="step.policy_loss=gspo clips one ratio per answer.*leave step.loss_agg unset"):
        step("step.policy_loss=gspo", "step.loss_agg=token_mean")
    with pytest.raises(ConfigError, match="step.rollout_correction=tis with step.old_logprobs=rollout.*recompute"):
        step("step.rollout_correction=tis", "step.old_logprobs=rollout")
    with pytest.raises(ConfigError, match="step.dynamic_sampling.*step.samples_per_prompt >= 2"):
        step("step.dynamic_sampling=true")
    with pytest.raises(ConfigError, match="step.overlong_buffer=9 must be in \\[0, step.max_new_tokens=8\\]"):
        step("step.overlong_buffer=9")
    with pytest.raises(ConfigError, match="step.policy_loss='sapo'.*ppo, gspo, cispo"):
        step("step.policy_loss=sapo")
    # Unset ranges take each paper's.
    assert (step("step.policy_loss=gspo").clip_eps_low, step("step.policy_loss=gspo").clip_eps_high) == (3e-4, 4e-4)
    assert (step("step.clip_eps_high=0.28").clip_eps_low, step("step.clip_eps_high=0.28").clip_eps_high) == (0.2, 0.28)
    assert step("step.policy_loss=cispo").loss_agg == "token_mean"
    tis = step("step.rollout_correction=tis")
    assert (tis.rollout_correction_cap, tis.old_logprobs) == (2.0, "recompute"), "auto takes both log-probs"


def test_critic_free_estimators_leave_the_critic_out_of_the_memory_preflight():
    from rlhf.preflight import memory

    gae = [r.role for r in memory.estimate(to_schema(compose(["step=ppo"])))]
    rloo = [r.role for r in memory.estimate(to_schema(compose(["step=ppo", "step.advantage_estimator=rloo",
                                                               "step.samples_per_prompt=4"])))]
    assert "critic" in gae and "critic" not in rloo and set(gae) - {"critic"} == set(rloo)


def test_each_estimator_defaults_to_its_papers_kl_and_the_command_line_wins():
    def step(*o):
        return to_schema(compose(["step=ppo", *o])).step

    assert (step().kl_in, step().kl_estimator) == ("reward", "k1")
    grpo = step("step.advantage_estimator=grpo", "step.samples_per_prompt=4")
    assert (grpo.kl_in, grpo.kl_estimator) == ("loss", "k3")
    mine = step("step.advantage_estimator=grpo", "step.samples_per_prompt=4", "step.kl_in=reward")
    assert (mine.kl_in, mine.kl_estimator) == ("reward", "k3")


def test_ppo_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="step.rollout_batch_size_per_device=20 is not divisible"):
        to_schema(compose(["step=ppo", "step.rollout_batch_size_per_device=20", "step.micro_batch_size_per_device=8"]))
    with pytest.raises(ConfigError, match="step.kl_estimator='k9'.*k1, k2, k3"):
        to_schema(compose(["step=ppo", "step.kl_estimator=k9"]))
    with pytest.raises(ConfigError, match="step.advantage_estimator='ppo'.*gae, grpo, dr_grpo, rloo, reinforce_pp"):
        to_schema(compose(["step=ppo", "step.advantage_estimator=ppo"]))
    with pytest.raises(ConfigError, match="step.kl_in='advantage'.*reward, loss"):
        to_schema(compose(["step=ppo", "step.kl_in=advantage"]))
    with pytest.raises(ConfigError, match="step.old_logprobs='cached'.*rollout, recompute"):
        to_schema(compose(["step=ppo", "step.old_logprobs=cached"]))
    with pytest.raises(ConfigError, match="rloo compares the answers to one prompt.*samples_per_prompt >= 2"):
        to_schema(compose(["step=ppo", "step.advantage_estimator=rloo"]))
    with pytest.raises(ConfigError, match="not a multiple of step.samples_per_prompt=3"):
        to_schema(compose(["step=ppo", "step.advantage_estimator=grpo", "step.samples_per_prompt=3"]))
    with pytest.raises(ConfigError, match="no step.reward_fn"):
        to_schema(compose(["step=ppo", "step.reward_model_weight=0"]))
    with pytest.raises(ConfigError, match="needs critic.path or reward.path"):
        run(compose(["step=ppo", "run_dir=/tmp/never-written"]))
    for key in ("step.top_k=50", "step.top_p=0.9"):  # a truncated sampler: refused, with why
        with pytest.raises(ConfigError, match=f"{key.replace('.', '[.]')}.*full distribution.*infinite KL"):
            to_schema(compose(["step=ppo", key]))
    with pytest.raises(ConfigError, match=r"^step.do_sample=false: .*every advantage 0\); set step.do_sample=true"):
        to_schema(compose(["step=ppo", "step.do_sample=false"]))
    for extra in (["step.kl_in=loss"], ["step.advantage_estimator=grpo", "step.samples_per_prompt=4",
                                        "step.kl_estimator=k1"]):
        with pytest.raises(ConfigError, match=r"^step.kl_in=loss with step.kl_estimator=k1: .*set step.kl_estimator=k3"):
            to_schema(compose(["step=ppo", *extra]))
    # The fixes the two lines name are accepted.
    assert to_schema(compose(["step=ppo", "step.kl_in=loss", "step.kl_estimator=k3"])).step.kl_in == "loss"
    assert to_schema(compose(["step=ppo", "step.do_sample=true"])).step.do_sample
    with pytest.raises(ConfigError, match="step.loss_agg='mean'.*token_mean, seq_mean_token_mean"):
        to_schema(compose(["step=ppo", "step.loss_agg=mean"]))
    with pytest.raises(ConfigError, match="step.truncated_answers='drop'.*keep, penalty, mask"):
        to_schema(compose(["step=ppo", "step.truncated_answers=drop"]))


@pytest.mark.parametrize("mode", ["mask", pytest.param("penalty", marks=pytest.mark.slow)])
@pytest.mark.trajectory
def test_truncated_answers_are_counted_and_masked_or_penalized(tmp_path, sft_and_reward, mode, record_property):
    """Answers of at most 2 tokens: most are cut without eos. Their fraction is logged, and so is
    the sampler's log-prob gap to a training forward (fp32: rounding only); mask leaves them out of
    the loss, penalty lowers the score they are trained on by step.truncated_penalty: either way the
    same rollouts give another policy loss than keeping them."""
    sft, rm = sft_and_reward
    common = [*PPO_FAST, "step.max_steps=2", "step.max_new_tokens=2", "step.log_every_steps=1",
              f"actor.path={sft}", f"critic.path={rm}"]
    # penalty 0 trains on cut answers as keep does; keep itself is refused at a budget this short.
    keep = run(compose([*common, "step.truncated_answers=penalty", "step.truncated_penalty=0", f"run_dir={tmp_path / 'keep'}"]))
    other = run(compose([*common, f"step.truncated_answers={mode}", f"run_dir={tmp_path / mode}"]))
    rows = {d: [json.loads(x) for x in open(tmp_path / d / "metrics.jsonl") if "policy_loss" in x]
            for d in ("keep", mode)}
    check_margin(record_property, "rollout/truncated_frac", rows["keep"][0]["rollout/truncated_frac"], 0.3, strict=True)
    assert rows["keep"][0]["rollout/truncated_frac"] <= 1.0
    # The first rollouts are the same (same seed, same actor): only what is trained on differs.
    assert rows[mode][0]["rollout/truncated_frac"] == rows["keep"][0]["rollout/truncated_frac"]
    assert all(math.isfinite(r["rollout/logprob_diff"]) and r["rollout/logprob_diff"] < 1e-3 for r in rows[mode])
    if mode == "penalty":
        drop = rows["keep"][0]["reward/score_mean"] - rows[mode][0]["reward/score_mean"]
        assert drop == pytest.approx(0.0, abs=1e-6), "the logged score is the reward model's and rule's"
        assert rows[mode][0]["policy_loss"] != pytest.approx(rows["keep"][0]["policy_loss"], abs=1e-6)
    else:
        assert rows[mode][0]["policy_loss"] != pytest.approx(rows["keep"][0]["policy_loss"], abs=1e-6)
    assert other["actor_weight_change"] > 0 and keep["actor_weight_change"] > 0


@pytest.mark.trajectory
def test_e2e_chain_runs_and_a_rerun_skips_finished_steps(tmp_path, capsys, record_property):
    overrides = ["pipeline=e2e", *QUIET, f"run_dir={tmp_path}",
                 # One key of one step, as README shows: no quoting, the step's other settings kept.
                 "pipeline.sft.step.max_steps=10",
                 "pipeline.reward.step.max_steps=10", "pipeline.reward.step.rule_check_answers=0",
                 "pipeline.reward.step.policy_pairs_prompts=64",
                 "pipeline.ppo.step.max_steps=2", "pipeline.ppo.step.rollout_batch_size_per_device=16",
                 "pipeline.ppo.step.micro_batch_size_per_device=8", "pipeline.ppo.step.eval_prompts=16",
                 "pipeline.on_weak_step=warn"]
    first = run(compose(overrides), overrides=overrides)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert list(manifest["steps"]) == ["sft", "reward", "ppo"]
    ppo_overrides = manifest["steps"]["ppo"]["overrides"]
    assert f"actor.path={tmp_path / 'sft' / 'model'}" in ppo_overrides
    assert f"critic.path={tmp_path / 'reward' / 'model'}" in ppo_overrides
    # The reward model also trained on pairs of the SFT policy's own answers, labelled by the rule.
    assert f"step.policy_path={tmp_path / 'sft' / 'model'}" in manifest["steps"]["reward"]["overrides"]
    reward = json.loads((tmp_path / "reward" / "final_metrics.json").read_text())
    assert 0 < reward["policy_pairs_prompts"] <= 64 and reward["policy_pairs"] > 0
    assert "+stage=[e2e/ppo]" in ppo_overrides and manifest["steps"]["ppo"]["delta"]["step"]["max_steps"] == 2
    # The stage file's keys stay where the delta does not touch them.
    ppo_cfg = (tmp_path / "ppo" / "config.yaml").read_text()
    assert "lr: 0.0003" in ppo_cfg and "epochs: 6" in ppo_cfg and "eval_prompts: 16" in ppo_cfg
    out = capsys.readouterr().out
    # The closing summary: each step's figures, the warnings, the outputs and the next command.
    block = out[out.rindex("[e2e] ----"):]
    assert "Step 1 (SFT), 0:00:" in block and "held-out accuracy by the rule 0.0% ->" in block
    assert "Step 2 (reward model), " in block and "held-out pairwise accuracy" in block
    assert "Step 3 (PPO), " in block and "held-out accuracy by the rule" in block
    assert f"[e2e] next: python -m rlhf.chat --path {tmp_path / 'ppo' / 'model'}" in block
    # 10 steps make a weak reward model: with on_weak_step=warn the chain says so before PPO and at the end.
    check_margin(record_property, "reward eval/acc after 10 steps", reward["eval/acc"], 0.95, higher=False, strict=True)
    assert "below pipeline.reward_min_accuracy=0.95" in manifest["steps"]["ppo"]["warnings"][0]
    assert "[e2e] WARNING Step 3 (PPO) may not work: the reward model's held-out pairwise accuracy" in out
    assert "[e2e] WARNING ppo: ran though it may not work (pipeline.on_weak_step=warn): the reward model's" in block
    assert (tmp_path / "ppo" / "model" / "config.json").exists()

    again = run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    for title in ("Step 1 (SFT)", "Step 2 (reward model)", "Step 3 (PPO)"):
        assert f"{title}: finished output at" in out and "skipping" in out
    assert again["outputs"] == first["outputs"]
    # The same folder under another seed is another experiment: refused before any step trains.
    with pytest.raises(ConfigError, match=r"the chain's Step 1 \(SFT\) made with other settings \(seed: 42 -> 3"):
        run(compose([*overrides, "seed=3"]), overrides=[*overrides, "seed=3"])
    # Where the rule scores the prompts, PPO's output is its best evaluation, and the greedy answers are kept.
    final = json.loads((tmp_path / "ppo" / "final_metrics.json").read_text())
    assert final["best_step"] in (0, 2) and isinstance(final["warnings"], list)
    samples = [json.loads(line) for line in open(tmp_path / "ppo" / "samples.jsonl")]
    assert {s["step"] for s in samples} == {0, 2} and all(s["rule"] in (0.0, 1.0) for s in samples)
    # One step's setting changed through the chain (what a printed fix does): that step trains again
    # from the start, the steps before it are reused.
    fixed = [*overrides, "pipeline.ppo.step.max_steps=1"]
    run(compose(fixed), overrides=fixed)
    out = capsys.readouterr().out
    assert "Step 1 (SFT): finished output at" in out and "Step 2 (reward model): finished output at" in out
    assert "[e2e] Step 3 (PPO): trained again from the start: its settings changed (step.max_steps: 2 -> 1)" in out
    assert json.loads((tmp_path / "ppo" / "final_metrics.json").read_text())["step"] == 1


def test_the_chain_refuses_a_step_that_cannot_work_with_one_line(tmp_path):
    """Two SFT steps leave a policy with no right answers and a held-out loss still falling: the
    chain refuses PPO after it (the rule as reward, so no reward model is needed), and a reward
    model after it, each before the step starts, naming the figure, the reason and the fix."""
    quick = [*QUIET, "pipeline=e2e", "pipeline.sft.step.max_steps=2", "pipeline.sft.step.eval_accuracy_prompts=32"]
    ppo = [*quick, "pipeline.steps=[sft,ppo]", "pipeline.ppo.step.reward_fn=rule", "pipeline.ppo.step.reward_model_weight=0",
           f"run_dir={tmp_path / 'ppo'}"]
    with pytest.raises(ConfigError, match=r"Step 2 \(PPO\) not started: the SFT policy's held-out accuracy by the rule is "
                                          r"0\.0%, below pipeline.min_policy_accuracy=0.02: .*SFT stopped at its cap \(the cap step.max_steps=2\): "
                                          r"train it longer, pipeline.sft.step.max_steps=4"
                                          r".*pipeline.on_weak_step=warn"):
        run(compose(ppo), overrides=ppo)
    assert not (tmp_path / "ppo" / "ppo" / "final_metrics.json").exists()
    reward = [*quick, "pipeline.steps=[sft,reward]", f"run_dir={tmp_path / 'reward'}"]
    with pytest.raises(ConfigError, match=r"Step 2 \(reward model\) not started: SFT stopped with its held-out loss still "
                                          r"falling \([0-9.]+ -> [0-9.]+, \d+% over its last evaluation interval"):
        run(compose(reward), overrides=reward)


def test_an_sft_no_better_than_one_constant_answer_is_refused(tmp_path):
    """A count task: SFT's output is right for 52% of the 100 report prompts (a cap of 256, fewer
    there), where always answering " 1" is right for 41.1% of them: 10.9 points, inside two standard
    errors of the difference over 100 prompts (13.9 points), so the step after SFT is refused. The
    select half's figures (the ones SFT's stop rule and the constant's choice read, 60% against 41%)
    do not decide. Beyond the noise, or where no single answer is often right, it is not refused."""
    from omegaconf import OmegaConf

    from rlhf.chain.readiness import weak_step

    (tmp_path / "sft").mkdir()
    OmegaConf.save({"step": {"eval_accuracy_prompts": 256}, "optim": {"lr": 3e-3}}, tmp_path / "sft" / "config.yaml")
    pipe = OmegaConf.create({"reward_min_accuracy": 0, "min_policy_accuracy": 0, "sft_loss_still_falling": 0,
                             "sft_beyond_constant": True})

    def why(accuracy: float, constant: float) -> str | None:
        final = {"select/accuracy": 0.60, "select/constant_accuracy": 0.41, "eval/accuracy": accuracy,
                 "eval/constant_accuracy": constant, "eval/prompts": 100.0}
        (tmp_path / "sft" / "final_metrics.json").write_text(json.dumps(final))
        return weak_step(pipe, "reward", OmegaConf.create({}), tmp_path, ["sft", "reward", "ppo"])

    line = why(0.52, 0.411)
    assert line.startswith("SFT's held-out accuracy 52.0% is within the noise (13.9% over 100 prompts) "
                           "of always giving the best single answer (41.1%)"), line
    # The fix that worked on the count task: a third of the learning rate, no loss-plateau stop.
    assert "(pipeline.sft.optim.lr=0.001 pipeline.sft.step.early_stop_patience=0)" in line, line
    assert why(0.56, 0.411) is None, "15 points over the constant is beyond the noise of 100 prompts"
    assert why(0.02, 0.004) is None, "no answer is often right (sort): min_policy_accuracy's case, not this one"
    pipe.sft_beyond_constant = False
    assert why(0.52, 0.411) is None


def test_sft_reports_the_constant_answer_on_its_report_half_with_the_real_prompt_count(tmp_path):
    final = run(compose(["step=sft", "step.max_steps=2", "step.eval_accuracy_prompts=12", "step.save_model=false",
                         *QUIET, f"run_dir={tmp_path}"]))
    assert final["eval/prompts"] == 12.0 and 0.0 <= final["eval/constant_accuracy"] <= 1.0
    assert "select/constant_accuracy" not in final  # no accuracy stop: no bar to place


@pytest.mark.parametrize("rule", ["", "my_rule:score"])
def test_a_weak_reward_model_is_refused_with_the_users_rule_as_the_fix(tmp_path, rule):
    """The refusal names the figure and the floor; where the user has a rule, its first fix is that rule
    as PPO's reward (no reward model to game), and a longer schedule comes after. The figures are
    read from the steps' final metrics."""
    from omegaconf import OmegaConf

    from rlhf.chain.readiness import printed_fixes, weak_step, with_fix

    for step, final in (("sft", {"eval/accuracy": 0.30, "select/accuracy": 0.31}), ("reward", {"eval/acc": 0.71})):
        (tmp_path / step).mkdir()
        (tmp_path / step / "final_metrics.json").write_text(json.dumps(final))
    pipe = OmegaConf.create({"reward_min_accuracy": 0.975, "min_policy_accuracy": 0.02, "sft_loss_still_falling": 0,
                             "sft_beyond_constant": False})
    step = OmegaConf.create({"step": {"reward_model_weight": 1.0}, "data": {"rule": rule}})
    why = weak_step(pipe, "ppo", step, tmp_path, ["sft", "reward", "ppo"])
    assert why.startswith("the reward model's held-out pairwise accuracy 0.710 is below pipeline.reward_min_accuracy=0.975")
    fix = "Reward PPO with your rule instead (my_rule:score; it cannot be gamed, so each rollout batch gets 4 update passes)"
    assert (fix in why) == bool(rule)
    fixes = printed_fixes(why)
    rule_fix = ["pipeline.ppo.step.reward_fn=rule", "pipeline.ppo.step.reward_model_weight=0",
                "pipeline.ppo.step.ppo_epochs=4"]
    assert (fixes[0] if rule else []) == (rule_fix if rule else [])
    assert "train it longer" in why.lower()
    if rule:  # copied onto a command that set one of its keys already: the fix's value replaces it, once
        assert with_fix(["seed=1", "pipeline.ppo.step.reward_model_weight=1.0"], fixes[0]) == ["seed=1", *rule_fix]
    assert weak_step(pipe, "ppo", OmegaConf.create({"step": {"reward_model_weight": 0.0}, "data": {"rule": rule}}),
                     tmp_path, ["sft", "reward", "ppo"]) is None, "no reward model in PPO's reward: nothing to refuse"


def test_chat_cli_answers_clears_and_quits(sft_and_reward):
    sft, _ = sft_and_reward
    proc = run_cli("--path", str(sft), "--max-new-tokens", "6", module="rlhf.chat", timeout=300,
                   input="sort d b a c\nclear\nsort z y x w\nquit\nnever read\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("Assistant:") == 2 and "(conversation cleared)" in proc.stdout


def test_chat_cli_refuses_a_folder_without_a_causal_lm(tmp_path):
    proc = run_cli("--path", str(tmp_path), module="rlhf.chat", input="quit\n", timeout=300)
    assert proc.returncode != 0 and "cannot load a causal LM" in proc.stderr


def test_ppo_refuses_a_reward_model_with_another_tokenizer(tmp_path):
    from rlhf.config import ModelConfig
    from rlhf.models import resolve_path

    other = resolve_path(ModelConfig(name="tiny-opt-640", family="opt", random_init=True, vocab_size=640))
    # Refused by the plan from the two checkpoints' sizes (family and vocabulary), before either loads.
    with pytest.raises(ConfigError, match=r"critic.path=.* \(opt, vocabulary 640\) does not share the actor's tokenizer"):
        run(compose([*PPO_FAST, "actor.random_init=true", f"critic.path={other}", f"run_dir={tmp_path}"]))


@pytest.mark.parametrize("with_rule", [False, True])
def test_the_chain_runs_on_a_users_own_folder_with_or_without_their_rule(tmp_path, capsys, monkeypatch, with_rule):
    """DeepSpeed-Chat's local/jsonfile layout with a task the project does not ship. Without a rule
    the default chain's SFT stop-at-accuracy cannot apply, so SFT says it runs its full length, and
    PPO says it cannot tell learning from hacking; with the user's rule (a module in the working
    directory) every step measures held-out accuracy by it, as with the shipped tasks."""
    import random

    rng = random.Random(0)
    data = tmp_path / "upper"
    data.mkdir()

    def row() -> dict:
        w = [rng.choice("abcdefghij") for _ in range(rng.randint(3, 5))]
        return {"prompt": f" Human: upper {' '.join(w)} Assistant:", "chosen": " " + " ".join(w).upper(),
                "rejected": " " + " ".join(w)}

    for split, n in (("train", 600), ("eval", 64)):
        (data / f"{split}.json").write_text(json.dumps([row() for _ in range(n)]))
    overrides = ["pipeline=e2e", f"data.sources=[{{path: {data}}}]", *QUIET, f"run_dir={tmp_path / 'run'}",
                 "pipeline.sft.step.max_steps=5", "pipeline.reward.step.max_steps=5", "pipeline.ppo.step.max_steps=1",
                 "pipeline.ppo.step.rollout_batch_size_per_device=16", "pipeline.ppo.step.micro_batch_size_per_device=8",
                 "pipeline.ppo.step.eval_prompts=8", "pipeline.on_weak_step=warn"]
    if with_rule:
        (tmp_path / "upper_rule.py").write_text(
            "def score(prompt, answer):\n"
            "    words = prompt.split('upper', 1)[1].split('Assistant:')[0].split()\n"
            "    return float(answer.split() == [w.upper() for w in words])\n")
        monkeypatch.chdir(tmp_path)
        overrides.append("data.rule=upper_rule:score")
    result = run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    sft = json.loads((tmp_path / "run" / "sft" / "final_metrics.json").read_text())
    ppo = json.loads((tmp_path / "run" / "ppo" / "final_metrics.json").read_text())
    rollout = [json.loads(line) for line in open(tmp_path / "run" / "ppo" / "metrics.jsonl") if '"kl"' in line]
    assert set(result["outputs"]) == {"sft", "reward", "ppo"} and sft["step"] == 5
    assert (tmp_path / "run" / "ppo" / "model" / "config.json").exists()
    reward = json.loads((tmp_path / "run" / "reward" / "final_metrics.json").read_text())
    if with_rule:
        assert "is ignored" not in out and "cannot tell" not in out
        assert 0.0 <= sft["eval/accuracy"] <= 1.0 and 0.0 <= ppo["eval/accuracy"] <= 1.0
        # The reward model is checked against the user's rule on the eval pairs (every pair is ranked).
        assert reward["eval/rule_pairs"] == reward["eval/rule_pairs_before"] >= 32
        assert 0.0 <= reward["eval/rule_agreement"] <= 1.0
        assert "rollout/rule_accuracy" in rollout[0] and "best_step" in ppo
    else:
        assert "step.stop_at_accuracy=0.3 is ignored and SFT runs its full length" in out
        assert "eval/accuracy" not in sft and "eval/accuracy" not in ppo and "eval/rule_agreement" not in reward
        assert "this run cannot tell learning from reward hacking" in ppo["warnings"][0]


def test_a_bad_rule_reference_fails_at_compose_time_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"data.rule='no_such_module:score': cannot import module 'no_such_module'"):
        to_schema(compose(["data.rule=no_such_module:score"]))
    with pytest.raises(ConfigError, match=r"step.reward_fn='json:nope': module 'json' .* has no function 'nope'"):
        to_schema(compose(["step=ppo", "step.reward_fn=json:nope"]))
    with pytest.raises(ConfigError, match=r"step.reward_fn='rules' is neither one of exact, math, synthetic nor"):
        to_schema(compose(["step=ppo", "step.reward_fn=rules"]))


# --------------------------------------------------------------------- learning that holds
def test_hacking_warning_needs_a_real_accuracy_drop_while_the_reward_model_score_rises():
    from rlhf.runners.ppo_judge import hacking_warning

    best = {"eval/accuracy": 0.44, "eval/rm_score": 0.63, "eval/rm_score_std": 1.0}
    hacked = {"eval/accuracy": 0.27, "eval/rm_score": 1.54, "eval/rm_score_std": 1.0}
    # 256 prompts, mean accuracy 0.355, the best of 1 earlier evaluation (z = 2): the accuracy noise is
    # 2 * sqrt(2 * 0.355 * 0.645 / 256) = 0.0846; the score's, 2 * sqrt((1 + 1) / 256) = 0.177.
    why = hacking_warning(best, hacked, 256, 1)
    assert "rose 0.630 -> 1.540 (more than its 0.177 noise) while rule accuracy fell 0.440 -> 0.270" in why
    assert "0.085 noise of 256 prompts below the best of 1 evaluations" in why
    # The best of 10 earlier evaluations: z = Phi^-1(1 - 0.02275 / 10) = 2.838, noise 0.120.
    assert "0.120 noise of 256 prompts below the best of 10" in hacking_warning(best, hacked, 256, 10)
    assert hacking_warning(best, {**hacked, "eval/accuracy": 0.36}, 256, 1) is None, "within noise"
    assert hacking_warning(best, {**hacked, "eval/accuracy": 0.33}, 256, 10) is None, "within the best of 10's noise"
    assert hacking_warning(best, {**hacked, "eval/rm_score": 0.75}, 256, 1) is None, "the score's rise is noise"
    assert hacking_warning(best, {**hacked, "eval/rm_score": 0.50}, 256, 1) is None, "both fell"
    assert hacking_warning(best, {"eval/accuracy": 0.27}, 256, 1) is None, "no reward model: nothing to game"


@pytest.mark.parametrize("p,n", [(0.5, 64), (0.8, 64), (0.3, 128)])
@pytest.mark.parametrize("score", ["noise", "rising"])
def test_hacking_warning_on_pure_noise_fires_at_most_at_its_stated_rate(p, n, score):
    """Evaluations of a policy whose accuracy does not change (Binomial(n, p) / n), judged as the run
    judges them: the best so far is the most accurate, and each later evaluation is tested against it.
    The reward model's mean score is noise (normal with its standard error), or rises by a sure 1 each
    time, which leaves the accuracy's test alone to decide. Either way the warning fires at no more
    than FALSE_ALARM of the tests (two standard errors' one-sided tail, 2.3%)."""
    import numpy as np

    from rlhf.runners.ppo_judge import FALSE_ALARM, hacking_warning

    rng, fires, tests = np.random.default_rng(0), 0, 0
    # 10,000 runs of 8 evaluations: 70,000 tests, the rate's standard error about 0.05%.
    accuracy = rng.binomial(n, p, size=(10_000, 8)) / n
    rm = rng.normal(0.0, 1.0 / math.sqrt(n), size=accuracy.shape) if score == "noise" else np.arange(8.0) + 0 * accuracy
    for run_acc, run_rm in zip(accuracy.tolist(), rm.tolist(), strict=True):
        best, seen = None, 0
        for acc, rm_score in zip(run_acc, run_rm, strict=True):
            now = {"eval/accuracy": acc, "eval/rm_score": rm_score, "eval/rm_score_std": 1.0 if score == "noise" else 0.0}
            if best is not None:
                tests += 1
                fires += hacking_warning(best, now, n, seen) is not None
            seen += 1
            if best is None or now["eval/accuracy"] > best["eval/accuracy"]:
                best = now
    assert FALSE_ALARM == pytest.approx(0.02275, abs=1e-5)
    assert fires / tests <= FALSE_ALARM, f"{fires} of {tests}"
    if score == "rising":  # the accuracy's test alone is used up to near its level, not switched off
        assert fires / tests > FALSE_ALARM / 2, f"{fires} of {tests}"


def test_without_a_rule_the_run_says_it_cannot_tell_learning_from_hacking():
    from rlhf.runners.ppo_judge import unjudged_note

    note = unjudged_note({"eval/rm_score": 0.1}, {"eval/rm_score": 1.7}, 3.5)
    assert "0.100 -> 1.700 at a KL of 3.500" in note and "cannot tell learning from reward hacking" in note
    assert unjudged_note({"eval/rm_score": 0.1, "eval/accuracy": 0.3},
                         {"eval/rm_score": 1.7, "eval/accuracy": 0.5}, 3.5) is None


def test_a_ppo_run_that_ends_still_improving_says_to_train_longer():
    from rlhf.runners.ppo_judge import still_rising

    # 128 prompts at p=0.30: the noise of a difference is 2*sqrt(2*0.30*0.70/128) = 0.1146.
    rising = [(0, 0.20), (25, 0.22), (50, 0.30), (75, 0.33), (100, 0.38), (125, 0.42), (150, 0.45)]
    note = still_rising(rising, 128)
    assert "rose 0.300 -> 0.450 over its last 4 evaluations (steps 50 -> 150, more than the 0.115 noise" in note
    assert "pipeline.ppo.step.epochs=N" in note
    assert still_rising(rising[:4], 128) is None, "too few evaluations to tell"
    assert still_rising([*rising[:-1], (150, 0.40)], 128) is None, "its last evaluation was not its best"
    flat = [(0, 0.30), (25, 0.36), (50, 0.38), (75, 0.37), (100, 0.38), (125, 0.39)]
    assert still_rising(flat, 128) is None, "a rise within noise"


def test_the_plateau_rule_counts_evaluations_since_the_first_best():
    from rlhf.runners.ppo_judge import plateau

    history = [(0, 0.40), (25, 0.55), (50, 0.52), (75, 0.55), (100, 0.54)]
    # The best is step 25's (an equal later one does not beat it): three evaluations since.
    assert plateau(history, 3) == ("held-out accuracy did not beat its best (0.5500, step 25) for 3 evaluations "
                                   "(step.early_stop_patience)")
    assert plateau(history, 4) is None
    assert plateau(history, 0) is None, "0: never"
    assert plateau([*history, (125, 0.56)], 3) is None, "a new best starts the count again"
    assert plateau([], 1) is None
    assert plateau([(0, 0.40), (25, 1.0)], 8) == ("held-out accuracy reached 1.0 at step 25, which no later actor "
                                                  "can beat (step.early_stop_patience)")
    assert plateau([(0, 0.40), (25, 1.0)], 0) is None


def test_ppo_stops_on_its_plateau_with_the_last_actors_figures_and_says_why(tmp_path, sft_and_reward, monkeypatch):
    """A rule no answer satisfies holds held-out accuracy at 0, so no evaluation beats step 0's: with a
    patience of 2 the run stops at its second evaluation after the start (step 2 of 6), reports the last
    actor's figures on the report half, says why, and its output is the start (the best actor)."""
    sft, rm = sft_and_reward
    (tmp_path / "never_rule.py").write_text("def score(prompt, answer):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    final = run(compose([*PPO_FAST, "data.rule=never_rule:score", "step.max_steps=6", "step.eval_every_steps=1",
                         "step.early_stop_patience=2", f"actor.path={sft}", f"critic.path={rm}",
                         f"run_dir={run_dir}"]))
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "select/accuracy" in r] == [0, 1, 2]
    assert len([r for r in rows if "policy_loss" in r]) == 2
    assert final["step"] == 2 and final["best_step"] == 0
    assert final["stopped_by"] == ("held-out accuracy did not beat its best (0.0000, step 0) for 2 evaluations "
                                   "(step.early_stop_patience)")
    assert "eval/accuracy" in rows[-1] and final["eval/accuracy_last"] == 0.0, "the last actor is reported"
    assert (run_dir / "model_last" / "config.json").exists()

    # Where the plateau's evaluation is the last step's, the cap ended the run: no plateau is named.
    final = run(compose([*PPO_FAST, "data.rule=never_rule:score", "step.max_steps=2", "step.eval_every_steps=1",
                         "step.early_stop_patience=2", f"actor.path={sft}", f"critic.path={rm}",
                         f"run_dir={tmp_path / 'capped'}"]))
    assert final["step"] == 2 and final["stopped_by"] == "the cap step.max_steps=2", final.get("stopped_by")


def test_ppo_patience_needs_evaluations():
    with pytest.raises(ConfigError, match="step.early_stop_patience needs evaluations to compare"):
        to_schema(compose(["step=ppo", "step.early_stop_patience=2", "step.eval_every_steps=0"]))


def test_the_best_evaluated_actor_becomes_the_output_and_the_last_is_kept_beside_it(tmp_path, capsys):
    from rlhf.runners.ppo_judge import keep_best as _keep_best

    for folder, tag in (("model", "last"), ("best_model", "best")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "tag").write_text(tag)
    best = {"step": 150, "metrics": {"eval/accuracy": 0.61, "eval/rm_score": 1.40}}
    last = {"eval/accuracy": 0.33, "eval/rm_score": 1.78}
    final = {"step": 375, **last}
    warnings: list[str] = []
    _keep_best(tmp_path, best, 375, last, final, warnings)
    assert (tmp_path / "model" / "tag").read_text() == "best"
    assert (tmp_path / "model_last" / "tag").read_text() == "last"
    assert not (tmp_path / "best_model").exists()
    assert final == {"step": 375, "eval/accuracy": 0.61, "eval/rm_score": 1.40, "eval/accuracy_last": 0.33,
                     "eval/rm_score_last": 1.78, "best_step": 150}
    assert "model/ is the actor of step 150 (held-out accuracy 0.610" in capsys.readouterr().out
    # Never better than the start: the output is a copy of the start (the SFT folder), the last actor
    # is beside it, and the run says so; a start that is no local folder (a hub id) leaves the last.
    start = tmp_path / "sft"
    start.mkdir()
    (start / "config.json").write_text("{}")
    (start / "tag").write_text("start")
    (tmp_path / "model_last").rename(tmp_path / "model_old")
    final = {}
    _keep_best(tmp_path, {"step": 0, "metrics": {"eval/accuracy": 0.4}}, 375, last, final, warnings, str(start))
    assert (tmp_path / "model" / "tag").read_text() == "start" and (tmp_path / "model_last" / "tag").read_text() == "best"
    assert "never beat its start" in warnings[0] and "a copy of the start" in warnings[0]
    assert final["eval/accuracy"] == 0.4 and final["best_step"] == 0
    shutil.rmtree(tmp_path / "model_last")
    _keep_best(tmp_path, {"step": 0, "metrics": {"eval/accuracy": 0.4}}, 375, last, {}, warnings, "org/hub-id")
    assert (tmp_path / "model" / "tag").read_text() == "start" and "the output is the last actor" in warnings[-1]


def test_a_nonfinite_entropy_bonus_stops_ppo_with_a_marked_checkpoint(tmp_path, monkeypatch):
    """The stop reads every term that reaches backward: an entropy bonus made NaN stops the run at its
    first PPO step, the state saved and marked. One update per step, so the policy loss (of the
    weights before it) stays finite and only the bonus is not."""
    from rlhf import losses

    real = losses.token_logprobs_and_entropy

    def nan_entropy(*args, **kwargs):
        logp, entropy = real(*args, **kwargs)
        return logp, entropy * float("nan")

    monkeypatch.setattr(losses, "token_logprobs_and_entropy", nan_entropy)
    with pytest.raises(FloatingPointError, match=r"PPO loss is nan at PPO step 1"):
        run(compose([*PPO_FAST, "actor.random_init=true", "step.reward_fn=rule", "step.reward_model_weight=0",
                     "step.eval_prompts=0", "step.advantage_estimator=reinforce_pp", "step.entropy_coef=0.01", "step.max_steps=1",
                     "step.micro_batch_size_per_device=16", f"run_dir={tmp_path}"]))
    assert (tmp_path / "checkpoints" / "nonfinite_step_00000001").is_dir()


def test_old_logprobs_are_recomputed_in_16_bit_and_the_run_says_which_it_used(tmp_path):
    def old(*o):
        return to_schema(compose(["step=ppo", *o])).step.old_logprobs

    # 16 bits: the decode's cached forwards round apart from the full forwards of the new and reference.
    assert old("hardware.precision=bf16") == "recompute"
    assert old() == "rollout"  # fp32: the two kinds of forward agree to rounding
    assert old("hardware.precision=bf16", "step.old_logprobs=rollout") == "rollout"  # the user's choice wins
    final = run(compose([*PPO_FAST, "actor.random_init=true", "step.reward_fn=rule", "step.reward_model_weight=0",
                         "step.eval_prompts=0", "step.advantage_estimator=reinforce_pp", "step.max_steps=1", "step.save_model=false",
                         f"run_dir={tmp_path}"]))
    assert final["old_logprobs"] == "rollout"


class _ReadBacks(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls made from ``path`` that read a value back to the host (each waits for
    the device to finish everything queued before it)."""

    NAMES = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero"}

    def __init__(self, path: str):
        super().__init__()
        self.path, self.count = path, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        if getattr(func, "__name__", "") in self.NAMES and sys._getframe(1).f_code.co_filename == self.path:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_ppo_update_reads_back_to_the_host_once_per_pass_and_once_at_the_end():
    """Two passes of four micro-batches through real engines (actor and critic): the update reads its
    figures back once, when it ends, and each pass's token counts (summed over ranks) once, not a
    figure per micro-batch; the figures are finite and the same as before the change of where they
    add up (losses logged per optimizer step)."""
    import dataclasses

    from rlhf import engine as engine_factory
    from rlhf import losses, models
    from rlhf.generation.rollout import Experience, Scores, answer_logits, position_ids
    from rlhf.generation.sampling import Sampling
    from rlhf.runners import ppo_update as update_module
    from rlhf.worker import init_distributed
    from tests.loss_agg_worker import ANSWER, EOS, PROMPT, ROWS, batch

    cfg = to_schema(compose(["step=ppo", "model=tiny-llama", "hardware.precision=fp32", "step.ppo_epochs=2",
                             "step.micro_batch_size_per_device=2", f"step.rollout_batch_size_per_device={ROWS}",
                             f"step.max_new_tokens={ANSWER}", "step.reward_fn=rule", "step.reward_model_weight=0"]))
    init_distributed(cfg)
    path = models.resolve_path(cfg.model)
    tokenizer = models.load_tokenizer(path)
    actor, _ = engine_factory.build_train_engine(models.load_causal_lm(path, tokenizer), cfg, 8)
    critic, _ = engine_factory.build_train_engine(models.load_reward_model(path, tokenizer), cfg, 8,
                                                  lr=cfg.step.critic_lr, use_lora=False)
    seq, attn, response, mask, g = batch(actor.module.config.vocab_size)
    pos, start = position_ids(attn), PROMPT - 1
    with torch.no_grad():
        old = losses.token_logprobs(answer_logits(actor.module, seq, attn, pos, start), response, 0.7)
    values = torch.randn(ROWS, ANSWER, generator=g)
    step_cfg = dataclasses.replace(cfg.step, temperature=0.7, global_batch_size=None)
    exp = Experience(seq=seq, attn=attn, pos=pos, response=response, mask=mask, loss_mask=mask,
                     truncated=~(response == EOS).any(-1), eos_id=EOS, start=start, sampling=Sampling.of(step_cfg),
                     old_logprobs=old, ref_logprobs=old, old_values=values, advantages=torch.randn(ROWS, ANSWER,
                                                                                                generator=g),
                     returns=values + 0.1, kl=torch.zeros(ROWS), kl_k1=torch.zeros(ROWS), prompts=[""] * ROWS,
                     answers=[""] * ROWS, scores=Scores(total=torch.zeros(ROWS)), generate_s=0.0)
    with _ReadBacks(update_module.__file__) as reads:
        out = update_module.ppo_update(actor, critic, exp, step_cfg, 0.1, torch.Generator().manual_seed(0), None)
    assert reads.count == step_cfg.ppo_epochs + 1, reads.count
    assert all(math.isfinite(v) for v in out.values()) and out["value_loss"] > 0 and out["entropy"] > 0
    # The first micro-batch's log-probs are the old ones before any update: the same forward.
    assert out["rollout/logprob_diff"] < 1e-5


@pytest.mark.slow  # make test profiles an SFT step (tests/test_sft.py); the loop hook here is one line
def test_profile_step_profiles_one_ppo_step_from_rollouts_to_updates(tmp_path, sft_and_reward):
    """logging.profile_step=2 profiles PPO step 2: its rollouts' attention and cache writes and its
    updates' optimizer are all in the one summary, and the run's steps are all logged as usual."""
    sft, rm = sft_and_reward
    run(compose([*PPO_FAST, "logging.profile_step=2", f"actor.path={sft}", f"critic.path={rm}",
                 f"run_dir={tmp_path}"]))
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["step"] == 2 and 0 < summary["busy_ms"] <= summary["wall_ms"]
    for kind in ("matmul", "attention", "cache_write", "optimizer"):
        assert summary["by_kind_ms"].get(kind, 0) > 0, (kind, summary["by_kind_ms"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "policy_loss" in r] == [1, 2, 3]


def test_phase_flops_by_hand():
    """A policy of 1,000 layer parameters and a 100-parameter head, a value model of 500; 2 rows of 10
    positions, 4 of them answer: generation runs 9 positions through the layers (the last token is
    never fed back) and the head at the 4 answer tokens; a scoring pass runs all 10 positions, the
    head on the 4; the value models have no vocabulary head; an update pass is 3 forwards."""
    from types import SimpleNamespace as NS

    from rlhf.runners.ppo import phase_flops

    sizes = (NS(layer_params=1000, head_params=100), NS(layer_params=500, head_params=100))
    both = phase_flops(sizes, 2, 10, 4, NS(old_logprobs="rollout", ppo_epochs=2), True, True)
    assert both == {"generate": 2 * 2 * (1000 * 9 + 100 * 4),  # 37,600
                    "scoring": 2 * 2 * (1000 * 10 + 100 * 4) + 2 * (2 * 2 * 500 * 10),  # reference + critic + reward
                    "update": 3 * 2 * (41_600 + 20_000)}  # 2 PPO epochs of actor and critic
    alone = phase_flops(sizes, 2, 10, 4, NS(old_logprobs="recompute", ppo_epochs=1), False, False)
    assert alone == {"generate": 37_600, "scoring": 2 * 41_600, "update": 3 * 41_600}


def test_held_out_answers_cut_by_the_budget_are_a_warning_in_the_final_figures(sft_and_reward, tmp_path):
    """The shipped task's answers are longer than 2 tokens (cut answers masked, as the pre-flight asks):
    every greedy answer reaches the budget, and the warning that says so is in final_metrics.json's
    warnings (the chain's summary lists those), not only on the console."""
    sft, _ = sft_and_reward
    final = run(compose([*PPO_FAST, "step.max_steps=1", "step.max_new_tokens=2", "step.truncated_answers=mask", "step.reward_fn=rule",
                         "step.reward_model_weight=0", "step.advantage_estimator=grpo", "step.samples_per_prompt=2",
                         f"actor.path={sft}", f"run_dir={tmp_path}"]))
    cut = [w for w in final["warnings"] if "reached the budget step.max_new_tokens (2 tokens)" in w]
    assert cut and cut[0].endswith("raise step.max_new_tokens=4"), final["warnings"]
    saved = json.loads((tmp_path / "final_metrics.json").read_text())
    assert cut[0] in saved["warnings"]
