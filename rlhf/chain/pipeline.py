"""A chain of steps: SFT -> reward model -> PPO (or SFT -> DPO), each step's output feeding the next.

Each step is composed by Hydra as if run alone: ``step=<name>``, the chain's stage files for it
(``pipeline.stages.<name>``: YAML deltas under conf/stage/), the command line's overrides, and last
the chain's typed per-step delta (``pipeline.<name>``, e.g. ``pipeline.ppo.step.epochs=1``). Every
step is composed and checked before the first one trains, so a typo or a refusal in the PPO step
stops the chain before SFT spends its time. Each step runs in its own folder under the chain's run
directory and is recorded in ``manifest.json``; a step whose finished output is already there is
skipped, so a rerun resumes at step level. At the end a table of time per step, like
DeepSpeed-Chat's "Finished Step 1 in 0:12:21".

    python launch.py pipeline=e2e
    python launch.py pipeline=e2e pipeline.ppo.step.epochs=1 seed=2
    python launch.py pipeline=dpo
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf.chain.readiness import RUN_ANYWAY, weak_step
from rlhf.config import STEPS, Config, ConfigError, compose_config, role_models, step_roles, to_schema
from rlhf.files import write_whole
from rlhf.launch import step as launch_step
from rlhf.launch.processes import launch_ranks
from rlhf.launch.provenance import (
    changed_settings,
    flat_keys,
    refuse_changed_settings,
    shown_changes,
    start_over,
    write_run_dir,
)
from rlhf.preflight.plan import build_plan, shaped_as_built

# Overrides the chain decides itself; the command line's versions of these are not passed on.
# Role paths typed on the command line are passed on and win over the chain's own outputs.
_CHAIN_KEYS = ("pipeline", "step=", "run_dir=", "hydra.")


def is_chain(cfg: DictConfig) -> bool:
    return bool(cfg.get("pipeline") and cfg.pipeline.steps)


def title(name: str, chain) -> str:
    """A step's title in its chain: its place there and what it trains (Step 2 (PPO) in SFT -> PPO)."""
    chain = list(chain)
    return f"Step {chain.index(name) + 1} ({STEPS[name].label})" if name in chain else STEPS[name].title


def finished(step_dir: Path) -> bool:
    """A step is finished when its final metrics were written after its model was saved."""
    return (step_dir / "final_metrics.json").exists() and (step_dir / "model" / "config.json").exists()


def set_leaves(delta: DictConfig) -> dict:
    """The keys a typed per-step delta really sets (its unset leaves are None)."""
    def prune(node):
        if isinstance(node, dict):
            kept = {k: prune(v) for k, v in node.items()}
            return {k: v for k, v in kept.items() if v is not None and v != {}}
        return node

    return prune(OmegaConf.to_container(delta, resolve=True))


def step_overrides(cfg: DictConfig, name: str, overrides: list[str], outputs: dict[str, str],
                   chain_dir: Path) -> list[str]:
    """What `python launch.py ...` would take to run this step of the chain alone."""
    extra = [f"step={name}"]
    if stages := list(cfg.pipeline.stages.get(name, [])):
        extra.append(f"+stage=[{','.join(stages)}]")
    inputs = []
    for key, source, flag in STEPS[name].chain_inputs:  # earlier steps' outputs, as the spec says
        if source in outputs and (flag is None or cfg.pipeline[flag]):
            inputs += [f"{key}={outputs[source]}"] + (["model.random_init=false"] if key == "model.path" else [])
    base = [o for o in overrides if not o.lstrip("+~").startswith(_CHAIN_KEYS)]
    # Stage files first, the command line after: what the user typed wins, except over the earlier
    # steps' outputs: a model.path typed for the chain is where its first step starts, and the reward
    # model still starts from SFT's output (pipeline.<step>.model.path sets one step's own). The
    # step's own config is never a chain, whatever an experiment file says.
    return [*extra, *base, *inputs, "pipeline.steps=[]", f"run_dir={chain_dir / name}"]


