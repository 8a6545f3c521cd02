"""Hardware presets, experiment files, the dry-run and memory pre-flight, and real 2-rank CPU runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from rlhf.config import ConfigError, load_model_file, to_schema
from rlhf.engine import ds_config
from rlhf.launch import run
from rlhf.preflight import memory
from tests.conftest import ROOT, compose, compose_step, free_port, run_cli

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
_launch = run_cli
_free_port = free_port


def test_required_presets_and_experiments_exist():
    presets = {p.stem for p in (ROOT / "conf" / "hardware").glob("*.yaml")}
    assert {"cpu", "cpu-2rank", "a6000", "a100-40g", "a100-80g", "8xa100-40g", "8xa100-80g", "64xa100-80g",
            "h100-80g", "8xh100-80g"} <= presets
    assert {"opt-1.3b_a6000", "opt-13b_8xa100-40g", "opt-66b_64xa100-80g"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_dry_runs_with_consistent_batches_and_fits(name, tmp_path, capsys):
    overrides = [f"experiment={name}", "launch.dry_run=true", f"run_dir={tmp_path}"]
    cfg = compose(overrides)
    assert run(cfg, overrides=overrides) == {"dry_run": True, "fits": True, "refused": []}
    out = capsys.readouterr().out
    assert not (tmp_path / "config.yaml").exists(), "a dry-run writes nothing"
    for step in cfg.pipeline.steps:
        assert f"== {step}:" in out
        # The forecast per step: its phases, a total with device-hours, and money where the preset has a price.
        block = out.split(f"forecast [{step}]: ", 1)[1].split("\n==", 1)[0]
        assert "  total " in block and "device-hours on" in block
        step_cfg = to_schema(compose_step([f"experiment={name}"], step))
        ds = ds_config(step_cfg)
        assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
                                          * step_cfg.hardware.nodes * step_cfg.hardware.devices_per_node)
        critic = load_model_file(step_cfg.critic.model) if step_cfg.critic.model else None
        fits, line = memory.verdict(memory.estimate(step_cfg, critic), step_cfg.hardware.memory_per_device_gb)
        assert fits, f"{name} {step}: {line}"


def test_dry_run_of_66b_prints_an_8_node_deepspeed_command(tmp_path, capsys):
    # In-process: the command line's exit codes are tested in test_config (one subprocess is enough).
    overrides = ["experiment=opt-66b_64xa100-80g", "launch.dry_run=true", f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    assert "deepspeed --num_nodes 8 --num_gpus 8" in out
    assert out.count("memory: ") == 3 and "does not fit" not in out


def test_refuses_13b_full_finetune_on_one_a6000(tmp_path):
    with pytest.raises(ConfigError, match=r"does not fit(.|\n)*role(.|\n)*weights"):
        run(compose(["step=sft", "model=opt-13b", "hardware=a6000", "zero=0", f"run_dir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists()


def test_force_lets_a_run_past_the_memory_verdict_and_nothing_else(tmp_path):
    args = ["step=sft", "model=opt-13b", "hardware=a6000", "zero=0", "launch.dry_run=true", f"run_dir={tmp_path}"]
    refused = run(compose(args), overrides=args)["refused"]
    assert len(refused) == 1 and "does not fit" in refused[0], refused
    forced = [*args, "launch.force=true"]
    verdict = run(compose(forced), overrides=forced)
    assert verdict["refused"] == [] and not verdict["fits"], verdict
    # A refusal of another kind stays: force is about memory only.
    missing = [*forced, f"model.path={tmp_path / 'no-such-model'}"]
    assert any("no-such-model" in why for why in run(compose(missing), overrides=missing)["refused"])


@pytest.mark.parametrize("model", ["opt-1.3b", "llama2-7b", "opt-13b"])
@pytest.mark.parametrize("stage,offload", [(2, False), (2, True), (3, False), (3, True)])
def test_model_states_match_deepspeed_estimators(model, stage, offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    m = load_model_file(model)
    total, largest, _ = memory.param_counts(m)
    ours = sum(memory.model_states(total, largest, total, stage, 8, "fp16", offload, offload))
    if stage == 2:
        _, theirs = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=8, cpu_offload=offload)
    else:
        _, theirs, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=8, cpu_offload=offload,
                                                             cpu_offload_params=offload)
    assert ours == pytest.approx(theirs, rel=0.10)


def test_parameter_counts_match_the_published_sizes():
    expected = {"opt-125m": 125e6, "opt-1.3b": 1.3e9, "opt-13b": 13e9, "opt-66b": 66e9, "llama2-7b": 6.74e9,
                "llama2-13b": 13.0e9}
    for name, size in expected.items():
        assert memory.param_counts(load_model_file(name))[0] == pytest.approx(size, rel=0.06), name


def test_launch_bad_inputs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="launch.hostfile='/no/such/hostfile' does not exist"):
        to_schema(compose(["launch.hostfile=/no/such/hostfile"]))
    with pytest.raises(ConfigError, match="hardware.nodes=8 needs launch.hostfile"):
        run(compose(["hardware=64xa100-80g", "model=opt-125m", "zero=3", "launch.force=true",
                     f"run_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match="hardware.devices_per_node=512 CPU ranks but this machine has"):
        run(compose(["hardware.devices_per_node=512", f"run_dir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists()


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path / "metrics.jsonl") if '"loss"' in line]


@pytest.mark.slow  # make test starts 2 ranks in the PPO test below and in test_loss_agg
def test_two_cpu_ranks_sft_zero3_matches_one_rank_with_the_same_global_batch(tmp_path):
    common = ["step=sft", "zero=3", "step.max_steps=5", "step.log_every_steps=1", "logging.progress_bar=false",
              "data.max_eval_samples=32", "step.save_model=false"]
    proc = _launch(*common, "hardware=cpu-2rank", f"launch.master_port={_free_port()}", f"run_dir={tmp_path / 'two'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed --num_nodes 1 --num_gpus 2" in proc.stdout
    run(compose([*common, "step.gradient_accumulation_steps=2", f"run_dir={tmp_path / 'one'}"]))
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == len(one) == 5
    # Same 32 rows per optimizer step, split across ranks instead of accumulated.
    assert two == pytest.approx(one, rel=1e-4)


@pytest.mark.slow  # a 2-rank launch
def test_two_cpu_ranks_zero3_draw_the_reward_model_s_pairs_from_the_policy_together(tmp_path):
    """Each rank samples its share of the prompts through the partitioned policy; both train on the
    same gathered pairs, which rank 0 writes once."""
    from rlhf import rewards

    proc = _launch("step=reward", "hardware=cpu-2rank", "zero=3", "step.max_steps=2", "step.rule_check_answers=0",
                   "step.policy_pairs_prompts=16", "step.eval_every_steps=0", "logging.progress_bar=false",
                   "data.max_eval_samples=32", f"launch.master_port={_free_port()}", f"run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "policy_pairs.jsonl").read_text().splitlines()
    figures, pairs = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert figures["policy_pairs_prompts"] == len({p["prompt"] for p in pairs}) == 16
    rule = rewards.task_rule(None, [p["prompt"] for p in pairs])
    assert all(rule(p["prompt"], p["chosen"]) > rule(p["prompt"], p["rejected"]) for p in pairs)
    assert json.loads((tmp_path / "final_metrics.json").read_text())["policy_pairs"] == len(pairs)


@pytest.mark.slow  # make test runs 2 ranks in test_loss_agg and test_rollout_share
def test_two_rank_zero3_ppo_with_accumulation_keeps_ranks_in_step_and_the_schedule_whole(tmp_path):
    """2 CPU ranks, ZeRO-3, accumulation 2, gradient checkpointing, an adaptive KL coefficient: both
    ranks hold the same coefficient (it is updated from the KL of the global batch), and the linear
    schedule spans all optimizer steps (3 PPO steps x 2 optimizer steps), not half of them. The
    actor generates in tensor-parallel slices over both ranks (rlhf/generation/shards.py): the log-probs its
    rollouts carry are the training forward's."""
    import torch

    quiet = ["logging.progress_bar=false", "data.max_eval_samples=32"]
    run(compose(["step=sft", "step.max_steps=10", *quiet, f"run_dir={tmp_path / 'sft'}"]))
    lr = 1e-3
    proc = _launch("step=ppo", "hardware=cpu-2rank", "zero=3", "step.max_steps=3", "step.log_every_steps=1",
                   "step.rollout_batch_size_per_device=16", "step.micro_batch_size_per_device=4",
                   # Generation and the scoring forwards in chunks of 8: as many gathers on both ranks.
                   "step.generation_batch_size_per_device=8", "step.zero3_generation=tp",
                   "step.gradient_accumulation_steps=2", "step.gradient_checkpointing=true",
                   "step.reward_fn=rule", "step.reward_model_weight=0", "step.kl_target=0.001", "step.kl_horizon=64",
                   "step.eval_prompts=8", "step.eval_micro_batch_size_per_device=8", f"optim.lr={lr}",
                   "optim.scheduler=linear", "optim.warmup_steps=0", "checkpoint.every_steps=1",
                   "checkpoint.keep_last=5", f"actor.path={tmp_path / 'sft' / 'model'}", *quiet,
                   f"launch.master_port={_free_port()}", f"run_dir={tmp_path / 'ppo'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # The libraries' deprecation notices about their own calls go to each rank's log file, not here.
    assert "FutureWarning" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    final = json.loads((tmp_path / "ppo" / "final_metrics.json").read_text())
    assert final["step"] == 3 and final["reference_weight_change"] == 0.0 and final["actor_weight_change"] > 0
    rows = [json.loads(line) for line in open(tmp_path / "ppo" / "metrics.jsonl") if "policy_loss" in line]
    # fp32: the sampled tokens' log-probs from the slices equal the training forward's before an update.
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in rows), [r["rollout/logprob_diff"] for r in rows]
    # 16 rollouts / (4 micro x 2 accumulation) = 2 optimizer steps per PPO step, 6 in all: linear decay
    # to 0 over 6 steps (the bug decayed over 3, reaching 0 after the second PPO step).
    assert [r["lr"] for r in rows] == pytest.approx([lr * (1 - 2 * s / 6) for s in (1, 2, 3)], rel=2e-3, abs=1e-9)
    coefs = {}
    for step in (1, 2):
        folder = tmp_path / "ppo" / "checkpoints" / f"step_{step:08d}"
        coefs[step] = [torch.load(folder / f"client_rank{r}.pt", weights_only=True)["state"]["kl_ctl"]["value"]
                       for r in (0, 1)]
        assert coefs[step][0] == coefs[step][1], f"ranks' KL coefficients differ after PPO step {step}"
    assert coefs[2][0] != coefs[1][0], "the adaptive coefficient moved"
    # The logged coefficient is the one each PPO step used: the value after the previous step's update.
    assert [r["kl_coef"] for r in rows[1:]] == pytest.approx([coefs[1][0], coefs[2][0]], abs=1e-6)


