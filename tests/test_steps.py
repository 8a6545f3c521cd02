"""The contract every step of rlhf.config.STEPS keeps, generated from the registry: a new entry gets
these tests without a test file of its own. Each step starts where its spec's chain_inputs say a
chain starts it (the outputs of the steps before it, trained here for two optimizer steps), then:
its dry-run passes; two optimizer steps change every trainable parameter of the model it outputs
(TRL's check); its final figures hold its objective and its summary's figures; killed mid-run
(slow), the same command ends with the weights and losses of a run never killed.

    pytest tests/test_steps.py
"""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf.config import STEPS, to_schema
from rlhf.launch import run
from tests.conftest import compose, same_run
from tests.test_resume import _kill_after, _straight

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=16"]
# Small batches where a step has the key: the contract is about what a step does, not how fast.
SMALL = {"rollout_batch_size_per_device": 8, "micro_batch_size_per_device": 4, "eval_prompts": 8,
         "eval_accuracy_prompts": 8, "policy_pairs_prompts": 0, "rule_check_answers": 0}


def _small(name: str) -> list[str]:
    keys = {f.name for f in dataclasses.fields(STEPS[name].schema)}
    return [f"step.{k}={v}" for k, v in SMALL.items() if k in keys]


def _start_key(name: str) -> str:
    """The key that says where the model the step outputs starts: the policy's actor.path, else model.path."""
    return "actor.path" if STEPS[name].policy.name == "actor" else "model.path"


class Outputs:
    """Each step's output, trained once for two optimizer steps from its own chain inputs."""

    def __init__(self, root: Path):
        self.root, self.made = root, {}

    def inputs(self, name: str) -> list[str]:
        """The overrides that start ``name`` as a chain does: each chain input from its source's output."""
        return [f"{key}={self.output(source)}" for key, source, _ in STEPS[name].chain_inputs]

    def args(self, name: str) -> list[str]:
        """The step from its chain inputs; one without them from its own output, a start folder to compare with."""
        start = [] if any(k == _start_key(name) for k, _, _ in STEPS[name].chain_inputs) \
            else [f"{_start_key(name)}={self.output(name)}"]
        return [f"step={name}", *_small(name), *self.inputs(name), *start]

    def output(self, name: str) -> str:
        if name not in self.made:
            run_dir = self.root / name
            args = [f"step={name}", "step.max_steps=2", *_small(name), *QUIET, *self.inputs(name), f"run_dir={run_dir}"]
            run(compose(args), overrides=args)
            self.made[name] = str(run_dir / "model")
        return self.made[name]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return Outputs(tmp_path_factory.mktemp("chain"))


@pytest.mark.parametrize("name", list(STEPS))
def test_every_step_s_dry_run_passes_from_its_chain_inputs(name, outputs, tmp_path, capsys):
    args = [*outputs.args(name), *QUIET, "launch.dry_run=true", f"run_dir={tmp_path}"]
    verdict = run(compose(args), overrides=args)
    out = capsys.readouterr().out
    assert verdict["refused"] == [] and verdict["fits"], verdict
    assert f"== {name}:" in out and "memory: " in out and f"forecast [{name}]" in out, out[-2000:]
    assert not (tmp_path / "model").exists() and not (tmp_path / "final_metrics.json").exists()


def _weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))


@pytest.mark.parametrize("name", list(STEPS))
def test_two_optimizer_steps_change_every_trainable_parameter_and_write_the_spec_s_figures(name, outputs, tmp_path):
    spec = STEPS[name]
    args = [*outputs.args(name), "step.max_steps=2", *QUIET, f"run_dir={tmp_path}"]
    schema = to_schema(compose(args))
    assert schema.lora.rank == 0, "every parameter trains: the check needs a full fine-tune"
    final = run(compose(args), overrides=args)
    start = _weights(dict(a.split("=", 1) for a in args)[_start_key(name)])
    # The last trained weights: a step that keeps its best model (PPO's judge) writes them to model_last/
    # where the best is its start.
    after = _weights(str(tmp_path / ("model_last" if (tmp_path / "model_last").exists() else "model")))
    # Every tensor the start and the output share (a reward model's new head is not in its start).
    shared = sorted(set(start) & set(after))
    assert len(shared) >= len(after) - 2, (sorted(set(after) - set(start)))
    still = [k for k in shared if torch.equal(start[k], after[k])]
    assert not still, f"step={name}: two optimizer steps left {len(still)} of {len(shared)} tensors unchanged: {still[:8]}"
    # The final figures hold what its sweeps rank by and what a chain's summary shows of it.
    written = json.loads((tmp_path / "final_metrics.json").read_text())
    assert final["step"] == written["step"] == 2
    assert spec.objective[0] in written, (spec.objective, sorted(written))
    missing = [key for key, _, _ in spec.summary if key not in written and not key.endswith("_before")]
    assert not missing, f"step={name}: its summary's figures {missing} are not in final_metrics.json"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STEPS))
def test_every_step_killed_mid_run_resumes_to_the_run_never_killed(name, outputs, tmp_path):
    args = [*outputs.args(name), "step.max_steps=12", "step.log_every_steps=1", "checkpoint.every_steps=3", "step.eval_every_steps=0"]
    key = "policy_loss" if STEPS[name].generates else "loss"
    _straight(args, tmp_path / "a")
    _kill_after(args, tmp_path / "b", key, 7, signal.SIGKILL)
    _straight(args, tmp_path / "b")
    same_run(tmp_path / "a", tmp_path / "b", key)
