"""The sbatch script that `python launch.py -m hydra/launcher=slurm ...` would submit, built by
submitit's own SlurmExecutor from the composed hydra.launcher config, and printed without submitting
anything (no SLURM needed): check nodes, GPUs, time limit and partition before queueing a job.

    python -m rlhf.launch.slurm experiment=opt-66b_64xa100-80g hydra.launcher.partition=gpu

The parameters reach submitit as hydra-submitit-launcher's BaseSubmititLauncher.launch passes them
(hydra_plugins/hydra_submitit_launcher/submitit_launcher.py): the executor folder and
max_num_timeout to the executor, the keys shared by every executor (BaseQueueConf's: nodes,
gpus_per_node, tasks_per_node, timeout_min, name, ...) renamed to sbatch's by submitit, the SLURM
keys (partition, account, additional_parameters, ...) as they are.

What the script runs: `srun ... python -u -m submitit.core._submit FOLDER`, which unpickles the
Hydra job (launch.py with the job's overrides) and runs it in every srun task, that is
nodes x tasks_per_node times.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf
from submitit.slurm.slurm import SlurmExecutor


class _PreviewExecutor(SlurmExecutor):
    """submitit's SlurmExecutor where no srun is installed: the same parameter checks and sbatch
    text, and no way to submit."""

    @classmethod
    def affinity(cls) -> int:
        return 1  # SlurmExecutor refuses to be built without srun on PATH

    def _submit_command(self, command: str):
        raise RuntimeError("rlhf.launch.slurm only previews the sbatch script; submit with python launch.py -m hydra/launcher=slurm")


def compose_with_hydra(overrides: list[str]) -> DictConfig:
    """The config `python launch.py -m <overrides>` composes, with its hydra node (hydra.launcher,
    hydra.sweep.dir, hydra.job.name as launch.py gets them). hydra/launcher=slurm unless another
    launcher is given."""
    from hydra import compose, initialize_config_dir

    from rlhf.config import PROJECT_ROOT, quote_numeric_groups, register_configs

    register_configs()
    if not any(o.split("=", 1)[0].lstrip("+~") == "hydra/launcher" for o in overrides):
        overrides = ["hydra/launcher=slurm", *overrides]
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), job_name="launch", version_base=None):
        return compose("config", overrides=quote_numeric_groups(overrides), return_hydra_config=True)


def executor_parameters(cfg: DictConfig) -> tuple[str, int, dict[str, Any]]:
    """(submitit folder, max_num_timeout, SlurmExecutor parameters) of the composed hydra.launcher,
    mapped as the hydra-submitit-launcher plugin maps them for submitit.AutoExecutor(cluster="slurm")."""
    from hydra.utils import get_class
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    node = cfg.hydra.launcher
    if not str(node.get("_target_", "")).endswith(".SlurmLauncher"):
        raise ValueError(f"hydra.launcher is {node.get('_target_')}, not the SLURM launcher: add hydra/launcher=slurm")
    # The plugin's own constructor resolves the keys (interpolations into the hardware preset included).
    launcher = get_class(node._target_)(**{k: node[k] for k in node if k != "_target_"})
    params = dict(launcher.params)
    folder, max_num_timeout = params.pop("submitit_folder"), params.pop("max_num_timeout")
    # AutoExecutor.update_parameters: None means unset; BaseQueueConf's keys are submitit's shared
    # names, renamed for sbatch (timeout_min -> time, tasks_per_node -> ntasks_per_node, name -> job_name).
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    params = {k: v for k, v in params.items() if v is not None}
    converted = _PreviewExecutor._equivalence_dict()
    return folder, max_num_timeout, {converted.get(k, k) if k in shared else k: v for k, v in params.items()}


def sbatch_script(cfg: DictConfig, jobs: int = 1) -> str:
    """The sbatch script submitit writes for ``cfg`` (composed with its hydra node, e.g. by
    ``compose_with_hydra``); ``jobs`` > 1: the job array a sweep of that many jobs is submitted as."""
    folder, max_num_timeout, params = executor_parameters(cfg)
    executor = _PreviewExecutor(folder, max_num_timeout=max_num_timeout)
    executor.update_parameters(**params)  # submitit's checks: an unknown key or a bad value fails here
    if jobs > 1:
        executor.parameters["map_count"] = jobs  # as SlurmExecutor._internal_process_submissions does
    return executor._make_submission_file_text(executor._submitit_command_str, uid="preview")


def main(argv: list[str]) -> None:
    cfg = compose_with_hydra(argv)
    print(sbatch_script(cfg), end="")
    tasks = cfg.hydra.launcher.nodes * cfg.hydra.launcher.tasks_per_node
    print(f"# preview only, nothing submitted. srun runs the pickled Hydra job (launch.py {' '.join(argv)}) "
          f"in each of its {tasks} task(s) (nodes x tasks_per_node).", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