def step_config(cfg: DictConfig, name: str, overrides: list[str], outputs: dict[str, str],
                chain_dir: Path) -> tuple[DictConfig, list[str], dict]:
    """The composed config of one step of the chain: its overrides composed, then its delta merged."""
    args = step_overrides(cfg, name, overrides, outputs, chain_dir)
    step_cfg = compose_config(args)
    delta = set_leaves(cfg.pipeline[name])
    if delta:
        step_cfg = OmegaConf.merge(step_cfg, delta)
    return step_cfg, args, delta


def run_chain(cfg: DictConfig, schema: Config, overrides: list[str], command: list[str]) -> dict:
    chain_dir = Path(schema.run_dir)
    steps = chain = list(schema.pipeline.steps)
    # `step=ppo` on the command line of a chain (an experiment file) runs that one step of it.
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("step=")]
    if chosen:
        steps = [s for s in steps if s in chosen]
    # Every output where it will be: steps not run now feed the next from this chain's folder.
    outputs = {name: str(chain_dir / name / "model") for name in schema.pipeline.steps}
    reuse = schema.resume == "auto"  # resume=never starts every step over
    outputs = {k: v for k, v in outputs.items()
               if k in steps or schema.launch.dry_run or (reuse and finished(chain_dir / k))}

    steps, skipped = skip_unused(cfg, steps, overrides, outputs, chain_dir)
    planned, plans, will_exist = _plan_steps(cfg, schema, steps, overrides, outputs, chain_dir)
    if schema.launch.dry_run:
        return _dry_run(planned, chain_dir, will_exist, chain)

    chain_dir.mkdir(parents=True, exist_ok=True)
    write_run_dir(cfg, chain_dir, overrides, command)
    manifest_path = chain_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"steps": {}}
    manifest["skipped"] = skipped
    results: dict[str, dict] = {}
    todo = {name: entry for name, entry in planned.items() if not (reuse and finished(chain_dir / name))}
    if _one_launch(todo):
        # Several ranks: every step's run directory first, then one launch whose ranks run the steps in
        # turn -- one rendezvous and one library import for the chain instead of one per step.
        for name, (step_cfg, _, args, delta) in todo.items():
            print(f"[e2e] {title(name, chain)}: python launch.py {_shown(args, name, delta)}", flush=True)
            launch_step.prepare_plan(step_cfg, plans[name], args, command)
        first = next(iter(todo.values()))[1]
        launch_ranks(first, [chain_dir / name for name in todo])
    for name, (step_cfg, step_schema, args, delta) in planned.items():
        step_dir = chain_dir / name
        if name not in todo:
            print(f"[e2e] {title(name, chain)}: finished output at {step_dir / 'model'}; skipping", flush=True)
            entry = manifest["steps"].get(name, {})
            entry["skipped_on_rerun"] = True
        elif _one_launch(todo):
            wall = step_dir / "wall_time.json"
            entry = {"seconds": json.loads(wall.read_text())["seconds"] if wall.exists() else None,
                     "overrides": args, "delta": delta, "finished_at": dt.datetime.now().isoformat(timespec="seconds")}
        else:
            why = weak_step(schema.pipeline, name, step_schema, chain_dir, list(planned))
            if why and schema.pipeline.on_weak_step == "stop":
                write_whole(manifest_path, json.dumps(manifest, indent=2))
                raise ConfigError(f"{title(name, chain)} not started: {why}; {RUN_ANYWAY}")
            if why:
                print(f"[e2e] WARNING {title(name, chain)} may not work: {why}", flush=True)
            print(f"[e2e] {title(name, chain)}: python launch.py {_shown(args, name, delta)}", flush=True)
            start = time.perf_counter()
            # Planned again: the outputs of the steps before it exist now, so its models are sized
            # from their config.json rather than their conf/model numbers.
            launch_step.run_step(step_cfg, step_schema, args, command)
            entry = {"seconds": round(time.perf_counter() - start, 1), "overrides": args, "delta": delta,
                     "finished_at": dt.datetime.now().isoformat(timespec="seconds")}
            gc.collect()  # drop the finished step's engines before the next step builds its own
        if not (step_dir / "final_metrics.json").exists():
            raise RuntimeError(f"{title(name, chain)} ended without final_metrics.json in {step_dir}")
        results[name] = json.loads((step_dir / "final_metrics.json").read_text())
        if name in todo and (why := weak_step(schema.pipeline, name, step_schema, chain_dir, list(planned))):
            entry["warnings"] = [f"ran though it may not work (pipeline.on_weak_step=warn): {why}"]
        entry.update(run_dir=str(step_dir), output=outputs[name], metrics=results[name])
        manifest["steps"][name] = entry
        write_whole(manifest_path, json.dumps(manifest, indent=2))

    print(summary(planned, manifest, results, outputs, chain), flush=True)
    return {"outputs": {k: outputs[k] for k in planned},
            **{f"{k}/{m}": v for k, r in results.items() for m, v in r.items() if isinstance(v, int | float)}}


