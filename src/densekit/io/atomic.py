"""Atomic writes: a reader sees the old file or folder or the complete new one, never a partial one."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    kwargs = {"encoding": encoding} if "b" not in mode else {}
    try:
        with tmp.open(mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_file(path) as handle:
        handle.write(text)


@contextlib.contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `path`; on success it takes `path`'s place.

    An existing folder at `path` is moved aside first and deleted after the new one is in place, so a
    crash leaves either the old folder, the new one, or both under recognisable names, never a mix.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = path.with_name(f".{path.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                with child.open("rb") as handle:
                    os.fsync(handle.fileno())
        old = path.with_name(f".{path.name}.old-{tag}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
