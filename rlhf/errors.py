"""The errors a user's input raises: launch.py prints them as one line, without a traceback, and
exits with 2. Their own module so that every other module can raise them without importing the
config schema (rlhf.rewards is imported by it).

    python -c "from rlhf.errors import ConfigError"   # used by the other modules; no command of its own
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the composed config; launch.py prints it without a traceback."""

    kind = "config"


class DataError(ConfigError):
    """A user's data cannot be used as configured: the message names the file, row and column."""

    kind = "data"


class DiskFullError(ConfigError):
    """A save that ran out of room (a full disk, a quota, a file-size limit): not the user's input,
    but said the same way, in one line naming the folder and the bytes it needs."""

    kind = "disk"
