"""Registry of step runners: ``step.name`` -> ``run(cfg) -> final metrics``, through each step's spec
(rlhf.config.STEPS[name].runner names its kind: every preference method shares one runner)."""

from rlhf.config import STEPS
from rlhf.runners import dpo, ppo, reward, sft, simpo

KINDS = {
    "sft": sft.run,
    "reward": reward.run,
    "ppo": ppo.run,
    "preference": dpo.run,
    "simpo": simpo.run,
}
RUNNERS = {name: KINDS[spec.runner] for name, spec in STEPS.items()}