def _plan_steps(cfg: DictConfig, schema: Config, steps: list[str], overrides: list[str], outputs: dict[str, str],
                chain_dir: Path) -> tuple[dict, dict, dict]:
    """Every step composed and checked before the first one trains: {step: (config, schema, overrides,
    delta)}, {step: its plan} for each step that will run now (a dry-run plans at printing), and the
    outputs not written yet with the model each will have the architecture of (build_plan's will_exist)."""
    reuse = schema.resume == "auto" and not schema.launch.dry_run
    planned, plans, again = {}, {}, {}
    # An output of a step not run now stands for the chain's model; each step run now, for what it trains.
    will_exist = {path: schema.model for path in outputs.values()}
    for name in steps:
        step_cfg, args, delta = step_config(cfg, name, overrides, outputs, chain_dir)
        step_schema = to_schema(step_cfg)
        step_schema.run_dir = str(chain_dir / name)
        if reuse and (why := _train_again(chain_dir / name, step_cfg, delta, again, schema.pipeline.steps)):
            again[name] = why
        if not schema.launch.dry_run and (name in again or not (reuse and finished(chain_dir / name))):
            plans[name] = build_plan(step_schema, chain_dir / name, will_exist=will_exist, keys=f"pipeline.{name}.")
            plans[name].refuse()
        if name in outputs:
            will_exist[outputs[name]] = role_models(shaped_as_built(step_schema, will_exist))[0]
        planned[name] = (step_cfg, step_schema, args, delta)
    for name, why in again.items():  # only once every step is planned: a refusal leaves the folder as it was
        print(f"[e2e] {title(name, schema.pipeline.steps)}: trained again from the start: {why}", flush=True)
        start_over(chain_dir / name)
    return planned, plans, will_exist


def _train_again(step_dir: Path, step_cfg: DictConfig, delta: dict, again: dict[str, str], chain) -> str | None:
    """Why a step that already ran in ``step_dir`` must train again, if it must: the chain's per-step
    settings for it changed (``pipeline.<step>.*``, what every printed fix sets), or a step before it
    trains again (its input changes). Any other difference (seed, data, model, ...) makes it another
    experiment, refused, so that a finished chain is never overwritten by mistake."""
    changes = changed_settings(step_dir, step_cfg)
    if changes and not set(changes) <= set(flat_keys(delta)):
        refuse_changed_settings(step_dir, step_cfg, f"the chain's {title(step_dir.name, chain)}", changes)
    if changes:
        return f"its settings changed ({shown_changes(changes)})"
    if again and (finished(step_dir) or (step_dir / "checkpoints").exists()):
        return f"it reads {title(next(iter(again)), chain)}'s output, which is trained again"
    return None


def _dry_run(planned: dict, chain_dir: Path, will_exist: dict, chain: list[str]) -> dict:
    """Each step's plan printed, and the chain's verdict: it starts only if every step would."""
    verdicts = {}
    for name, (_, step_schema, _, _) in planned.items():
        plan = build_plan(step_schema, chain_dir / name, will_exist=will_exist, keys=f"pipeline.{name}.")
        print(plan.text(), flush=True)
        verdicts[name] = plan.dry_run_result()
    return {"dry_run": True, "fits": all(v["fits"] for v in verdicts.values()),
            "refused": [f"{title(n, chain)}: {why}" for n, v in verdicts.items() for why in v["refused"]]}


