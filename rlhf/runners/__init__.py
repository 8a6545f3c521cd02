"""Registry of step runners: ``step.name`` -> ``run(cfg) -> final metrics``."""

from rlhf.runners import reward, sft

RUNNERS = {
    "sft": sft.run,
    "reward": reward.run,
}
