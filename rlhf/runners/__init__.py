"""Registry of step runners: ``step.name`` -> ``run(cfg) -> final metrics``."""

from rlhf.runners import sft

RUNNERS = {
    "sft": sft.run,
}
