"""The only Hydra entry point: compose the run from conf/, then hand it to rlhf.launch.run.

    python launch.py                                   # the SFT step (make run: pipeline=e2e)
    python launch.py step=sft model=tiny-llama zero=3 optim.lr=3e-4
    python launch.py -m sweep=sft_lr_zero              # a sweep: results table and plot at the end
    python launch.py --help                            # every config group and its options
"""

import math
import sys
import time
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rlhf.config import ConfigError, check_override_keys, quote_numeric_groups

# The command as the user typed it, for the run directory, before numeric group names are quoted.
COMMAND = [sys.executable, *sys.argv]


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rlhf import sweep
    from rlhf.launch import run

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
        return math.nan
    except Exception as err:  # noqa: BLE001 - a sweep records any failure and goes on to the next job
        if not multirun:
            raise
        traceback.print_exc()
        sweep.write_result(run_dir, "failed", step, overrides, None, time.perf_counter() - start,
                           f"{type(err).__name__}: {err}")
        return math.nan
    if cfg.launch.dry_run:
        return None
    result = sweep.write_result(run_dir, "ok", step, overrides, final, time.perf_counter() - start)
    return result["value"]


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        from rlhf.launch import usage

        print(usage())
        sys.exit(0)
    # Hydra reads `zero=3` as the integer 3 and refuses it as a group choice; quote it as the
    # compose path (rlhf.config.compose_config) does.
    sys.argv[1:] = quote_numeric_groups(sys.argv[1:])
    if not any(arg.startswith("-") for arg in sys.argv[1:]):  # one run, not a sweep or a Hydra flag
        try:
            check_override_keys(sys.argv[1:])
        except ConfigError as err:
            print(f"{err.kind} error: {err}", file=sys.stderr)
            sys.exit(2)
    main()
