"""The end-to-end chain: SFT -> reward model -> PPO, each step's output feeding the next.

Each step is composed by Hydra as if run alone (the command line's overrides, then the chain's
per-step overrides from ``pipeline.<step>``), runs in its own folder under the chain's run
directory, and is recorded in ``manifest.json``. A step whose finished output is already there is
skipped, so a rerun of the same chain resumes at step level. At the end a table of time per step,
like DeepSpeed-Chat's "Finished Step 1 in 0:12:21".

    python launch.py pipeline=e2e
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig

from rlhf.config import Config

STEP_TITLES = {"sft": "Step 1 (SFT)", "reward": "Step 2 (reward model)", "ppo": "Step 3 (PPO)"}
# Overrides the chain decides itself; the command line's versions of these are not passed on.
# Role paths typed on the command line are passed on and win over the chain's own outputs.
_CHAIN_KEYS = ("pipeline", "step=", "run_dir=", "hydra.")


def finished(step_dir: Path) -> bool:
    """A step is finished when its final metrics were written after its model was saved."""
    return (step_dir / "final_metrics.json").exists() and (step_dir / "model" / "config.json").exists()


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, path)  # a crash mid-write leaves the previous manifest readable


def run_chain(schema: Config, overrides: list[str]) -> dict:
    from rlhf.launch import compose_config, run

    chain_dir = Path(schema.run_dir)
    chain_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = chain_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"steps": {}}
    base = [o.lstrip("+") for o in overrides if not o.lstrip("+~").startswith(_CHAIN_KEYS)]
    outputs: dict[str, str] = {}
    results: dict[str, dict] = {}
    steps = list(schema.pipeline.steps)
    # `step=ppo` on the command line of a chain (an experiment file) runs that one step of it.
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("step=")]
    if chosen:
        steps = [s for s in steps if s in chosen]
        for name in schema.pipeline.steps:
            # A step not run now feeds the next from its earlier output in this chain's folder.
            if name not in steps and (schema.launch.dry_run or finished(chain_dir / name)):
                outputs[name] = str(chain_dir / name / "model")
    for name in steps:
        step_dir = chain_dir / name
        extra = list(getattr(schema.pipeline, name))
        if name == "reward" and schema.pipeline.reward_from_sft and "sft" in outputs:
            extra += [f"model.path={outputs['sft']}", "model.random_init=false"]
        if name == "ppo":
            if "sft" in outputs:
                extra.append(f"actor.path={outputs['sft']}")
            if "reward" in outputs:
                extra.append(f"critic.path={outputs['reward']}")
        # An experiment file may define the chain itself; each step's own config must not be a chain.
        step_overrides = [f"step={name}", *extra, *base, "pipeline.steps=[]", f"run_dir={step_dir}"]
        if schema.launch.dry_run:
            run(compose_config(step_overrides))
            outputs[name] = str(step_dir / "model")  # where it will be: the next step is judged as it will run
            continue
        if finished(step_dir):
            print(f"[e2e] {STEP_TITLES[name]}: finished output at {step_dir / 'model'}; skipping", flush=True)
            entry = manifest["steps"].get(name, {})
            entry["skipped_on_rerun"] = True
            results[name] = json.loads((step_dir / "final_metrics.json").read_text())
        else:
            # The chain's per-step settings first, the command line last: what the user typed wins.
            print(f"[e2e] {STEP_TITLES[name]}: python launch.py {' '.join(step_overrides)}", flush=True)
            start = time.perf_counter()
            results[name] = run(compose_config(step_overrides), overrides=step_overrides)
            entry = {"seconds": round(time.perf_counter() - start, 1), "overrides": step_overrides,
                     "finished_at": dt.datetime.now().isoformat(timespec="seconds")}
            gc.collect()  # drop the finished step's engines before the next step builds its own
        outputs[name] = str(step_dir / "model")
        entry.update(run_dir=str(step_dir), output=outputs[name], metrics=results[name])
        manifest["steps"][name] = entry
        _write_manifest(manifest_path, manifest)

    if schema.launch.dry_run:
        return {}
    print("[e2e] " + "-" * 60)
    for name in steps:
        entry = manifest["steps"][name]
        took = str(dt.timedelta(seconds=round(entry.get("seconds", 0))))
        print(f"[e2e] Finished {STEP_TITLES[name]} in {took}" + (" (earlier run)" if entry.get("skipped_on_rerun")
                                                                 else ""), flush=True)
    print(f"[e2e] outputs: {json.dumps(outputs)}", flush=True)
    return {"outputs": outputs, **{f"{k}/{m}": v for k, r in results.items() for m, v in r.items()
                                   if isinstance(v, int | float)}}


def is_chain(cfg: DictConfig) -> bool:
    return bool(cfg.get("pipeline") and cfg.pipeline.steps)