def skip_unused(cfg: DictConfig, steps: list[str], overrides: list[str], outputs: dict[str, str],
                chain_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The chain's steps without a reward model that nothing downstream would use: PPO rewarded by the
    rule alone (step.reward_model_weight=0) with a critic-free estimator reads neither its score
    nor its weights (the critic starts from them). Also returns why each left-out step was left out."""
    # The reward model's step: the one whose output a later step takes as its critic (and scorer).
    rm_step = next((src for s in steps if (src := STEPS[s].source_of("critic.path")) in steps), None)
    # The steps that take its output (their spec's chain_inputs): it is skipped only where each of them
    # builds neither a critic (which starts from it) nor a reward model.
    readers = [s for s in steps if any(source == rm_step for _, source, _ in STEPS[s].chain_inputs)]
    if rm_step is None or not readers:
        return steps, {}
    built = {s: to_schema(step_config(cfg, s, overrides, outputs, chain_dir)[0]) for s in readers}
    if any({r.name for r in step_roles(schema)} & {"critic", "reward"} for schema in built.values()):
        return steps, {}
    reader, policy = next(iter(built.items()))
    why = (f"{STEPS[reader].label}'s reward is the rule alone (step.reward_model_weight=0) and "
           f"{policy.step.advantage_estimator} builds no critic, so nothing would use a reward model")
    print(f"[e2e] {title(rm_step, cfg.pipeline.steps)}: skipped: {why}", flush=True)
    outputs.pop(rm_step, None)
    return [s for s in steps if s != rm_step], {rm_step: why}


def _figure(metrics: dict, key: str, label: str, percent: bool = True) -> str | None:
    """``label before -> after`` of one final figure (the step's first and last evaluation)."""
    if key not in metrics:
        return None
    show = (lambda v: f"{100 * v:.1f}%") if percent else (lambda v: f"{v:.3f}")
    before = metrics.get(f"{key}_before")
    return f"{label} {show(before)} -> {show(metrics[key])}" if before is not None else f"{label} {show(metrics[key])}"


def summary(planned, manifest: dict, results: dict, outputs: dict, chain: list[str]) -> str:
    """The chain's closing block: each step's time and figures, every warning, where the outputs
    are, and what to try next."""
    lines = ["[e2e] " + "-" * 60]
    warnings = []
    for name in planned:
        entry, metrics = manifest["steps"][name], results.get(name, {})
        took = str(dt.timedelta(seconds=round(entry.get("seconds") or 0)))
        figures = [f for key, label, pct in STEPS[name].summary if (f := _figure(metrics, key, label, pct))]
        if metrics.get("lr_drops"):  # SFT's loss plateaus short of its accuracy bar (step.plateau_lr_drops)
            figures.append(f"learning rate lowered {int(metrics['lr_drops'])} time(s) on a loss plateau, to "
                           f"{metrics['lr_peak']:.3g}")
        rerun = " (earlier run)" if entry.get("skipped_on_rerun") else ""
        guess = (f" (forecast {dt.timedelta(seconds=round(metrics['forecast_s']))})"
                 if "forecast_s" in metrics and not rerun else "")
        lines.append(f"[e2e] {title(name, chain)}, {took}{guess}{rerun}: " + ("; ".join(figures) or "done"))
        warnings += [f"{name}: {w}" for w in [*entry.get("warnings", []), *metrics.get("warnings", [])]]
    lines += [f"[e2e] {title(name, chain)}: skipped: {why}" for name, why in manifest.get("skipped", {}).items()]
    lines += [f"[e2e] WARNING {w}" for w in warnings] or ["[e2e] no warnings"]
    last = outputs[list(planned)[-1]]
    chain_dir = Path(last).parent.parent
    lines += [f"[e2e] outputs: {json.dumps({k: outputs[k] for k in planned})}",
              f"[e2e] curves: each step's curves.png; side by side: python -m rlhf.observe.report {chain_dir}",
              f"[e2e] next: python -m rlhf.chat --path {last}"]
    return "\n".join(lines)


def _shown(args: list[str], name: str, delta: dict) -> str:
    return " ".join(args) + (f"  + pipeline.{name}: {json.dumps(delta)}" if delta else "")


def _one_launch(todo: dict) -> bool:
    """Whether the steps left run in one launch of several ranks (they share the launch settings)."""
    schemas = [plan[1] for plan in todo.values()]
    if not schemas or not launch_step.starts_ranks(schemas[0]):
        return False
    return all((s.hardware, s.launch) == (schemas[0].hardware, schemas[0].launch) for s in schemas)


