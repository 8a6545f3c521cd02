"""DPO and SimPO through real DeepSpeed engines: they learn the preferences, save a plain causal LM,
resume exactly, and chain after SFT; DPO computes the same thing with the reference precomputed or
online and runs under ZeRO-3 with the reference offloaded."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlhf import losses
from rlhf.config import ConfigError, to_schema
from rlhf.launch import run
from tests.conftest import check_margin, compose, same_run, trajectory_overrides
from tests.test_resume import _kill_after, _straight

# 1280 pairs: the precomputed reference scores every pair once, whatever max_steps uses.
QUIET = ["logging.progress_bar=false", "data.max_eval_samples=64", "data.max_train_samples=1280"]
DPO_FAST = ["step=dpo", "step.max_steps=40", "step.eval_every_steps=0", "step.eval_accuracy_prompts=32",
            "optim.lr=1e-3", "step.log_every_steps=5", *QUIET]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    base = tmp_path_factory.mktemp("dpo-sft")
    run(compose(["step=sft", "step.max_steps=30", *QUIET, *trajectory_overrides(), f"run_dir={base}"]))
    return base / "model"


@pytest.mark.trajectory
def test_dpo_learns_the_preferences_and_saves_a_causal_lm(tmp_path, record_property, sft_model):
    final = run(compose([*DPO_FAST, f"actor.path={sft_model}", *trajectory_overrides(), f"run_dir={tmp_path}"]))
    # Policy and reference start equal: every implicit reward 0, loss log 2, nothing preferred yet.
    assert final["eval/loss_before"] == pytest.approx(0.693147, abs=1e-4)
    assert final["eval/margin_before"] == pytest.approx(0.0, abs=1e-5)
    assert final["eval/pref_acc_before"] == 0.5  # all ties at the start
    check_margin(record_property, "eval/pref_acc", final["eval/pref_acc"], 0.65)
    check_margin(record_property, "eval/loss", final["eval/loss"], 0.65, higher=False, strict=True)  # log 2 at the start
    check_margin(record_property, "eval/margin", final["eval/margin"], 0.05, strict=True)
    assert "eval/accuracy" in final and "eval/accuracy_before" in final  # the rule's greedy check ran
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"pref_acc"' in line]
    check_margin(record_property, "loss last/first", rows[-1]["loss"] / rows[0]["loss"], 1.0, higher=False, strict=True)
    # A plain causal LM, changed from its start; the reference never trained (no engine for it kept).
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    before, after = load_file(sft_model / "model.safetensors"), load_file(tmp_path / "model" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert set(json.loads((tmp_path / "ds_config.json").read_text())) == {"actor", "reference"}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("max_steps", [5, 17])  # within the first epoch; into the third
def test_the_precomputed_reference_covers_exactly_the_rows_the_training_loop_reads(world, max_steps):
    from datasets import Dataset

    from rlhf.runners import common
    from rlhf.runners.preference import visited_rows

    ds = Dataset.from_dict({"i": list(range(103))})
    cfg = to_schema(compose(["step=dpo", "step.micro_batch_size_per_device=4", "step.gradient_accumulation_steps=2",
                             "step.epochs=3", f"step.max_steps={max_steps}", "seed=5"]))
    read = set()
    for rank in range(world):  # each rank's loader, epoch by epoch as the loop sets it, for the run's steps
        loader, sampler = common.train_loader(ds, cfg, rank, world, lambda rows: [r["i"] for r in rows])
        steps = common.plan_steps(cfg, len(loader), len(ds))
        micro = steps * cfg.step.gradient_accumulation_steps
        for epoch in range(cfg.step.epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                if micro == 0:
                    break
                read.update(batch)
                micro -= 1
    assert steps == max_steps and visited_rows(ds, cfg, world, steps) == sorted(read)
    if max_steps == 5:  # a capped run reads 5 steps of 8 rows per rank, not the set
        assert len(read) == 5 * 8 * world


def test_precomputed_and_online_reference_give_the_same_run(tmp_path, sft_model):
    args = [*DPO_FAST, "step.max_steps=5", "step.log_every_steps=1", "step.eval_accuracy_prompts=0",
            "data.max_train_samples=320", f"actor.path={sft_model}"]
    pre = run(compose([*args, f"run_dir={tmp_path / 'pre'}"]))
    online = run(compose([*args, "step.reference_logprobs=online", f"run_dir={tmp_path / 'online'}"]))
    assert online["eval/loss"] == pytest.approx(pre["eval/loss"], abs=1e-4)
    losses = [[json.loads(x)["loss"] for x in open(tmp_path / d / "metrics.jsonl") if '"pref_acc"' in x]
              for d in ("pre", "online")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)


@pytest.mark.parametrize("loss,extra", [("ipo", []), ("robust", ["step.label_smoothing=0.1"])])
@pytest.mark.trajectory
def test_ipo_and_robust_dpo_learn_under_zero3_with_the_reference_offloaded(tmp_path, record_property, sft_model, loss,
                                                                           extra):
    final = run(compose([*DPO_FAST, "zero=3", "step.reference_logprobs=online", "step.offload_reference=true",
                         f"step.loss={loss}", *extra, f"actor.path={sft_model}", *trajectory_overrides(),
                         f"run_dir={tmp_path}"]))
    check_margin(record_property, "eval/pref_acc gain", final["eval/pref_acc"] - final["eval/pref_acc_before"], 0.1,
                 strict=True)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["reference"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert final["stopped_by"].startswith("the cap step."), "every step's final figures say what ended it"


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_the_margin_is_zero_at_the_first_step_of_a_model_with_dropout(tmp_path, sft_model, disable_dropout):
    """model.dropout=0.1: the policy trains without it by default, so its first batch's implicit
    rewards equal the reference's (margin 0); with step.disable_dropout=false they do not."""
    run(compose([*DPO_FAST, "step.max_steps=1", "step.log_every_steps=1", "step.eval_accuracy_prompts=0",
                 "data.max_train_samples=320", "model.dropout=0.1", f"step.disable_dropout={disable_dropout}",
                 f"actor.path={sft_model}", f"run_dir={tmp_path}"]))
    first = next(json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"pref_acc"' in x)
    if disable_dropout:
        # Zero up to float rounding (the reference scored the pairs in other batches and paddings).
        assert max(abs(first[k]) for k in ("chosen_reward", "rejected_reward", "margin")) < 1e-5, first
    else:
        assert abs(first["chosen_reward"]) > 1e-3 and abs(first["rejected_reward"]) > 1e-3, first




def test_dpo_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="step.loss='hinge'.*sigmoid, ipo, robust"):
        to_schema(compose(["step=dpo", "step.loss=hinge"]))
    with pytest.raises(ConfigError, match="step.label_smoothing=0.5"):
        to_schema(compose(["step=dpo", "step.label_smoothing=0.5"]))
    with pytest.raises(ConfigError, match="step.loss=robust needs step.label_smoothing"):
        to_schema(compose(["step=dpo", "step.loss=robust"]))
    with pytest.raises(ConfigError, match="step.reference_logprobs='sometimes'"):
        to_schema(compose(["step=dpo", "step.reference_logprobs=sometimes"]))


