"""Atomic writes: a reader sees the old file or folder or the complete new one, never a partial one.

Temporary names carry the writing process's id (`.NAME.tmp-<pid>-<tag>`), so what a killed writer
left behind is recognised and removed by the next writer of the same path, never a live writer's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from densekit.io.processes import running
from densekit.io.write_errors import naming

TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(path: Path, what: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_dead_temporaries(folder: Path, name: str | None = None) -> list[Path]:
    """Delete the temporaries that killed writers left in `folder` (only those of `name`, if given).

    A temporary whose writer is still running is left alone; an old folder moved aside by a writer
    killed before its new one took the place is put back. Returns what was removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for child in folder.iterdir():
        match = TEMPORARY.match(child.name)
        if not match or (name is not None and match.group("name") != name):
            continue
        if running(int(match.group("pid"))):
            continue
        target = folder / match.group("name")
        if ".old-" in child.name and not target.exists():
            os.replace(child, target)
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        removed.append(child)
    return removed


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path.parent, path.name)
    tmp = _temporary(path)
    kwargs = {"encoding": encoding} if "b" not in mode else {}
    try:
        with naming(path, inside=tmp), tmp.open(mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path`, for writers that need a file name (SQLite); on success the file
    written there replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path.parent, path.name)
    tmp = _temporary(path)
    try:
        with naming(path, inside=tmp):
            yield tmp
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_file(path) as handle:
        handle.write(text)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (Linux's renameat2 with RENAME_EXCHANGE).

    Python's `os` has no RENAME_EXCHANGE, hence ctypes. Returns False where the system or the file
    system cannot do it, and the caller falls back to two renames.
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


@contextlib.contextmanager
def atomic_dir(path: Path | str, may_replace: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `path`; on success it takes `path`'s place.

    An existing `path` is replaced only when it is an empty folder or `may_replace(path)` says yes (the
    folder is one densekit made, of the same kind); anything else raises `FileExistsError` before any
    work. The old and new folders are swapped in one atomic step where the system allows it, so a kill
    at any moment leaves the old folder or the new one at `path`, never neither.
    """
    path = Path(path)
    check_replaceable(path, may_replace)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path.parent, path.name)
    tmp = _temporary(path)
    tmp.mkdir()
    try:
        with naming(path, inside=tmp):
            yield tmp
            for child in tmp.rglob("*"):
                if child.is_file():
                    with child.open("rb") as handle:
                        os.fsync(handle.fileno())
        check_replaceable(path, may_replace)  # it may have appeared while the work went on
        if path.exists() and exchange(tmp, path):
            _fsync_dir(path.parent)  # tmp now holds the old folder and is removed below
        else:
            old = _temporary(path, "old")
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            if old.exists():
                shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def check_replaceable(path: Path, may_replace: Callable[[Path], bool] | None) -> None:
    """Raise `FileExistsError` unless `path` is absent, an empty folder, or `may_replace` allows it."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise FileExistsError(f"{path} exists and is not a folder; densekit will not replace it")
    if not path.exists() or not any(path.iterdir()):
        return
    if may_replace is None or not may_replace(path):
        raise FileExistsError(
            f"{path} is a folder densekit did not make (or of another kind); it is left as it is: "
            "choose another output"
        )
