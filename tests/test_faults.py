"""Faults at scale, on one machine (loopback only): two nodes started without ssh, a rank lost in
the middle of a 2-rank SFT and PPO run, a disk that fills up while saving. Every test starts real
DeepSpeed ranks on CPU (gloo) through launch.py, kills real processes, and checks what a user
would see and that the same command resumes to the weights of a run that was never interrupted.

    .venv/bin/python -m pytest -q tests/test_faults.py      # about 4 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.launch import run
from tests.conftest import ROOT, clean_env, compose, free_port, run_cli, same_run, start_cli

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=32"]


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().rsplit("_", 1)[1]) if pointer.exists() else 0


@pytest.mark.slow  # make test starts 2 ranks elsewhere; test-all also as two nodes
def test_two_nodes_without_ssh_train_exactly_as_one_node_with_two_ranks(tmp_path):
    """Two launcher processes, node ranks 0 and 1 of one CPU rank each, a hostfile naming both, on
    127.0.0.1: the per-node commands a cluster without ssh between nodes runs. Same losses and the
    same final weights as one node with two ranks."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    common = ["step=sft", "zero=2", "step.max_steps=6", "step.log_every_steps=1", *QUIET]
    _ok(run_cli(*common, "hardware=cpu-2rank", f"launch.master_port={free_port()}", f"run_dir={tmp_path / 'one'}"))
    port = free_port()
    nodes = [start_cli(*common, "hardware=cpu-2rank", "hardware.nodes=2", "hardware.devices_per_node=1",
                       f"launch.hostfile={hostfile}", "launch.master_addr=127.0.0.1", f"launch.master_port={port}",
                       f"launch.node_rank={k}", f"run_dir={tmp_path / 'two'}", stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT) for k in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for k in (0, 1):
        assert f"--hostfile {hostfile}" in outs[k] and f"--no_ssh --node_rank {k}" in outs[k]
    records = [json.loads((tmp_path / "two" / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in records] == ["ok", "ok"] and records[0]["pid"] != records[1]["pid"]
    same_run(tmp_path / "one", tmp_path / "two", "loss")


def test_the_dry_run_of_a_cluster_preset_prints_the_per_node_commands(tmp_path, capsys):
    overrides = ["experiment=opt-66b_64xa100-80g", "launch.dry_run=true", "launch.master_addr=10.0.0.1",
                 f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    assert "on node K (K = 0 .. 7) run this command with launch.node_rank=K launch.master_addr=10.0.0.1" in out
    assert "node K starts ranks 8K .. 8K+7" in out
    # A node's own command: its ranks only, without ssh.
    from rlhf.config import to_schema
    from rlhf.launch.processes import launch_command

    schema = to_schema(compose(["experiment=opt-66b_64xa100-80g", "launch.master_addr=10.0.0.1",
                                "launch.node_rank=3"]))
    cmd = launch_command(schema, [tmp_path])
    assert cmd[cmd.index("--node_rank") + 1] == "3" and "--no_ssh" in cmd and "--master_addr" in cmd


def test_node_rank_settings_are_checked():
    from rlhf.config import ConfigError, to_schema

    with pytest.raises(ConfigError, match="launch.node_rank=1 needs launch.master_addr"):
        to_schema(compose(["launch.node_rank=1"]))
    with pytest.raises(ConfigError, match="launch.node_rank=8 but hardware.nodes=8: node ranks are 0 .. 7"):
        to_schema(compose(["experiment=opt-66b_64xa100-80g", "launch.node_rank=8", "launch.master_addr=h"]))
    with pytest.raises(ConfigError, match="launch.collective_timeout_min=0"):
        to_schema(compose(["launch.collective_timeout_min=0"]))


def _kill_rank_after_checkpoint(proc: subprocess.Popen, run_dir: Path, rank: int, min_step: int) -> tuple[float, int]:
    """SIGKILL ``rank`` of the running launch once a checkpoint at ``min_step`` or later is in place;
    the moment of the kill and the pid killed."""
    deadline = time.monotonic() + 300
    record = run_dir / "ranks" / f"rank{rank}.json"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the kill:\n" + proc.communicate()[0][-3000:]
        if _latest_step(run_dir) >= min_step and record.exists():
            pid = json.loads(record.read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
            return time.monotonic(), pid
        time.sleep(0.05)
    pytest.fail("no checkpoint in 300 s")


def _lose_a_rank_then_resume(args: list[str], run_dir: Path, straight: Path, rank: int, min_step: int,
                             key: str) -> float:
    """Kill ``rank`` mid-run: the launch stops by itself, names the lost rank, leaves the last
    checkpoint; the same command resumes to the uninterrupted run's weights and losses. Returns
    the seconds from the kill to the launch's exit."""
    proc = start_cli(*args, f"run_dir={run_dir}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed_at, pid = _kill_rank_after_checkpoint(proc, run_dir, rank, min_step)
    out = proc.communicate(timeout=180)[0]
    took = time.monotonic() - killed_at
    assert proc.returncode != 0 and not (run_dir / "final_metrics.json").exists()
    assert f"lost rank {rank} (pid {pid} on " in out, out[-3000:]
    assert f"rank(s) {1 - rank} stopped after it" in out
    assert took < 60, f"the launch took {took:.0f} s to stop after rank {rank} was lost"
    resumed_from = _latest_step(run_dir)
    out = _ok(run_cli(*args, f"run_dir={run_dir}"))
    assert resumed_from >= min_step
    same_run(straight, run_dir, key)
    return took


@pytest.mark.slow
def test_a_rank_lost_mid_sft_stops_the_launch_names_it_and_the_same_command_resumes_exactly(tmp_path):
    args = ["step=sft", "hardware=cpu-2rank", "zero=2", "step.max_steps=60", "step.log_every_steps=1",
            "step.eval_every_steps=0", "checkpoint.every_steps=10", f"launch.master_port={free_port()}", *QUIET]
    _ok(run_cli(*args, f"run_dir={tmp_path / 'straight'}"))
    took = _lose_a_rank_then_resume(args, tmp_path / "lost", tmp_path / "straight", rank=1, min_step=10, key="loss")
    print(f"SFT: the launch stopped {took:.1f} s after rank 1 was killed")


@pytest.mark.slow
def test_rank_0_lost_mid_ppo_stops_the_launch_names_it_and_the_same_command_resumes_exactly(tmp_path):
    """Rank 0 also holds the rendezvous store: losing it must not leave rank 1 waiting."""
    run(compose(["step=sft", "step.max_steps=10", *QUIET, f"run_dir={tmp_path / 'sft'}"]))
    args = ["step=ppo", "hardware=cpu-2rank", "zero=2", f"actor.path={tmp_path / 'sft' / 'model'}",
            "step.reward_fn=rule", "step.reward_model_weight=0", "step.max_steps=8",
            "step.rollout_batch_size_per_device=8", "step.micro_batch_size_per_device=8", "step.eval_prompts=8",
            "step.eval_every_steps=0", "checkpoint.every_steps=2", "checkpoint.keep_last=5",
            f"launch.master_port={free_port()}", *QUIET]
    _ok(run_cli(*args, f"run_dir={tmp_path / 'straight'}"))
    took = _lose_a_rank_then_resume(args, tmp_path / "lost", tmp_path / "straight", rank=0, min_step=2,
                                    key="policy_loss")
    print(f"PPO: the launch stopped {took:.1f} s after rank 0 was killed")


@pytest.mark.slow
def test_a_launch_killed_between_two_steps_takes_its_ranks_with_it_and_the_same_command_resumes_exactly(tmp_path):
    """SIGKILL to the launching process (a closed terminal, the out-of-memory killer) of a chain's
    2-rank launch, right after its first step finished: the ranks, which watch it, stop while the
    next step builds instead of training on beside a rerun; the same command trains that step to
    the uninterrupted chain's weights."""
    import psutil

    args = ["pipeline=e2e", "pipeline.steps=[sft,reward]", "hardware=cpu-2rank", "zero=2", "pipeline.on_weak_step=warn",
            "pipeline.sft.step.max_steps=8", "pipeline.reward.step.max_steps=300", "pipeline.reward.step.log_every_steps=1",
            "pipeline.reward.step.eval_every_steps=0", "pipeline.reward.step.policy_pairs_prompts=0",
            "checkpoint.every_steps=10", f"launch.master_port={free_port()}", *QUIET]
    _ok(run_cli(*args, f"run_dir={tmp_path / 'straight'}"))
    run_dir = tmp_path / "killed"
    proc = start_cli(*args, f"run_dir={run_dir}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (run_dir / "sft" / "final_metrics.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the chain ended before its first step did"
        time.sleep(0.02)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert any("rlhf.worker" in p.cmdline() for p in tree)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"{len(alive)} process(es) of the killed launch still run 60 s later"
    # Stopped by the launch's end (a rank's record says it got the signal), not trained on to the end.
    ended = [json.loads(f.read_text())["status"] for f in sorted((run_dir / "ranks").glob("rank*.json"))]
    assert "signal" in ended and not (run_dir / "reward" / "final_metrics.json").exists(), ended
    _ok(run_cli(*args, f"run_dir={run_dir}"))
    for step in ("sft", "reward"):
        same_run(tmp_path / "straight" / step, run_dir / step, "loss")


def test_a_launch_waits_for_the_ranks_of_an_earlier_launch_of_its_folder_then_refuses(tmp_path, monkeypatch):
    """Ranks of an earlier launch of the same folder still alive on this machine (a second terminal,
    a killed launch's ranks saving): the launch waits, then refuses naming the pid and the fix."""
    import socket

    from rlhf.config import ConfigError
    from rlhf.launch import processes

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "rlhf.worker"])
    try:
        (tmp_path / "ranks").mkdir()
        (tmp_path / "ranks" / "rank1.json").write_text(json.dumps(
            {"rank": 1, "host": socket.gethostname(), "pid": rank.pid, "status": "signal"}))
        # The dry-run says it on its own line, apart from its verdict, as the real run waits first.
        dry = ["step=sft", "hardware=cpu-2rank", "launch.dry_run=true", f"run_dir={tmp_path}"]
        verdict = run(compose(dry), overrides=dry)
        assert verdict["refused"] == [] and any(f"rank 1 pid {rank.pid}" in line and "waits up to" in line
                                                for line in verdict["this_machine"]), verdict
        monkeypatch.setattr(processes, "EARLIER_LAUNCH_WAIT_S", 1)
        with pytest.raises(ConfigError, match=rf"still running \(rank 1 pid {rank.pid}\).*kill {rank.pid}"):
            processes._wait_for_an_earlier_launch(tmp_path / "ranks", range(2))
    finally:
        rank.kill()
        rank.wait()
    processes._wait_for_an_earlier_launch(tmp_path / "ranks", range(2))  # ended: no wait, no refusal


def test_a_single_process_run_leaves_the_next_launch_from_that_process_starting_its_ranks(monkeypatch):
    """An in-process run sets the rank variables for its own world of one and they outlive it; a sweep's
    next job (or a notebook's next run) of 2 ranks must still start its ranks, not train in-process as
    one of them. A launcher's LOCAL_RANK still marks a rank."""
    from rlhf import worker
    from rlhf.config import compose_config, to_schema
    from rlhf.launch.step import starts_ranks
    from tests.conftest import RANK_VARS

    for key in RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(worker, "_SET_HERE", set())
    worker.init_distributed(to_schema(compose_config(["step=sft", "hardware=cpu"])))
    assert os.environ["LOCAL_RANK"] == "0"
    two = to_schema(compose_config(["step=sft", "hardware=cpu-2rank"]))
    assert starts_ranks(two)
    monkeypatch.setattr(worker, "_SET_HERE", set())  # as if a launcher had set LOCAL_RANK
    assert not starts_ranks(two)


@pytest.mark.slow
def test_a_hung_rank_fails_the_launch_after_the_collective_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: a stalled machine) keeps its sockets open, so only the
    collective timeout frees the others: rank 0 fails after launch.collective_timeout_min, the
    launcher stops, and the message names the rank that hung and the timeout."""
    run_dir = tmp_path / "hung"
    args = ["step=sft", "hardware=cpu-2rank", "zero=2", "step.max_steps=400", "step.eval_every_steps=0",
            "checkpoint.every_steps=10", "launch.collective_timeout_min=0.15", f"launch.master_port={free_port()}",
            *QUIET, f"run_dir={run_dir}"]
    proc = start_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline, record = time.monotonic() + 600, run_dir / "ranks" / "rank1.json"
    while not (_latest_step(run_dir) >= 10 and record.exists()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the rank hung"
        time.sleep(0.05)
    pid = json.loads(record.read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        out = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:  # a failed test must not leave a stopped rank behind
            os.kill(pid, signal.SIGKILL)
    took = time.monotonic() - stopped_at
    assert proc.returncode != 0
    assert f"lost rank 1 (pid {pid} on " in out and "Timed out waiting 9000ms" in out, out[-3000:]
    # 9 s of timeout, then the DeepSpeed launcher's 30 s grace before it kills a rank that ignores SIGTERM.
    assert 9 <= took < 90, took
    print(f"hung rank: the launch stopped {took:.1f} s after rank 1 hung (timeout 9 s)")


def test_deepspeed_s_own_process_group_times_out_as_configured():
    """DeepSpeed clones the world group for ZeRO's collectives with dist.new_group, which takes torch's
    module default (30 min on gloo), not the world group's timeout: a rank hung in a ZeRO collective
    held the others past the hung-rank test's 4 minutes. The configured timeout reaches that group."""
    code = ("import torch, deepspeed.utils.groups as g; from rlhf import worker; from tests.conftest import compose; "
            "from rlhf.config import to_schema; "
            "worker.init_distributed(to_schema(compose(['launch.collective_timeout_min=0.15']))); "
            "print(g._clone_world_group()._get_backend(torch.device('cpu')).options._timeout)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "0:00:09"


def _file_size_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow  # make test fills the disk while the model is written (below)
def test_a_full_disk_while_saving_keeps_the_last_checkpoint_says_what_it_needs_and_a_rerun_resumes(tmp_path):
    """A file-size limit (what `ulimit -f` sets; a full disk fails the same write) cuts a checkpoint
    write short: the half-written folder goes, `latest` still names the previous checkpoint, the run
    stops with one line naming the folder and the bytes needed, and with room again the same command
    resumes to the weights of a run that never failed."""
    args = ["step=sft", "step.max_steps=40", "step.log_every_steps=1", "step.eval_every_steps=0",
            "checkpoint.every_steps=4", "checkpoint.keep_last=5", *QUIET]
    _ok(run_cli(*args, f"run_dir={tmp_path / 'straight'}"))
    run_dir = tmp_path / "full"
    proc = start_cli(*args, f"run_dir={run_dir}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while _latest_step(run_dir) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    before = _latest_step(run_dir)
    assert before >= 4 and not (run_dir / "final_metrics.json").exists()
    largest = max(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    full = run_cli(*args, f"run_dir={run_dir}", preexec_fn=_file_size_limit(largest // 2))
    assert full.returncode == 2, full.stdout[-2000:] + full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f"disk error: cannot write the checkpoint step_{before + 4:08d} into "
                           f"{run_dir / 'checkpoints'}: "), line
    assert "It takes about" in line and "a file-size limit (ulimit -f) of" in line
    assert f"The previous checkpoint step_{before:08d} is kept" in line
    assert _latest_step(run_dir) == before and not list((run_dir / "checkpoints").glob(".tmp-*"))
    # Room again: the same command resumes from the kept checkpoint.
    _ok(run_cli(*args, f"run_dir={run_dir}"))
    same_run(tmp_path / "straight", run_dir, "loss")


def test_a_full_disk_while_writing_the_model_leaves_no_half_model_folder(tmp_path):
    # The session's caches (random model, tokenized data) are built first, with room: only the run's
    # own writes meet the limit, whichever tests ran before this one.
    run(compose(["step=sft", "step.max_steps=1", "step.save_model=false", *QUIET, f"run_dir={tmp_path / 'warm'}"]))
    args = ["step=sft", "step.max_steps=3", *QUIET, f"run_dir={tmp_path / 'run'}"]
    proc = run_cli(*args, preexec_fn=_file_size_limit(200_000))  # the tiny model's weights are ~4 MB
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"disk error: cannot write the model model/ into {tmp_path / 'run'}: "), line
    assert "It takes about" in line and "a file-size limit (ulimit -f) of 200.0 KB" in line
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / ".tmp-model").exists()


def test_inside_a_slurm_job_step_each_node_starts_its_own_ranks(tmp_path, monkeypatch):
    """hydra/launcher=slurm runs launch.py once per node under srun: each task starts its node's ranks
    without ssh (--no_ssh --node_rank SLURM_NODEID), rank 0 on the allocation's first host, from a
    hostfile written from the allocation. There is no SLURM here: `scontrol` is a script printing the
    allocation's hosts, and the variables are those srun sets in a task."""
    from rlhf.config import ConfigError, to_schema
    from rlhf.launch.processes import launch_command, slurm_hostfile, slurm_node

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nfor i in 1 2 3 4 5 6 7 8; do echo gpu-a0$i; done\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-a0[1-8]")

    def in_task(**env: str):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        schema = to_schema(compose(["experiment=opt-66b_64xa100-80g"]))
        slurm_node(schema, slurm_hostfile(schema, tmp_path))
        return schema

    schema = in_task(SLURM_STEP_NUM_TASKS="8", SLURM_STEP_NUM_NODES="8", SLURM_NODEID="3")
    assert (tmp_path / "hostfile").read_text().splitlines()[::7] == ["gpu-a01 slots=8", "gpu-a08 slots=8"]
    cmd = " ".join(launch_command(schema, [tmp_path]))
    assert f"--hostfile {tmp_path / 'hostfile'} --master_addr gpu-a01" in cmd and "--no_ssh --node_rank 3" in cmd
    with pytest.raises(ConfigError, match="runs 64 task.* on 8 node.*hydra.launcher.tasks_per_node=1"):
        in_task(SLURM_STEP_NUM_TASKS="64")
    # Not in an srun step (salloc, then python launch.py): one launcher starts every node over ssh.
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    schema = in_task()
    assert schema.launch.node_rank == -1 and "--no_ssh" not in launch_command(schema, [tmp_path])
