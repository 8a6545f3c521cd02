"""Every shipped setting trains: each file in conf/experiment runs each of its steps for 2 optimizer
steps on CPU, with each role's model swapped for a tiny random one of the same family and every
other key the experiment sets kept (gradient checkpointing, LoRA, offload flags, ZeRO stage,
accumulation, sampling, lengths), on 2 CPU ranks where the preset has more than one device.
Data on a hub (DeepSpeed-Chat's datasets, UltraFeedback) cannot be reached here: such an experiment
runs on the shipped synthetic data instead, every other data key kept.
A new experiment file is covered without editing this test.

    python -m pytest tests/test_presets.py
"""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from rlhf.config import looks_local
from tests.conftest import ROOT, compose, compose_step, free_port, run_cli

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TINY = {"opt": "tiny-opt", "llama": "tiny-llama", "qwen2": "tiny-qwen2"}
# What the test changes besides models and hardware: length of the run and of its evaluations.
# Two steps make weak models: the chain runs each step anyway (and says so) instead of refusing it.
SHORT = ["step.max_steps=2", "data.max_eval_samples=16", "logging.progress_bar=false",
         "pipeline.ppo.step.eval_prompts=2", "pipeline.on_weak_step=warn"]
# policy_path is wired by the chain to its SFT output, as actor.path is (compose_step knows no outputs).
CHANGED = {"max_steps", "eval_prompts", "policy_path"}


def tiny_overrides(name: str) -> list[str]:
    cfg = compose([f"experiment={name}"])
    tiny = TINY[cfg.model.family]
    world = cfg.hardware.nodes * cfg.hardware.devices_per_node
    hub_data = not all(looks_local(s.path) for s in cfg.data.sources)
    # At least 2048 positions: the presets' sequences (up to 1024 + 1024 in PPO) must fit the tiny model.
    # A preset whose policy step starts from the (now random) model group, with no SFT before it, says so.
    policy_first = cfg.pipeline.steps and cfg.pipeline.steps[0] != "sft"
    # A long-context preset's positions too; its rows split over the 2 ranks where it splits them.
    positions = max([2048] + [compose_step([f"experiment={name}"], s).step.max_seq_len for s in cfg.pipeline.steps])
    split = [f"parallel.sequence={min(cfg.parallel.sequence, 2)}"] if cfg.parallel.sequence > 1 else []
    return [f"model={tiny}", f"model.max_positions={positions}", f"critic.model={tiny}", *split,
            *([f"pipeline.{cfg.pipeline.steps[0]}.actor.random_init=true"] if policy_first else []),
            f"hardware={'cpu-2rank' if world > 1 else 'cpu'}", f"launch.master_port={free_port()}",
            *(["data.sources=[{path: ${project_root:}/data/synthetic/sort}]"] if hub_data else [])]


# make test runs the one-GPU preset's chain; make test-all every preset's (50-65 s each on 2 cores).
@pytest.mark.parametrize("name", [n if n == "opt-1.3b_a6000" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in EXPERIMENTS])
def test_experiment_trains_every_step_at_tiny_scale(name, tmp_path):
    swap = tiny_overrides(name)
    proc = run_cli(f"experiment={name}", *swap, *SHORT, f"run_dir={tmp_path}", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    chain = compose([f"experiment={name}"])
    for step in chain.pipeline.steps:
        step_dir = tmp_path / step
        ran = OmegaConf.load(step_dir / "config.yaml")
        # Every key the experiment sets for this step is what really ran, but the model, the
        # hardware and the length of the run.
        expected = compose_step([f"experiment={name}"], step)
        for section in ("step", "lora", "zero", "optim"):
            want = {k: v for k, v in OmegaConf.to_container(expected[section]).items() if k not in CHANGED}
            got = {k: v for k, v in OmegaConf.to_container(ran[section]).items() if k not in CHANGED}
            assert got == want, f"{name} {step}: {section} differs"
        # The swapped-in random model, or (reward_from_sft) the output of the chain's step before.
        assert ran.model.family == expected.model.family
        assert ran.model.random_init or ran.model.path.startswith(str(tmp_path)), ran.model.path
        world = ran.hardware.devices_per_node
        assert world == (2 if chain.hardware.nodes * chain.hardware.devices_per_node > 1 else 1)
        ds = json.loads((step_dir / "ds_config.json").read_text())
        train_ds = ds[{"sft": "model", "reward": "reward", "ppo": "actor"}[step]]
        assert train_ds["train_batch_size"] == (ran.step.micro_batch_size_per_device
                                                * ran.step.gradient_accumulation_steps * world)

        rows = [json.loads(line) for line in open(step_dir / "metrics.jsonl")]
        final = json.loads((step_dir / "final_metrics.json").read_text())
        assert (step_dir / "model" / "config.json").exists()
        if step == "ppo":
            steps = [r for r in rows if "policy_loss" in r]
            assert len(steps) == 2
            # A critic-free estimator (the GRPO presets) trains no value head: no value loss to log.
            assert all(math.isfinite(r["policy_loss"]) and math.isfinite(r.get("value_loss", 0.0)) for r in steps)
            assert all("value_loss" in r for r in steps) == (ran.step.advantage_estimator == "gae")
            assert final["actor_weight_change"] > 0 and final["reference_weight_change"] == 0.0
        else:
            losses = [r["loss"] for r in rows if "loss" in r]
            assert losses and all(math.isfinite(v) for v in losses), f"{name} {step}: {rows[:3]}"
            assert final["step"] == 2
