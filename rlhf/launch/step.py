"""Executing one step's plan (rlhf.preflight.plan): refuse it or record it in the run directory, then run the
step in this process (one rank) or start its ranks through the DeepSpeed launcher (rlhf.launch.processes).
Called by rlhf.launch for a single step and by rlhf.chain.pipeline for each step of a chain.

    python launch.py step=sft model=tiny-llama zero=3         # rlhf.launch.run -> run_step
    python launch.py step=ppo launch.dry_run=true              # the plan printed, nothing run
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig

from rlhf.config import Config, ConfigError
from rlhf.launch.processes import earlier_launch, launch_ranks, slurm_hostfile, slurm_node
from rlhf.launch.provenance import refuse_changed_settings, start_over, write_run_dir
from rlhf.preflight.forecast import duration
from rlhf.preflight.plan import Plan, build_plan
from rlhf.preflight.probes import check_launchable, machine_problems


def write_forecast(plan: Plan) -> None:
    """Say the step's forecast in one line and keep it in RUN_DIR/forecast.json with the time it
    started, so the final figures can put forecast and actual side by side."""
    name, f = plan.schema.step.name, plan.forecast
    if f is None:
        print(f"[{name}] no forecast: {plan.no_forecast}", flush=True)
        return
    startup = f.phases.get("start-up", 0.0)
    per_step = (f.seconds - startup) / max(f.steps, 1)
    money = f", ${f.cost:,.2f}" if f.cost is not None else ""
    print(f"[{name}] forecast: {duration(f.seconds)} for {f.steps:,} steps "
          f"({per_step:.3g} s each) on {f.devices} device(s){money}", flush=True)
    (plan.run_dir / "forecast.json").write_text(json.dumps({"started_at": time.time(), "seconds_per_step": per_step, "startup_s": startup,
                                                            **f.as_dict()}, indent=2))


def starts_ranks(schema: Config) -> bool:
    """Whether this process starts the ranks (several of them, and it is not itself one)."""
    from rlhf.worker import launched_as_a_rank

    return schema.world_size > 1 and not launched_as_a_rank()


def prepare_plan(cfg: DictConfig, plan: Plan, overrides: list[str], command: list[str]) -> dict | None:
    """Everything before the ranks start: the plan's refusals, the machine's checks, the run
    directory. Returns the final metrics of a step that finished before (resume=auto), else None."""
    schema, run_dir = plan.schema, plan.run_dir
    plan.refuse()
    check_launchable(schema)
    done = run_dir / "final_metrics.json"
    if schema.resume == "never":
        start_over(run_dir)
    refuse_changed_settings(run_dir, cfg, "a run")
    if schema.resume == "auto" and done.exists():
        print(f"[{schema.step.name}] {run_dir} finished before ({done.name}); nothing to do "
              "(resume=never starts it over)", flush=True)
        return json.loads(done.read_text())
    write_run_dir(cfg, run_dir, overrides, command)
    write_forecast(plan)
    if starts_ranks(schema):
        if schema.hardware.nodes > 1 and not schema.launch.hostfile:
            slurm_node(schema, slurm_hostfile(schema, run_dir))
        from rlhf.models import resolve_path

        resolve_path(schema.model)  # once here, not once per rank (a hub id or folder costs nothing)
    return None


def run_step(cfg: DictConfig, schema: Config, overrides: list[str], command: list[str]) -> dict:
    """The plan -> the dry-run's printout, or the run directory and the step on every rank.
    ``cfg.run_dir`` is already resolved."""
    plan = build_plan(schema, Path(schema.run_dir))
    if schema.launch.dry_run:
        if schema.resume != "never":  # a finished or started run of other settings is refused alike
            try:
                refuse_changed_settings(Path(schema.run_dir), cfg, "a run")
            except ConfigError as err:
                plan.problems.append(str(err))
        print(plan.text(), flush=True)
        # It plans for the target machine; what this one lacks is said apart from the verdict.
        lacks = machine_problems(schema) + (earlier_launch(Path(schema.run_dir), schema.world_size)
                                            if starts_ranks(schema) else [])
        for line in lacks:
            print(f"on this machine: {line}", flush=True)
        return {**plan.dry_run_result(), "this_machine": lacks}
    if (done := prepare_plan(cfg, plan, overrides, command)) is not None:
        return done
    if starts_ranks(schema):
        return launch_ranks(schema, [plan.run_dir])[0]
    from rlhf.worker import main

    return main(schema)
