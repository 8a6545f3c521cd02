"""The only Hydra entry point: compose the run from conf/, then hand it to rlhf.launch.run.

    python launch.py                                   # the default job (see README.md)
    python launch.py step=sft model=tiny-llama zero=3 optim.lr=3e-4
    python launch.py --help                            # every config group and its options
"""

import sys

import hydra
from omegaconf import DictConfig

from rlhf.config import ConfigError, quote_numeric_groups, register_configs

register_configs()
# The command as the user typed it, for the run directory, before numeric group names are quoted.
COMMAND = [sys.executable, *sys.argv]
sys.argv[1:] = quote_numeric_groups(sys.argv[1:])


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rlhf.launch import run

    try:
        run(cfg, overrides=list(HydraConfig.get().overrides.task), command=COMMAND)
    except ConfigError as err:
        # A user error: one clear line, no traceback wall.
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
