"""Registry of step runners: ``step.name`` -> ``run(cfg) -> final metrics``."""

from rlhf.runners import dpo, ppo, reward, sft, simpo

RUNNERS = {
    "sft": sft.run,
    "reward": reward.run,
    "ppo": ppo.run,
    "dpo": dpo.run,
    "simpo": simpo.run,
}
