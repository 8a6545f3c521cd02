"""Files written whole: through a temporary file and a rename, so a reader (another rank, another
node, a rerun after a crash) sees the old file or the new one, never half of one.

    python -c "from rlhf.files import write_whole"   # used by the launcher, the chain, sweeps and ranks
"""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``.NAME.PID`` beside it: on several nodes each process
    writing the same file has its own temporary file, and the renames never interleave."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
