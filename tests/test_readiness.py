"""A chain's refusals in the order of their causes: an SFT policy too weak for PPO is refused right
after SFT (before a reward model trains), with the fix that changes what ended SFT; a reward model
nothing would use is not trained.

    python -m pytest -q tests/test_readiness.py
"""

from __future__ import annotations

import json

import pytest
from conftest import compose
from omegaconf import OmegaConf

from rlhf.chain.pipeline import skip_unused
from rlhf.chain.readiness import printed_fixes, weak_step
from rlhf.launch import run

PIPE = OmegaConf.create({"reward_min_accuracy": 0.95, "min_policy_accuracy": 0.02, "sft_loss_still_falling": 0,
                         "sft_beyond_constant": False})
STEP = OmegaConf.create({"step": {"reward_model_weight": 1.0}, "data": {"rule": None}})


def _sft(chain, stopped_by: str, accuracy: float = 0.004, **config) -> None:
    (chain / "sft").mkdir(parents=True, exist_ok=True)
    (chain / "sft" / "final_metrics.json").write_text(json.dumps({"eval/accuracy": accuracy, "stopped_by": stopped_by}))
    (chain / "sft" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))


@pytest.mark.parametrize(("stopped_by", "config", "fix"), [
    ("eval/loss did not beat its best (2.0163, step 200) for 10 evaluations (step.early_stop_patience)",
     {"optim": {"lr": 3e-3}, "step": {"epochs": 8, "max_steps": -1}},
     "pipeline.sft.optim.lr=0.001 pipeline.sft.step.early_stop_patience=0"),
    ("the cap step.epochs=8", {"optim": {"lr": 1e-3}, "step": {"epochs": 8, "max_steps": -1}},
     "pipeline.sft.step.epochs=16"),
    ("the cap step.max_steps=300", {"optim": {"lr": 1e-3}, "step": {"epochs": 8, "max_steps": 300}},
     "pipeline.sft.step.max_steps=600"),
])
def test_a_policy_too_weak_for_ppo_is_refused_right_after_sft_with_the_fix_for_what_stopped_it(
        tmp_path, stopped_by, config, fix):
    _sft(tmp_path, stopped_by, **config)
    steps = ["sft", "reward", "ppo"]
    for name in ("reward", "ppo"):  # before the reward model trains, and again before PPO
        why = weak_step(PIPE, name, STEP, tmp_path, steps)
        assert why.startswith("the SFT policy's held-out accuracy by the rule is 0.4%, below "
                              "pipeline.min_policy_accuracy=0.02") and fix in why, why
    # Without PPO downstream (SFT -> DPO), SFT's accuracy dooms nothing.
    assert weak_step(PIPE, "dpo", STEP, tmp_path, ["sft", "dpo"]) is None
    _sft(tmp_path, stopped_by, accuracy=0.05, **config)
    assert weak_step(PIPE, "reward", STEP, tmp_path, steps) is None


def test_an_sft_whose_held_out_answers_hit_the_budget_is_blamed_on_the_budget_not_on_its_training(tmp_path):
    _sft(tmp_path, "the cap step.epochs=8", step={"epochs": 8, "max_steps": -1, "max_new_tokens": 8})
    final = json.loads((tmp_path / "sft" / "final_metrics.json").read_text())
    (tmp_path / "sft" / "final_metrics.json").write_text(json.dumps({**final, "eval/truncated_frac": 1.0,
                                                                    "eval/truncated_frac_before": 1.0}))
    why = weak_step(PIPE, "reward", STEP, tmp_path, ["sft", "reward", "ppo"])
    assert "100% of the held-out greedy answers reached the budget pipeline.sft.step.max_new_tokens (8 tokens) without ending" in why
    assert why.endswith("raise pipeline.sft.step.max_new_tokens=16") and "epochs=16" not in why, why
    # The fix a user copies is the raise: the budget's present value is not printed as an override.
    assert printed_fixes(why)[0] == ["pipeline.sft.step.max_new_tokens=16"], printed_fixes(why)
    # SFT stopped on its loss plateau did not learn the answers: a larger budget only lengthens what it
    # gets wrong, and the fix is the lower rate its stop names.
    _sft(tmp_path, "eval/loss did not beat its best (4.48, step 20) for 2 evaluations (step.early_stop_patience)",
         optim={"lr": 0.3}, step={"epochs": 8, "max_steps": 150, "max_new_tokens": 8})
    final = json.loads((tmp_path / "sft" / "final_metrics.json").read_text())
    (tmp_path / "sft" / "final_metrics.json").write_text(json.dumps({**final, "eval/truncated_frac": 1.0}))
    why = weak_step(PIPE, "reward", STEP, tmp_path, ["sft", "reward", "ppo"])
    assert printed_fixes(why)[0] == ["pipeline.sft.optim.lr=0.1", "pipeline.sft.step.early_stop_patience=0"] \
        and "max_new_tokens" not in why, why


def test_a_chain_whose_ppo_is_rewarded_by_the_rule_alone_trains_no_reward_model(tmp_path):
    overrides = ["pipeline=e2e", "logging.progress_bar=false", "data.max_eval_samples=64", f"run_dir={tmp_path}",
                 "pipeline.sft.step.max_steps=5", "pipeline.ppo.step.max_steps=1",
                 "pipeline.ppo.step.advantage_estimator=grpo", "pipeline.ppo.step.samples_per_prompt=4",
                 "pipeline.ppo.step.reward_fn=rule", "pipeline.ppo.step.reward_model_weight=0",
                 "pipeline.ppo.step.rollout_batch_size_per_device=16", "pipeline.ppo.step.micro_batch_size_per_device=8",
                 "pipeline.ppo.step.eval_prompts=8", "pipeline.on_weak_step=warn"]
    result = run(compose(overrides), overrides=overrides)
    assert set(result["outputs"]) == {"sft", "ppo"} and not (tmp_path / "reward").exists()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["skipped"]["reward"].startswith("PPO's reward is the rule alone")
    # With a critic (gae) the reward model's weights start the critic: it is trained.
    with_critic = [o for o in overrides if "advantage_estimator" not in o and "samples_per_prompt" not in o]
    cfg = compose(with_critic)
    outputs = {name: str(tmp_path / "gae" / name / "model") for name in ("sft", "reward", "ppo")}
    assert skip_unused(cfg, ["sft", "reward", "ppo"], with_critic, outputs, tmp_path / "gae") == (
        ["sft", "reward", "ppo"], {})
