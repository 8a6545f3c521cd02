"""DeepSpeed-Chat's RLHF pipeline as a config-driven experiment framework: `python launch.py --help`."""

import os

# Without a GPU DeepSpeed falls back to its CPU accelerator, but warns about it on every import (each
# rank, each run). Naming that same fallback up front keeps the console for what matters; a
# DS_ACCELERATOR already set wins. The ranks inherit it through the environment.
if "DS_ACCELERATOR" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def compose(overrides: list[str] | None = None):
    """The config `python launch.py <overrides>` would run, as an OmegaConf DictConfig, to inspect or
    change before `train`. Raises rlhf.config.ConfigError for a wrong key, value or group option."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict

    from rlhf.config import check_override_keys, compose_config

    overrides = list(overrides or [])
    try:
        cfg = compose_config(overrides, with_hydra=True)
    except HydraException:
        check_override_keys(overrides)  # says the same error in one line (ConfigError)
        raise

    run_dir = cfg.run_dir or OmegaConf.select(cfg, "hydra.run.dir")  # where launch.py would write
    with open_dict(cfg):
        del cfg["hydra"]
    cfg.run_dir = run_dir
    return cfg


def train(overrides: list[str] | None = None) -> dict:
    """Run what `python launch.py <overrides>` runs (a step, or a chain with pipeline=...) in this
    process and return its final figures (a chain: each step's, by step name). Raises
    rlhf.config.ConfigError (or DataError) for a user error, before anything is written.

        import rlhf
        final = rlhf.train(["step=sft", "step.max_steps=50", "run_dir=/tmp/sft"])
        print(final["eval/loss"], final["stopped_by"])
    """
    import sys

    from rlhf.launch import run

    overrides = list(overrides or [])
    return run(compose(overrides), overrides=overrides, command=[sys.executable, "launch.py", *overrides])
