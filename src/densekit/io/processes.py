"""Whether the process a file names (a lock's holder, a temporary's writer) still runs."""

from __future__ import annotations

import os
from pathlib import Path


def running(pid: int) -> bool:
    """Whether process `pid` runs here: it exists and has not ended. A process that has ended but that
    its parent has not yet reaped (a zombie) still exists for `kill(pid, 0)`, yet writes nothing more,
    so it counts as ended where /proc says so. One of another user counts as running."""
    if not _exists(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:  # no /proc (not Linux), or the process ended meanwhile
        return _exists(pid)
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")  # the state follows "(command) "


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
