"""The only Hydra entry point: compose the run from conf/, then hand it to rlhf.launch.run.

    python launch.py                                   # the SFT step (make run: pipeline=e2e)
    python launch.py step=sft model=tiny-llama zero=3 optim.lr=3e-4
    python launch.py -m sweep=sft_lr_zero              # a sweep: results table and plot at the end
    python launch.py --dry-run experiment=opt-1.3b_a6000   # what would run, nothing launched (launch.dry_run=true)
    python launch.py --help                            # every config group and its options
"""

import math
import sys
import time
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rlhf.config import ConfigError, check_command_line, quote_numeric_groups

# The command as the user typed it, for the run directory, before numeric group names are quoted.
COMMAND = [sys.executable, *sys.argv]


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rlhf.launch import run, sweep

    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    run_dir = Path(cfg.run_dir or hc.runtime.output_dir)
    step = cfg.step.name
    if multirun and (done := sweep.finished(run_dir)):
        print(f"[sweep] job {hc.job.num} ({' '.join(overrides)}) finished before; skipping", flush=True)
        return done["value"]
    start = time.perf_counter()
    try:
        final = run(cfg, overrides=overrides, command=COMMAND)
    except ConfigError as err:
        # A user error: one clear line, no traceback wall. In a sweep it fails this job only.
        print(f"{err.kind} error: {err}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        sweep.write_result(run_dir, "failed", step, overrides, None, time.perf_counter() - start, f"{err.kind} error: {err}")
        FAILED_JOBS.append((" ".join(overrides), 2))
        return math.nan
    except Exception as err:  # noqa: BLE001 - a sweep records any failure and goes on to the next job
        if not multirun:
            raise
        traceback.print_exc()
        sweep.write_result(run_dir, "failed", step, overrides, None, time.perf_counter() - start,
                           f"{type(err).__name__}: {err}")
        FAILED_JOBS.append((" ".join(overrides), 1))
        return math.nan
    if cfg.launch.dry_run:
        return dry_run_verdict(final, run_dir, step, overrides, multirun, time.perf_counter() - start)
    result = sweep.write_result(run_dir, "ok", step, overrides, final, time.perf_counter() - start)
    return result["value"]


REFUSED_JOBS: list[str] = []  # dry-run jobs of this multirun whose real run would not start
# Jobs of this multirun that failed, with the exit code each would have had alone (2: a user error).
FAILED_JOBS: list[tuple[str, int]] = []


def dry_run_verdict(final: dict, run_dir: Path, step: str, overrides: list[str], multirun: bool, wall_s: float) -> float:
    """The dry-run's last line: would the real run start? A run that would be refused or would not fit
    exits 2, so that scripts and sweeps do not take the printout for a yes. In a sweep each job's
    verdict goes to the results table (status dry-run) and the sweep exits 2 at the end."""
    from rlhf.launch import sweep

    refused = final.get("refused", [])
    line = ("dry-run: the real run would be refused: " + "; ".join(refused) if refused
            else "dry-run: the real run would start (it fits, nothing refused)")
    if lacks := final.get("this_machine"):  # the plan is for the target machine; this one is said apart
        line += f"; on this machine it would be refused ({len(lacks)} reason(s) above, 'on this machine:')"
    print(line, flush=True)
    if not multirun:
        if refused:
            sys.exit(2)
        return math.nan
    sweep.write_result(run_dir, "dry-run", step, overrides, None, wall_s, line.removeprefix("dry-run: "))
    if refused:
        REFUSED_JOBS.append(" ".join(overrides))
    return math.nan


def job_config_asked(args: list[str]) -> bool:
    """`--cfg job` (or `-c job`) alone, without a package or a multirun: printed here, not by Hydra."""
    flags = [a for a in args if a.startswith("-")]
    return any(a in ("--cfg", "-c") and i + 1 < len(args) and args[i + 1] == "job" for i, a in enumerate(args)) \
        and set(flags) <= {"--cfg", "-c"}


def job_config(args: list[str]) -> str:
    """What `--cfg job` prints: the composed config, as Hydra prints it, less the chain's per-step
    blocks (pipeline.<step>) that nothing sets: each is every key of a run, all null."""
    from omegaconf import OmegaConf

    from rlhf.config import compose_config

    overrides = [a for i, a in enumerate(args) if not a.startswith("-") and not (i and args[i - 1] in ("--cfg", "-c"))]
    node = OmegaConf.to_container(compose_config(overrides), resolve=False)

    def set_only(tree):
        if not isinstance(tree, dict):
            return tree
        kept = {k: set_only(v) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {}}

    pipeline = node.get("pipeline", {})
    for name in [k for k, v in pipeline.items() if isinstance(v, dict) and k != "stages"]:
        pipeline[name] = set_only(pipeline[name])
        if not pipeline[name]:
            del pipeline[name]
    return OmegaConf.to_yaml(OmegaConf.create(node))


def optuna_dry_run(args: list[str]) -> list[str]:
    """A dry-run of an Optuna sweep is the dry-run of its base config, once: its trials are points the
    study has not drawn yet, and a trial without an objective fails the study's end. The other sweeps
    dry-run every job."""
    from rlhf.config import compose_config

    multirun_flags = {"-m", "--multirun"}
    plain = [a for a in args if a not in multirun_flags]
    try:
        sweeper = compose_config(plain, with_hydra=True).hydra.sweeper.get("_target_", "")
    except Exception:  # noqa: BLE001 - a wrong override is reported by the run itself, in its own words
        return args
    if "optuna" not in sweeper.lower():
        return args
    print("dry-run of an Optuna sweep: the pre-flight of its base config, once (each trial differs only in "
          "hydra.sweeper.params)", flush=True)
    return plain


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        from rlhf.launch import usage

        print(usage())
        sys.exit(0)
    # `--dry-run` is the flag a user types; Hydra knows only overrides, so it becomes the override.
    sys.argv[1:] = ["launch.dry_run=true" if a == "--dry-run" else a for a in sys.argv[1:]]
    # Hydra reads `zero=3` as the integer 3 and refuses it as a group choice; quote it as the
    # compose path (rlhf.config.compose_config) does.
    sys.argv[1:] = quote_numeric_groups(sys.argv[1:])
    try:  # every job of a sweep, and --cfg job, too: one line and exit 2 before Hydra starts
        check_command_line(sys.argv[1:])
    except ConfigError as err:
        print(f"{err.kind} error: {err}", file=sys.stderr)
        sys.exit(2)
    if job_config_asked(sys.argv[1:]):
        print(job_config(sys.argv[1:]), end="")
        sys.exit(0)
    if {"-m", "--multirun"} & set(sys.argv[1:]) and any(a.lower() == "launch.dry_run=true" for a in sys.argv[1:]):
        sys.argv[1:] = optuna_dry_run(sys.argv[1:])
    main()
    if FAILED_JOBS:  # the results table has each job's error; the sweep's exit code says it failed
        print(f"sweep: {len(FAILED_JOBS)} job(s) failed (the results table has each one's error): "
              + " | ".join(job for job, _ in FAILED_JOBS), file=sys.stderr)
        sys.exit(2 if all(code == 2 for _, code in FAILED_JOBS) else 1)
    if REFUSED_JOBS:
        print(f"dry-run: {len(REFUSED_JOBS)} job(s) of the sweep would be refused: " + " | ".join(REFUSED_JOBS),
              file=sys.stderr)
        sys.exit(2)