@pytest.mark.trajectory
def test_sft_then_dpo_chain(tmp_path, record_property):
    overrides = ["pipeline=dpo", *QUIET, *trajectory_overrides(), f"run_dir={tmp_path}", "pipeline.sft.step.max_steps=10",
                 "pipeline.dpo.step.max_steps=10", "pipeline.dpo.step.eval_accuracy_prompts=16"]
    result = run(compose(overrides), overrides=overrides)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert list(manifest["steps"]) == ["sft", "dpo"]
    assert f"actor.path={tmp_path / 'sft' / 'model'}" in manifest["steps"]["dpo"]["overrides"]
    check_margin(record_property, "dpo/eval/pref_acc gain", result["dpo/eval/pref_acc"] -
                 result["dpo/eval/pref_acc_before"], 0.0, strict=True)
    assert (tmp_path / "dpo" / "model" / "config.json").exists()


# --------------------------------------------------------------------------------------- SimPO
@pytest.mark.trajectory
def test_simpo_learns_the_preferences_without_a_reference(tmp_path, record_property, sft_model):
    """SimPO builds one model (no reference, no reward model), widens the length-normalized margin
    toward gamma, and saves a plain causal LM that changed from its start."""
    final = run(compose(["step=simpo", "step.max_steps=40", "step.eval_every_steps=0", "step.eval_accuracy_prompts=32",
                         "optim.lr=1e-3", "step.log_every_steps=5", *QUIET, f"actor.path={sft_model}",
                         *trajectory_overrides(), f"run_dir={tmp_path}"]))
    check_margin(record_property, "eval/margin gain", final["eval/margin"] - final["eval/margin_before"], 0.2,
                 strict=True)
    check_margin(record_property, "eval/loss after-before", final["eval/loss"] - final["eval/loss_before"], 0.0,
                 higher=False, strict=True)
    # What SimPO trains is the margin; the pairwise accuracy over 64 pairs (steps of 1/64) may not fall
    # by more than its noise.
    check_margin(record_property, "eval/pref_acc gain", final["eval/pref_acc"] - final["eval/pref_acc_before"], -0.1)
    assert "eval/accuracy" in final
    assert set(json.loads((tmp_path / "ds_config.json").read_text())) == {"actor"}
    before, after = load_file(sft_model / "model.safetensors"), load_file(tmp_path / "model" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_sft_then_simpo_chain(tmp_path):
    overrides = ["pipeline=simpo", *QUIET, f"run_dir={tmp_path}", "pipeline.sft.step.max_steps=10",
                 "pipeline.simpo.step.max_steps=5", "pipeline.simpo.step.eval_accuracy_prompts=16"]
    run(compose(overrides), overrides=overrides)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert list(manifest["steps"]) == ["sft", "simpo"]
    assert f"actor.path={tmp_path / 'sft' / 'model'}" in manifest["steps"]["simpo"]["overrides"]
    assert (tmp_path / "simpo" / "model" / "config.json").exists()


# --------------------------------------------------------------------------------------- ORPO
@pytest.mark.trajectory
def test_orpo_learns_the_preferences_without_a_reference(tmp_path, record_property, sft_model):
    """ORPO builds one model, lowers its loss (NLL of the chosen answers + the odds-ratio term), widens
    the margin between the chosen and rejected answers' length-normalised log-probs, and saves a plain
    causal LM that changed from its start."""
    final = run(compose(["step=orpo", "step.max_steps=40", "step.eval_every_steps=0", "step.eval_accuracy_prompts=32",
                         "optim.lr=1e-3", "step.log_every_steps=5", *QUIET, f"actor.path={sft_model}",
                         *trajectory_overrides(), f"run_dir={tmp_path}"]))
    check_margin(record_property, "eval/loss after-before", final["eval/loss"] - final["eval/loss_before"], 0.0,
                 higher=False, strict=True)
    check_margin(record_property, "eval/margin gain", final["eval/margin"] - final["eval/margin_before"], 0.0,
                 strict=True)
    assert "eval/accuracy" in final
    assert set(json.loads((tmp_path / "ds_config.json").read_text())) == {"actor"}
    before, after = load_file(sft_model / "model.safetensors"), load_file(tmp_path / "model" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------------------------------- KTO
def test_kto_rows_are_the_pairs_split_into_unpaired_rows_with_a_mismatched_partner():
    from rlhf.runners.preference import unpaired_rows

    pairs = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(5)]
    desirable, undesirable = unpaired_rows(pairs, seed=1)
    assert sorted(r["chosen"] for r in desirable) == [f"good {i}" for i in range(5)]
    assert sorted(r["chosen"] for r in undesirable) == [f"bad {i}" for i in range(5)]
    for row in desirable + undesirable:  # the partner answers another prompt
        assert row["rejected"].split()[1] != row["prompt"][1:]


@pytest.mark.trajectory
def test_kto_learns_the_preferences_from_unpaired_rows(tmp_path, record_property, sft_model):
    """KTO trains on the pairs split into unpaired rows against the frozen reference: at the start every
    reward and the reference point are 0 (loss 0.5, every row a tie); then the desirable answers' rewards
    rise above the undesirable ones' and the loss falls; the output is a plain causal LM that changed."""
    final = run(compose(["step=kto", "step.max_steps=40", "step.eval_every_steps=0", "step.eval_accuracy_prompts=32",
                         "optim.lr=1e-3", "step.log_every_steps=5", *QUIET, f"actor.path={sft_model}",
                         *trajectory_overrides(), f"run_dir={tmp_path}"]))
    assert final["eval/loss_before"] == pytest.approx(0.5, abs=1e-4)
    assert final["eval/pref_acc_before"] == 0.5
    check_margin(record_property, "eval/loss after-before", final["eval/loss"] - final["eval/loss_before"], 0.0,
                 higher=False, strict=True)
    check_margin(record_property, "eval/margin", final["eval/margin"], 0.0, strict=True)
    assert "eval/accuracy" in final
    # The training window's reward means are over its rows of each kind, not over micro batches.
    logged = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"chosen_rows"' in x]
    assert logged and all(r["chosen_rows"] > 0 and r["rejected_rows"] > 0 for r in logged), logged
    assert set(json.loads((tmp_path / "ds_config.json").read_text())) == {"actor", "reference"}
    before, after = load_file(sft_model / "model.safetensors"), load_file(tmp_path / "model" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.trajectory
def test_kto_under_the_chains_stage_keeps_the_desirable_answers_likely(tmp_path, record_property, sft_model):
    """The chain's KTO (conf/stage/e2e/kto.yaml, beta 0.5) over one pass of 1280 pairs: the desirable
    answers' likelihood stays near the start's while they are told from the undesirable ones (at the
    paper's beta 0.1 and the same rate every answer's likelihood falls: docs/benchmarks.md)."""
    final = run(compose(["step=kto", "+stage=[e2e/kto]", "step.eval_accuracy_prompts=0", *QUIET,
                         f"actor.path={sft_model}", *trajectory_overrides(), f"run_dir={tmp_path}"]))
    check_margin(record_property, "eval/chosen_logp after/before",
                 final["eval/chosen_logp"] / final["eval/chosen_logp_before"], 2.0, higher=False, strict=True)
    check_margin(record_property, "eval/pref_acc", final["eval/pref_acc"], 0.6, strict=True)
    check_margin(record_property, "eval/margin", final["eval/margin"], 0.0, strict=True)


def test_the_training_windows_reward_means_are_over_its_rows_of_each_kind():
    """At one unpaired row per micro batch every micro batch lacks one kind of answer: a mean of the
    micro batches' means would halve each kind's reward. Sums 6 over 2 desirable rows and -3 over 3
    undesirable rows (window figures are per micro batch, over 5): means 3 and -1; none of a kind: nan."""
    from rlhf.runners.preference import window_rewards

    m = window_rewards({"chosen_reward": 6 / 5, "chosen_rows": 2 / 5, "rejected_reward": -3 / 5, "rejected_rows": 3 / 5})
    assert m == pytest.approx({"chosen_reward": 3.0, "rejected_reward": -1.0, "margin": 4.0})
    m = window_rewards({"chosen_reward": 1.0, "chosen_rows": 1.0, "rejected_reward": 0.0, "rejected_rows": 0.0})
    assert m["chosen_reward"] == 1.0 and math.isnan(m["rejected_reward"]) and math.isnan(m["margin"])


def test_kto_scores_the_partners_without_a_graph_and_its_gradient_is_unchanged():
    """KTO's partners (other prompts' answers) only set the detached reference point z0: scored in a
    forward of their own without a graph, the loss and every weight gradient are those of one forward
    over all sequences with a graph."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.runners.preference import pair_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4))
    ids = torch.randint(1, 50, (4, 7))
    mask = torch.ones_like(ids)
    mask[3, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "answer_mask": (torch.arange(7) >= 3).long().expand(4, 7) * mask}
    step = type("Step", (), {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0})
    ref = torch.tensor([-20.0, -21.0, -22.0, -19.0])  # the partners' log-ratios come out positive: z0 > 0
    grads = []
    for partner_grad in (True, False):
        model.zero_grad()
        logp = pair_logprobs(model, batch, partner_grad)
        r = losses.kto_step(losses.PreferenceBatch(logp, batch["answer_mask"].sum(-1), ref, torch.tensor([1.0, 0.0])),
                            step)
        r.loss.backward()
        grads.append((r.loss.item(), logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, logp_a, grad_a), (loss_b, logp_b, grad_b) = grads
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and torch.allclose(logp_a, logp_b, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grad_a, grad_b, strict=True))
    assert any(a.abs().sum() > 0 for a in grad_a)


# ------------------------------------------------------------------- every method added as a spec
# KTO makes two unpaired rows of each pair: half the pairs give the same number of rows.
# make test resumes SFT, PPO and SimPO after SIGKILL; the other preference methods in the slow tier.
@pytest.mark.parametrize("step,pairs", [("simpo", 320), pytest.param("dpo", 320, marks=pytest.mark.slow),
                                        pytest.param("orpo", 320, marks=pytest.mark.slow),
                                        pytest.param("kto", 160, marks=pytest.mark.slow)])
def test_a_preference_method_resumes_exactly_after_sigkill(tmp_path, sft_model, step, pairs):
    args = [f"step={step}", f"actor.path={sft_model}", "step.max_steps=16", f"data.max_train_samples={pairs}",
            "step.log_every_steps=1", "checkpoint.every_steps=4", "step.eval_every_steps=0",
            "step.eval_accuracy_prompts=0"]
    _straight(args, tmp_path / "a")
    _kill_after(args, tmp_path / "b", "loss", 6)
    _straight(args, tmp_path / "b")
    same_run(tmp_path / "a", tmp_path / "b", "loss")


@pytest.mark.parametrize("step", ["orpo", "kto"])
def test_sft_then_a_preference_method_chain(tmp_path, step):
    overrides = [f"pipeline={step}", *QUIET, f"run_dir={tmp_path}", "pipeline.sft.step.max_steps=10",
                 f"pipeline.{step}.step.max_steps=5", f"pipeline.{step}.step.eval_accuracy_prompts=16"]
    run(compose(overrides), overrides=overrides)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert list(manifest["steps"]) == ["sft", step]
    assert f"actor.path={tmp_path / 'sft' / 'model'}" in manifest["steps"][step]["overrides"]
    assert (tmp_path / step / "model" / "config.json").exists()


@pytest.mark.parametrize("step", ["dpo", "simpo", "ppo"])
def test_disable_dropout_reaches_the_lora_adapters(tmp_path, step):
    """lora.dropout=0.5 on a policy its step trains without dropout (DPO / SimPO's step.disable_dropout,
    PPO's update): every dropout layer of the engine the runner builds, PEFT's lora_dropout included,
    has p = 0; the same LoRA config with dropout kept (step.disable_dropout=false) keeps it."""
    from rlhf import models
    from rlhf.runners import common, ppo_setup
    from rlhf.worker import init_distributed

    def dropouts(engine) -> dict[str, float]:
        return {n: m.p for n, m in engine.module.named_modules() if isinstance(m, torch.nn.Dropout)}

    reward = ["step.reward_fn=synthetic", "step.reward_model_weight=0", "step.advantage_estimator=reinforce_pp"]
    cfg = to_schema(compose([f"step={step}", "model=tiny-llama", "lora.rank=4", "lora.dropout=0.5",
                             *(reward if step == "ppo" else []), f"run_dir={tmp_path}"]))
    init_distributed(cfg)
    path = models.resolve_path(cfg.model)
    tokenizer = models.load_tokenizer(path)
    if step == "ppo":
        engine = ppo_setup.build_roles(cfg, tokenizer, (path, "", ""), [], 1).actor
    else:
        engine = common.train_engine(cfg, models.load_causal_lm, path, tokenizer, 1, "actor", dropout=0.0)[0]
        kept = common.train_engine(cfg, models.load_causal_lm, path, tokenizer, 1, "actor")[0]
        assert any(p == 0.5 for n, p in dropouts(kept).items() if "lora_dropout" in n)
    found = dropouts(engine)
    assert any("lora_dropout" in n for n in found) and set(found.values()) == {0.0}, found
