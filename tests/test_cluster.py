"""Beyond one machine, and when things break there:

- a job run through submitit (its local executor: the SLURM launcher's code path, pickled job, job
  process, logs and result pickle, without a cluster);
- the sbatch script that the SLURM launcher would submit for the 8-node preset, from submitit itself;
- a sweep of 8 jobs, 2 at a time (hydra's joblib launcher), one of them SIGKILLed mid-way: the table
  names every job, and running the same sweep again skips the finished jobs and resumes the killed one.

All of it starts `launch.py` in subprocesses from a folder in tmp_path, with the test session's caches.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlhf.launch.slurm import compose_with_hydra, sbatch_script
from tests.conftest import ROOT, clean_env, run_cli

# A tiny SFT job (tiny-llama, hardware=cpu: one rank, torch_threads=1): seconds of training.
TINY = ["data.max_eval_samples=32", "logging.progress_bar=false", "step.save_model=false"]


def _table(sweep: Path) -> dict[str, dict]:
    """results.csv of a sweep, by job folder."""
    with open(sweep / "results.csv") as f:
        return {row["job"]: row for row in csv.DictReader(f)}


# ------------------------------------------------------------------ submitit, executed
def test_a_job_runs_through_submitit_in_a_process_of_its_own(tmp_path):
    """hydra/launcher=slurm_local: the SLURM launcher's settings on submitit's local executor. The
    job is pickled, run by `python -u -m submitit.core._submit` in a process submitit starts (with
    the interpreter of the submitting process, here the venv's: run_cli uses sys.executable), and its
    result comes back through submitit's result pickle to Hydra, which writes the sweep's table."""
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "hydra/launcher=slurm_local", "step.max_steps=10", *TINY, f"hydra.sweep.dir={sweep}",
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # The run directory, as a one-machine run writes it.
    job = sweep / "0"
    assert (job / "config.yaml").exists(), sorted(p.name for p in job.iterdir())
    final = json.loads((job / "final_metrics.json").read_text())
    assert final["step"] == 10 and final["stopped_by"] == "the cap step.max_steps=10"
    logged = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 10 and any("loss" in row for row in logged)
    result = json.loads((job / "metrics.json").read_text())
    assert result["status"] == "ok" and result["value"] == final["eval/ppl"]
    assert _table(sweep)["0"]["status"] == "ok"

    # submitit's own records: one job folder named by its id (the local job's controller pid), the
    # job's output in its log (not in the output of the process that submitted it), and the result
    # pickle Hydra read back.
    folders = [p for p in (sweep / ".submitit").iterdir() if p.name != "%j"]
    assert len(folders) == 1, folders
    job_id = folders[0].name
    log = (folders[0] / f"{job_id}_0_log.out").read_text()
    assert "[sft] done" in log and "Job completed successfully" in log, log[-3000:]
    assert "[sft] done" not in proc.stdout
    with open(folders[0] / f"{job_id}_0_result.pkl", "rb") as f:
        outcome, job_return = pickle.load(f)
    assert outcome == "success", job_return  # on failure the pickle holds the job's traceback
    assert job_return.status.name == "COMPLETED" and job_return.return_value == result["value"]


def test_sbatch_script_of_the_8_node_preset(tmp_path):
    """The script submitit's SlurmExecutor writes for experiment=opt-66b_64xa100-80g
    hydra/launcher=slurm (rlhf.launch.slurm maps hydra.launcher as the hydra-submitit-launcher plugin does):
    8 nodes, 1 task per node, 8 GPUs per node, the time limit, and the command srun runs."""
    sweep = tmp_path / "sweep"
    overrides = ["experiment=opt-66b_64xa100-80g", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}"]
    script = sbatch_script(compose_with_hydra([*overrides, "hydra.launcher.partition=gpu"]))
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for flag in ("--nodes=8", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=1440", "--partition=gpu",
                 "--job-name=launch", "--signal=USR2@120"):
        assert f"#SBATCH {flag}" in lines, f"#SBATCH {flag} missing from:\n{script}"
    # The job the script runs: submitit unpickles the Hydra job from the sweep's .submitit folder and
    # runs it with the submitting interpreter, under srun (so once per task: 8 tasks, one per node).
    folder = sweep / ".submitit" / "%j"
    assert lines[-1] == (f"srun --unbuffered --output {folder}/%j_%t_log.out --error {folder}/%j_%t_log.err "
                         f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {folder}"), script
    assert not any(tmp_path.iterdir()), "a preview writes nothing"

    # A sweep of 3 such jobs is one job array, with at most array_parallelism of them running at once.
    array = sbatch_script(compose_with_hydra([*overrides, "hydra.launcher.array_parallelism=2"]), jobs=3)
    assert "#SBATCH --array=0-2%2" in array.splitlines(), array

    # The preview a user runs prints the same script, and names the tasks srun starts.
    proc = run_cli(*overrides, "hydra.launcher.partition=gpu", module="rlhf.launch.slurm", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == script
    assert "in each of its 8 task(s)" in proc.stderr


# ------------------------------------------------------------------ load and a killed job
def _holds_open(proc: psutil.Process, path: Path) -> bool:
    try:
        return any(Path(f.path) == path for f in proc.open_files())
    except psutil.Error:  # the process ended meanwhile
        return False


def _max_concurrent(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def test_the_table_names_jobs_that_stopped_or_never_started(tmp_path):
    """A sweep stopped early: one job finished, one was killed after a checkpoint, two never started.
    The planned jobs come from the sweep's config as Hydra's basic sweeper expands it (its params,
    then the command line), and the table has a row for each of the four."""
    from omegaconf import OmegaConf

    from rlhf.launch.sweep import collect, planned_jobs, write_result, write_tables

    config = OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": {"optim.lr": "1e-3,3e-3"}},
        "overrides": {"task": ["seed=1,2", "step.max_steps=5"]}}})
    planned = planned_jobs(config)
    assert planned == [["optim.lr=0.001", "seed=1", "step.max_steps=5"], ["optim.lr=0.001", "seed=2", "step.max_steps=5"],
                       ["optim.lr=0.003", "seed=1", "step.max_steps=5"], ["optim.lr=0.003", "seed=2", "step.max_steps=5"]]
    write_result(tmp_path / "0", "ok", "sft", planned[0], {"eval/ppl": 3.0}, 1.0)
    killed = tmp_path / "1"
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(planned[1])))
    (killed / "checkpoints").mkdir()
    (killed / "checkpoints" / "latest").write_text("step_00000020")

    rows = collect(tmp_path, planned)
    assert [(r["job"], r["status"], r["overrides"]) for r in rows] == [
        ("0", "ok", planned[0]), ("1", "incomplete", planned[1]),
        ("", "not started", planned[2]), ("", "not started", planned[3])]
    assert "last checkpoint checkpoints/step_00000020" in rows[1]["error"]
    write_tables(rows, tmp_path)
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["status"] for r in table] == ["ok", "incomplete", "not started", "not started"]
    assert table[0]["objective (eval/ppl, min)"] == "3"


@pytest.mark.slow  # 40 s alone on 2 cores, about 2 min beside other tests: 8 jobs on both cores, then the rerun
def test_sweep_of_8_jobs_2_at_a_time_survives_a_killed_job_by_a_rerun(tmp_path):
    """hydra/launcher=joblib with n_jobs=2 runs 8 tiny SFT jobs two at a time. The last job's process
    is SIGKILLed once its first checkpoint is on disk. Today that stops the whole multirun (joblib's
    process pool breaks: TerminatedWorkerError, and the job running beside it dies too), yet the
    results table still names every job. The same command run again skips every finished job and
    resumes the killed one from its checkpoint: all 8 end ok."""
    sweep, cwd = tmp_path / "sweep", tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, str(ROOT / "launch.py"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
           "optim.lr=1e-3,3e-3", "seed=1,2,3,4", "step.max_steps=100", "checkpoint.every_steps=20", *TINY,
           f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"]
    env = clean_env(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    target = sweep / "7"  # the last job (optim.lr=0.003 seed=4): the other 7 start before it

    with open(tmp_path / "first.out", "w") as out, open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
        killed_at, deadline = None, time.monotonic() + 600
        while first.poll() is None and time.monotonic() < deadline:
            if killed_at is None and (target / "checkpoints" / "latest").exists():
                # The job's process: the one with the job's Hydra log open (jobs run in-process there).
                victims = [p for p in psutil.Process(first.pid).children(recursive=True)
                           if _holds_open(p, target / "launch.log")]
                assert len(victims) == 1, f"one process runs job 7, found {victims}"
                assert not (target / "final_metrics.json").exists(), "job 7 finished before it could be killed"
                victims[0].kill()
                killed_at = time.time()
            time.sleep(0.02)
        if first.poll() is None:
            first.kill()
            pytest.fail("the first sweep did not end within 10 minutes")
    stdout, stderr = (tmp_path / "first.out").read_text(), (tmp_path / "first.err").read_text()
    assert killed_at is not None, f"job 7 never wrote a checkpoint:\n{stderr[-3000:]}"
    assert first.returncode != 0 and "TerminatedWorkerError" in stderr, (
        "a killed job no longer stops the joblib multirun: update this test (the table's expectations too)\n"
        + stderr[-3000:])

    # The table written as the sweep stopped names all 8 jobs: none was left unstarted (job 7 was the
    # last), the killed one is incomplete with its checkpoint, the rest finished (or died beside it).
    rows = _table(sweep)
    assert sorted(rows) == [str(i) for i in range(8)], rows.keys()
    assert rows["7"]["status"] == "incomplete" and "checkpoints/step_" in rows["7"]["error"], rows["7"]
    assert {r["status"] for r in rows.values()} <= {"ok", "incomplete"}, rows
    done = [job for job, r in rows.items() if r["status"] == "ok"]
    assert len(done) >= 5, rows
    assert "[sweep] the sweep stopped before all its jobs returned" in stdout

    # Two at a time, never more: a job runs from Hydra writing its .hydra/ folder to its result file.
    spans = [((sweep / j / ".hydra" / "overrides.yaml").stat().st_mtime, (sweep / j / "metrics.json").stat().st_mtime)
             for j in done]
    assert _max_concurrent(spans) == 2, spans
    kept = {j: (sweep / j / "metrics.json").read_bytes() for j in done}

    again = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = _table(sweep)
    assert sorted(rows) == [str(i) for i in range(8)] and all(r["status"] == "ok" for r in rows.values()), rows
    # The finished jobs were skipped, not trained again: their result files are untouched.
    assert again.stdout.count("finished before; skipping") == len(done), again.stdout[-3000:]
    assert {j: (sweep / j / "metrics.json").read_bytes() for j in done} == kept
    # The killed job resumed: its metrics.jsonl kept the rows logged before the kill (a fresh start
    # rewrites the file) and goes on to the last step after it.
    logged = [json.loads(line) for line in (target / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["step"] == 0 and logged[0]["time"] < killed_at, logged[:3]
    assert logged[-1]["step"] == 100 and logged[-1]["time"] > killed_at, logged[-3:]
    assert json.loads((target / "final_metrics.json").read_text())["step"] == 100
    assert "[sft] resumed at step" in again.stdout
