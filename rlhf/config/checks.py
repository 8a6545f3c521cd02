"""The value checks every schema's ``__post_init__`` uses, and where the project lives.

    python -c "from rlhf.config.checks import PROJECT_ROOT"   # used by the schemas; no command of its own
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value!r} must be {bound}")
