"""Starting the ranks of a run of several ranks or nodes: the DeepSpeed launcher command, the
subprocess that runs it (and the shared-memory buffers its killed ranks leave), and, inside a SLURM
allocation, the hostfile and this node's part of the launch.

    deepspeed --num_nodes N --num_gpus G ... --no_local_rank --module rlhf.worker RUN_DIR/config.yaml
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rlhf.config import PROJECT_ROOT, Config, ConfigError, DataError
from rlhf.errors import DiskFullError
from rlhf.files import write_whole
from rlhf.launch import ranks


def launch_command(cfg: Config, run_dirs: list[Path]) -> list[str]:
    """The DeepSpeed launcher command that starts every rank on the resolved config(s): the ranks of
    a chain run its steps one after the other in one launch."""
    cmd = ["deepspeed", "--num_nodes", str(cfg.hardware.nodes), "--num_gpus", str(cfg.hardware.devices_per_node)]
    if cfg.launch.hostfile:
        cmd += ["--hostfile", cfg.launch.hostfile]
    if cfg.launch.master_addr:
        cmd += ["--master_addr", cfg.launch.master_addr]
    if cfg.launch.node_rank >= 0:  # this node's ranks only; the other nodes run the same command
        cmd += ["--no_ssh", "--node_rank", str(cfg.launch.node_rank)]
    cmd += ["--master_port", str(cfg.launch.master_port), "--no_local_rank", "--module", "rlhf.worker",
            *(str(d / "config.yaml") for d in run_dirs)]
    return cmd


def per_node_text(schema: Config) -> str:
    """The other way to start several nodes, for clusters without ssh between them: one command per
    node, each starting its own ranks (the DeepSpeed launcher's --no_ssh --node_rank)."""
    addr = schema.launch.master_addr or "NODE0_ADDRESS"
    return (f"launch without ssh between nodes: on node K (K = 0 .. {schema.hardware.nodes - 1}) run this command "
            f"with launch.node_rank=K launch.master_addr={addr} (the same hostfile and run_dir on a filesystem "
            f"every node sees); node K starts ranks {schema.hardware.devices_per_node}K .. "
            f"{schema.hardware.devices_per_node}K+{schema.hardware.devices_per_node - 1}")


def slurm_hostfile(schema: Config, run_dir: Path) -> list[str]:
    """Inside a SLURM allocation, its nodes (empty outside one), written as the DeepSpeed hostfile
    RUN_DIR/hostfile (through a rename: every node's task writes it, and reads it)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    write_whole(run_dir / "hostfile", "".join(f"{h} slots={schema.hardware.devices_per_node}\n" for h in hosts))
    schema.launch.hostfile = str(run_dir / "hostfile")
    return hosts


def slurm_node(schema: Config, hosts: list[str]) -> None:
    """In a SLURM job step that runs launch.py once per node (hydra/launcher=slurm: srun with one task
    per node), each task starts its own node's ranks (--no_ssh --node_rank SLURM_NODEID) with rank 0
    on the allocation's first node, instead of every task starting every node over ssh. Another
    count of tasks per node would start the ranks several times over: refused."""
    tasks, nodes = os.environ.get("SLURM_STEP_NUM_TASKS"), os.environ.get("SLURM_STEP_NUM_NODES")
    if not hosts or tasks is None or nodes is None or schema.launch.node_rank >= 0:
        return  # not in an srun step (salloc, or a batch script itself): one launcher over ssh
    if int(tasks) != int(nodes) or int(nodes) != schema.hardware.nodes:
        raise ConfigError(f"this SLURM job step runs {tasks} task(s) on {nodes} node(s), but launch.py must run once "
                          f"on each of hardware.nodes={schema.hardware.nodes} nodes (it starts that node's "
                          f"{schema.hardware.devices_per_node} ranks itself): hydra.launcher.tasks_per_node=1 and "
                          f"hydra.launcher.nodes={schema.hardware.nodes}")
    schema.launch.node_rank = int(os.environ["SLURM_NODEID"])
    schema.launch.master_addr = schema.launch.master_addr or hosts[0]
    print(f"[slurm] node {schema.launch.node_rank} of {nodes}: starting its {schema.hardware.devices_per_node} "
          f"rank(s); rank 0 on {schema.launch.master_addr}", flush=True)


def _rank_env(run_dirs: list[Path], ranks_dir: Path) -> dict[str, str]:
    """The ranks' environment: this process's, without a single-process rendezvous (tests run steps
    in-process first), with the folder the run was started in importable (a user's module named in
    the config, data.rule=my_task:score, imports as in a one-rank run: the ranks run from the project
    root), and the markers by which a rank reports its end (rlhf.launch.ranks) and leaves a user's error in
    error.json for this process to say once."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    env["RLHF_LAUNCHER"] = "1"
    env[ranks.ENV] = str(ranks_dir)
    env[ranks.LAUNCH_PID_ENV] = str(os.getpid())
    return env


def _remove_allreduce_buffers(master_port: int) -> None:
    """DeepSpeed's CPU all-reduce keeps a shared-memory buffer per rank in /dev/shm, named by the
    rendezvous port, and a rank the launcher killed never unlinks its own: once the launcher has
    returned no rank of this launch is alive, so every buffer of its port is garbage (left, they
    fill the machine's memory launch after launch)."""
    for buf in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{master_port}_*"):
        buf.unlink(missing_ok=True)


def _raise_rank_failure(cfg: Config, run_dirs: list[Path], ranks_dir: Path, code: int, seconds: float) -> None:
    """A rank that stopped on a user's error left it in error.json: the same one line and exit code
    2 as a one-rank run. Anything else is a crash, whose traceback the ranks printed already."""
    for d in run_dirs:
        if (f := d / "error.json").exists():
            err = json.loads(f.read_text())
            raise {"data": DataError, "disk": DiskFullError}.get(err["kind"], ConfigError)(err["message"])
    how = ranks.lost_ranks_report(ranks_dir, cfg.world_size)
    raise RuntimeError(f"the ranks stopped with exit code {code} after {seconds:.0f} s"
                       + (f": {how}" if how else "") + f" (their output is above; the run's files are in "
                       f"{', '.join(map(str, run_dirs))}; the same command resumes from the last checkpoint)")


def _end_with_this_process() -> None:
    """In the DeepSpeed launcher's process, before it starts: a SIGTERM when the process that started
    it dies (Linux's PR_SET_PDEATHSIG). Across nodes (pdsh) the launcher hands it on to the remote
    ranks; the ranks on this machine also watch this process themselves (rlhf.launch.ranks
    .end_with_the_launch), as the single-node launcher hands on nothing."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


# How long a launch waits for the ranks of an earlier launch of the same folder to end: a killed
# launch's ranks finish their step, save and exit on the SIGTERM they get (about a minute at most).
EARLIER_LAUNCH_WAIT_S = 120


def earlier_launch(run_dir: Path, world_size: int) -> list[str]:
    """For a dry-run's "on this machine" lines: the ranks of an earlier launch of this folder (or of the
    chain it is a step of) still running here, which the real run waits for, then refuses on."""
    for ranks_dir in (run_dir / "ranks", run_dir.parent / "ranks"):
        if alive := ranks.still_running(ranks_dir, range(world_size)):
            pids = ", ".join(f"rank {r['rank']} pid {r['pid']}" for r in alive)
            return [f"an earlier launch of {ranks_dir.parent} is still running ({pids}): the real run waits up to "
                    f"{EARLIER_LAUNCH_WAIT_S} s for it to end, then refuses; wait for it, or stop it "
                    f"(kill {alive[0]['pid']})"]
    return []


def _wait_for_an_earlier_launch(ranks_dir: Path, mine: range) -> None:
    """Wait for the ranks of an earlier launch of this folder that are still running on this machine,
    then refuse if they have not ended: two launches would write the same checkpoints and metrics."""
    deadline = time.monotonic() + EARLIER_LAUNCH_WAIT_S
    said = False
    while alive := ranks.still_running(ranks_dir, mine):
        pids = ", ".join(f"rank {r['rank']} pid {r['pid']}" for r in alive)
        if time.monotonic() > deadline:
            raise ConfigError(f"an earlier launch of {ranks_dir.parent} is still running ({pids}) after "
                              f"{EARLIER_LAUNCH_WAIT_S} s: wait for it to end, or stop it (kill {alive[0]['pid']}), "
                              "then run the same command again")
        if not said:
            print(f"waiting for an earlier launch of {ranks_dir.parent} to end ({pids})", flush=True)
            said = True
        time.sleep(1.0)


def launch_ranks(cfg: Config, run_dirs: list[Path]) -> list[dict]:
    """Run the DeepSpeed launcher over ``run_dirs`` (each holding its resolved config.yaml) and wait;
    the final metrics of each run directory, or the rank's error as this process's own."""
    cmd = launch_command(cfg, run_dirs)
    print("launching:", shlex.join(cmd), flush=True)
    # Each rank says where it ran and how it ended (rlhf.launch.ranks), so a failed launch names the lost rank.
    ranks_dir = Path(os.path.commonpath(run_dirs)) / "ranks"
    node = max(cfg.launch.node_rank, 0)
    per_node = cfg.hardware.devices_per_node
    mine = range(node * per_node, (node + 1) * per_node) if cfg.launch.node_rank >= 0 else range(cfg.world_size)
    _wait_for_an_earlier_launch(ranks_dir, mine)
    ranks.clear(ranks_dir, mine)
    for d in run_dirs:
        (d / "error.json").unlink(missing_ok=True)
    # The launcher next to this interpreter: a venv's bin/ need not be on PATH.
    runner = Path(sys.executable).parent / "deepspeed"
    exe = [str(runner)] if runner.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    started = time.monotonic()
    code = subprocess.run([*exe, *cmd[1:]], cwd=PROJECT_ROOT, env=_rank_env(run_dirs, ranks_dir),
                          preexec_fn=_end_with_this_process).returncode
    _remove_allreduce_buffers(cfg.launch.master_port)
    if code:
        _raise_rank_failure(cfg, run_dirs, ranks_dir, code, time.monotonic() - started)
    return [json.loads(f.read_text()) if (f := d / "final_metrics.json").exists() else {} for d in run_dirs]
