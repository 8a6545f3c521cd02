"""Which rank ran where and how it ended, so that a launch whose ranks stopped can name the one that
was lost, instead of the launcher's "exit code -9" for the whole job.

Each rank started by the DeepSpeed launcher writes ``RANKS_DIR/rank<N>.json`` when it starts (pid,
host, node) and again when it ends: "ok", "error" with the exception, or "signal" when a SIGTERM /
SIGINT reached it (the launcher terminates the other ranks as soon as one fails). A rank killed
outright (SIGKILL, the out-of-memory killer, a machine that went down) writes nothing more: after
the launch, the ranks still marked "running" are the lost ones.

    python -c "from rlhf.launch.ranks import lost_ranks_report"   # used by rlhf.worker and rlhf.launch.processes
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from rlhf.files import write_whole

# Set by the process that starts the launcher (rlhf.launch.processes.launch_ranks) for its ranks.
ENV = "RLHF_RANKS_DIR"


def _path() -> Path | None:
    folder = os.environ.get(ENV)
    return Path(folder) / f"rank{os.environ.get('RANK', '0')}.json" if folder else None


def _write(record: dict) -> None:
    if (path := _path()) is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(record))


def _read() -> dict:
    path = _path()
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def started() -> None:
    _write({"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "status": "running"})


def ended(status: str, detail: str = "") -> None:
    """``status``: ok, error or signal. The first end a rank records stands: a rank stopped by the
    launcher's SIGTERM that then fails on a collective is still 'signal'."""
    import re

    detail = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", detail)  # gloo's source location, not the user's business
    record = _read()
    if record and record.get("status") == "running":
        _write({**record, "status": status, "detail": detail[:500], "ended": time.time()})


# Set by the process that starts the launcher: its pid, which the ranks of this machine watch.
LAUNCH_PID_ENV = "RLHF_LAUNCH_PID"


def end_with_the_launch() -> None:
    """Stop this rank as a SIGTERM does (its step finished and saved, then exit) once the process that
    started the launch is gone: a launch killed outright (SIGKILL, the out-of-memory killer, a closed
    terminal) leaves DeepSpeed's launcher and its ranks running otherwise, training on beside the rerun
    of the same command. Watched once a second from a daemon thread; only on the launch's machine."""
    import signal
    import threading

    import psutil

    try:
        launch = psutil.Process(int(os.environ[LAUNCH_PID_ENV]))
    except (KeyError, ValueError, psutil.Error):
        return

    def gone() -> bool:
        try:  # is_running compares the start time too: a reused pid is not the launch
            return not launch.is_running() or launch.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def watch() -> None:
        while not gone():
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="end-with-the-launch", daemon=True).start()


def still_running(folder: Path, ranks: range) -> list[dict]:
    """The records of ``ranks`` whose process is still alive on this machine: a launch of the same
    folder that has not ended yet (its launcher was killed and its ranks are shutting down, or a
    second terminal started the same command). A pid reused by another program does not count."""
    import psutil

    alive = []
    for rank in ranks:
        try:
            record = json.loads((folder / f"rank{rank}.json").read_text())
            # Whatever it recorded: a rank that got its SIGTERM ("signal") still saves before it exits.
            if record.get("host") != socket.gethostname():
                continue
            cmdline = psutil.Process(record["pid"]).cmdline()
        except (OSError, ValueError, KeyError, psutil.Error):
            continue
        if "rlhf.worker" in cmdline:
            alive.append(record)
    return alive


def clear(folder: Path, ranks: range) -> None:
    """Remove the records of ``ranks`` (this node's) before a launch: only the other nodes' are left."""
    for rank in ranks:
        (folder / f"rank{rank}.json").unlink(missing_ok=True)


def lost_ranks_report(folder: Path, world_size: int) -> str:
    """One line on how the ranks ended: the lost ones (started, never ended), else the first one that
    failed with an error; then what became of the others. Empty when there are no records."""
    records = {}
    for rank in range(world_size):
        try:
            records[rank] = json.loads((folder / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue
    if not records:
        return ""
    lost = [r for r, rec in records.items() if rec.get("status") == "running"]
    failed = sorted((rec.get("ended", 0.0), r) for r, rec in records.items() if rec.get("status") == "error")
    if lost:
        where = ", ".join(f"rank {r} (pid {records[r]['pid']} on {records[r]['host']})" for r in lost)
        cause = lost
        parts = [f"lost {where}: it ended without a word or stopped answering (killed by a signal such as SIGKILL "
                 "or the out-of-memory killer, hung past launch.collective_timeout_min, or its machine went down)"]
    elif failed:
        r = failed[0][1]
        cause = [r]
        parts = [f"rank {r} (pid {records[r]['pid']} on {records[r]['host']}) failed: {records[r].get('detail', '')}"]
    else:
        return ""
    others = [r for r in records if r not in cause]
    if others:
        first = next((records[r] for r in others if records[r].get("detail")), None)
        parts.append(f"rank(s) {', '.join(map(str, others))} stopped after it"
                     + (f" (rank {first['rank']}: {first['detail']})" if first else ""))
    if never := [r for r in range(world_size) if r not in records]:
        parts.append(f"rank(s) {', '.join(map(str, never))} never started")
    return "; ".join(parts)
