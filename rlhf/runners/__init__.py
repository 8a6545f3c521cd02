"""Registry of step runners: ``step.name`` -> ``run(cfg) -> final metrics``, through each step's spec
(rlhf.config.STEPS[name].runner names its kind: every preference method shares one runner)."""

from rlhf.config import STEPS
from rlhf.runners import ppo, preference, reward, sft

KINDS = {"sft": sft.run, "reward": reward.run, "ppo": ppo.run, "preference": preference.run}
RUNNERS = {name: KINDS[spec.runner] for name, spec in STEPS.items()}
