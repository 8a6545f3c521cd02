"""Typed schema of a run, registered in Hydra's ConfigStore.

Hydra merges the YAML groups under conf/ onto these dataclasses, so an unknown key or a value of
the wrong type fails while composing. Invariants that involve values (allowed choices, ranges,
cross-group arithmetic) live in ``__post_init__`` and run when ``to_schema`` turns the composed
DictConfig into objects -- in launch.py, before any model or dataset is touched.

Split by concern: ``checks`` (value checks), ``groups`` (one schema per config group), ``steps`` (step
schemas and the STEPS registry), ``run`` (the whole run and the chain), ``compose`` (Hydra composition
and the typed conversion). Import from ``rlhf.config``.

    python -c "from rlhf.config import to_schema; ..."   # used by launch.py; no command of its own
"""

from rlhf.config.checks import PROJECT_ROOT, _choice, _positive  # noqa: F401
from rlhf.config.compose import (  # noqa: F401
    NUMERIC_GROUPS,
    check_command_line,
    check_override_keys,
    compose_config,
    load_run_config,
    quote_numeric_groups,
    register_configs,
    to_schema,
)
from rlhf.config.groups import *  # noqa: F401,F403
from rlhf.config.run import *  # noqa: F401,F403
from rlhf.config.steps import *  # noqa: F401,F403
from rlhf.errors import ConfigError, DataError  # noqa: F401