def test_slurm_launcher_is_sized_from_the_preset():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlhf.config import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=["hydra/launcher=slurm", "experiment=opt-66b_64xa100-80g"],
                            return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.nodes == 8 and launcher.gpus_per_node == 8 and launcher.tasks_per_node == 1
    assert "SlurmLauncher" in launcher._target_


def test_dry_run_counts_updates_names_the_hostfile_and_refuses_what_the_real_run_would(tmp_path, capsys):
    # 8 rollouts per device, 8 per micro batch, 8 ranks: 1 optimizer step per PPO step (it printed 0).
    overrides = ["experiment=llama2-7b_8xa100-80g", "step=ppo", "launch.dry_run=true", f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    assert "64 per PPO step, 1 optimizer steps each" in out and "refused" not in out

    overrides = ["experiment=opt-66b_64xa100-80g", "step=sft", "launch.dry_run=true", f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    assert "hostfile: needed -- launch.hostfile=FILE with 8 lines 'HOST slots=8'" in capsys.readouterr().out

    # A PPO step alone with no reward model: the real run refuses, so the dry-run must not say it fits.
    alone = run(compose(["step=ppo", "launch.dry_run=true", f"run_dir={tmp_path}"]))
    assert alone["fits"] is False and "needs critic.path" in alone["refused"][0]
    assert "refused: PPO with step.reward_model_weight > 0 needs critic.path" in capsys.readouterr().out

    # An OPT critic for a LLaMA actor would score LLaMA token ids: refused before anything loads.
    overrides = ["experiment=llama2-7b_8xa100-80g", "step=ppo", "pipeline.ppo.critic.model=opt-350m",
                 "launch.dry_run=true", f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    assert "refused: critic.model=opt-350m (opt, vocabulary 50272) does not share the actor's tokenizer" in out
    with pytest.raises(ConfigError, match="does not share the actor's tokenizer"):
        run(compose(overrides[:-2] + [f"run_dir={tmp_path}"]), overrides=overrides[:-2])
    assert not (tmp_path / "sft" / "config.yaml").exists(), "refused before the first step started"


@pytest.mark.slow  # a third 2-rank launch; make test has two
def test_two_ranks_starting_on_an_empty_cache_both_build_the_random_model_safely(tmp_path):
    """The fresh-machine failure: ranks started straight by the DeepSpeed launcher on an empty cache
    (no launch.py to build it first) left a random-model folder holding tokenizer files only."""
    from omegaconf import OmegaConf

    from rlhf.config import load_run_config
    from rlhf.models import cache_entry_complete, random_model_dir
    from tests.conftest import clean_env

    cache = tmp_path / "empty-cache"
    cfg = compose(["step=sft", "hardware=cpu-2rank", "step.max_steps=1", "step.save_model=false",
                   "data.max_eval_samples=16", "logging.progress_bar=false", f"run_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                           "--master_port", str(_free_port()), "--module", "rlhf.worker",
                           str(tmp_path / "run" / "config.yaml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=clean_env(RLHF_CACHE=str(cache)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    entry = random_model_dir(load_run_config(tmp_path / "run" / "config.yaml").model)
    assert cache_entry_complete(cache / entry.relative_to(entry.parents[1]))


def test_a_folder_holding_a_run_with_other_settings_is_refused_and_resume_never_starts_over(tmp_path):
    """Same command, same seed: same numbers. A rerun into a folder whose run used another seed (or
    any other result-changing key) must not resume or reuse it silently."""
    base = ["step=sft", "step.max_steps=2", "logging.progress_bar=false", "data.max_eval_samples=16",
            "step.eval_accuracy_prompts=0", f"run_dir={tmp_path}"]
    first = run(compose(base))
    assert run(compose([*base, "logging.progress_bar=true"])) == first, "watching differently is no change"
    with pytest.raises(ConfigError, match=r"holds a run made with other settings \(optim.lr: 0.003 -> 0.001; "
                                          r"seed: 42 -> 7\).*resume=never to start over"):
        run(compose([*base, "seed=7", "optim.lr=1e-3"]))
    # A key the schema gained after a run (absent from its config.yaml) at its default is no change:
    # the run is reused; set to anything else, it is a change like any other.
    import yaml

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["actor"]["random_init"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert run(compose(base)) == first
    with pytest.raises(ConfigError, match=r"actor.random_init: \(absent\) -> True"):
        run(compose([*base, "actor.random_init=true"]))
    again = run(compose([*base, "seed=7", "resume=never"]))
    assert again["step"] == 2 and "seed: 7" in (tmp_path / "config.yaml").read_text()


def test_a_hub_model_that_cannot_be_reached_is_refused_at_once(tmp_path, monkeypatch):
    """Instead of from_pretrained's minutes of retries on every rank, one line before anything starts."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"model.path='facebook/opt-125m' is a hub id, but HF_HUB_OFFLINE is set "
                                          r"and it is not in the Hugging Face cache"):
        run(compose(["model=opt-125m", "step.max_steps=1", f"run_dir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists(), "refused before the run directory is written"


def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_measured_slowdown(tmp_path, monkeypatch, capsys):
    from rlhf.preflight import probes

    assert probes.cpu_bf16() in ("emulated", "unknown") or probes.cpu_bf16().startswith("native (")
    monkeypatch.setattr(probes, "cpu_bf16", lambda: "emulated")  # this CPU's flags, as an AVX2-only CPU has them
    run(compose(["hardware.precision=bf16", "step.max_steps=1", "data.max_eval_samples=16",
                 "logging.progress_bar=false", f"run_dir={tmp_path / 'bf16'}"]))
    assert "WARNING hardware.precision=bf16 on a CPU without native bf16" in capsys.readouterr().out
    run(compose(["step.max_steps=1", "data.max_eval_samples=16", "logging.progress_bar=false",
                 f"run_dir={tmp_path / 'fp32'}"]))
    assert "without native bf16" not in capsys.readouterr().out, "fp32 runs are not warned"


def test_help_lists_the_groups_as_files_and_the_sweeps_without_schema_entries():
    proc = run_cli("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert "schema" not in proc.stdout
    assert "sft_lr_zero" in lines["sweep"] and "3-offload" in lines["zero"] and "e2e" in lines["stage"]
    assert len(proc.stdout.splitlines()) < 40, "a page, not a dump of every key"


def test_a_one_process_cpu_run_compiles_no_deepspeed_op(tmp_path):
    """DeepSpeed's CPU backend compiles its shared-memory all-reduce on a machine's first run (30-70 s
    and a C++ toolchain) though one rank reduces nothing: a new user's first `make run` paid it."""
    from tests.conftest import clean_env, run_cli

    ext = tmp_path / "torch_extensions"
    proc = run_cli("step=sft", "step.max_steps=2", "step.log_every_steps=1", "data.max_eval_samples=16",
                   "logging.progress_bar=false", "step.save_model=false", f"run_dir={tmp_path / 'run'}", env=clean_env(TORCH_EXTENSIONS_DIR=str(ext)),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(tmp_path / "run")) == 2
    assert not list(ext.glob("**/*.so")) and "built successfully" not in proc.stdout + proc.stderr


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path, monkeypatch, capsys):
    """torch waits forever on an extension's build lock; a killed build leaves one behind."""
    import os
    import time

    from rlhf.worker import clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    clear_stale_build_locks()
    assert not stale.exists() and fresh.exists(), "a build running now keeps its lock"
    assert "removed a stale build lock" in capsys.readouterr().err


def test_library_deprecation_notices_go_to_the_run_log_and_our_own_warnings_to_the_console(tmp_path, monkeypatch):
    import warnings

    from rlhf.worker import quiet_libraries

    console = []  # what the console's showwarning is handed
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest, **kw: console.append(str(message)))
    log = tmp_path / "warnings.rank0.log"
    quiet_libraries(log)
    library = os.path.join(os.sep, "venv", "lib", "site-packages", "torch", "distributed", "c10d.py")
    ours = os.path.join(os.sep, "work", "rlhf", "runners", "sft.py")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("torch.distributed.reduce_op is deprecated", FutureWarning, library, 7)
        warnings.warn_explicit("our own deprecation", FutureWarning, ours, 9)
    library_log = logging.getLogger("rlhf.library_warnings")
    for handler in list(library_log.handlers):
        handler.close()
        library_log.removeHandler(handler)
    assert "reduce_op is deprecated" in log.read_text() and console == ["our own deprecation"]
    assert "our own" not in log.read_text()
