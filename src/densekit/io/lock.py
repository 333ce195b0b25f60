"""One writer at a time: a lock beside an output that a second densekit finds, naming the first.

A command that writes an output over a long time (a training run, an embedding part, a recipe run,
mined examples) holds `.NAME.densekit-lock` beside it, an exclusive `flock`, for as long as it works;
a second one on the same output is refused at once: "another densekit (pid N) is writing OUTPUT".
The file records the holder's pid and a random token, for people and for the release, which removes
the file only while it is still the holder's own. The system drops a `flock` when its process ends,
however it ends, so a killed writer's lock is taken over by the next writer (who logs it), never waited
for, and a lock file left behind blocks nothing. Under torchrun only the process of rank 0, the one
that writes, holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from densekit.errors import DensekitError
from densekit.io.processes import running

log = logging.getLogger("densekit")

LOCK_SUFFIX = ".densekit-lock"
LOCK_NAME = re.compile(r"^\..+\.densekit-lock$")
_MAX_RECORD = 4096  # what is read of a lock file: a pid and a token, whatever else was put there
_RETRIES = 10
Function = TypeVar("Function", bound=Callable[..., Any])


class OutputBusy(DensekitError, RuntimeError):
    """Another live process holds the lock of the output; the message names its pid and the output."""


@dataclass
class _Held:
    descriptor: int
    token: str | None  # None when the record could not be written
    created: list[Path]  # folders made to hold the lock file, removed at the release when left empty
    count: int = 1


_held: dict[Path, _Held] = {}
_registry = threading.Lock()


def lock_file(path: Path | str) -> Path:
    """Where the lock of the output at `path` lives: `.NAME.densekit-lock` beside it."""
    target = Path(path).expanduser().resolve()
    return target.parent / f".{target.name or 'root'}{LOCK_SUFFIX}"


def _holder(lock: Path) -> int | None:
    """The pid a lock file names, or None when it names none (being written, or not densekit's)."""
    try:
        descriptor = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as handle:
            record = json.loads(handle.read(_MAX_RECORD))
    except (OSError, ValueError):
        return None
    pid = record.get("pid") if isinstance(record, dict) else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _busy(path: Path, lock: Path) -> OutputBusy:
    """The refusal naming the process that holds `lock`."""
    pid = _holder(lock)
    if pid is None:
        return OutputBusy(f"another densekit is writing {path} (it holds {lock}): wait for it or stop it")
    if not running(pid):
        return OutputBusy(
            f"another process is writing {path}: {lock} is held, and names densekit pid {pid}, which is not "
            "running here (a process it started, or one on another machine, may hold it)"
        )
    return OutputBusy(f"another densekit (pid {pid}) is writing {path}: wait for it to end or stop it")


def _acquire(path: Path, lock: Path) -> tuple[int, str | None]:
    """Take the lock (a descriptor holding it, and the token written into it), or raise `OutputBusy`.

    A lock file removed by its holder between this process opening and locking it is opened again: the
    lock must be on the file the name leads to."""
    for _ in range(_RETRIES):
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise _busy(path, lock) from None
        try:
            same = os.path.samestat(os.fstat(descriptor), os.lstat(lock))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(descriptor)
            continue
        earlier = _holder(lock)
        if earlier is not None and earlier != os.getpid():
            log.info("took over %s from densekit pid %d, which has ended", lock, earlier)
        token = uuid.uuid4().hex
        try:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "token": token}).encode() + b"\n", 0)
        except OSError:  # a full disk: the lock holds all the same, only the record is missing
            token = None
        return descriptor, token
    raise OutputBusy(f"{lock} was removed and made again {_RETRIES} times while densekit took it")


def _release(lock: Path, held: _Held) -> None:
    """Remove the lock file while its name still leads to this holder's own (its file, its token), let
    go of it, and remove the folders made to hold it if they are left empty."""
    try:
        record = os.pread(held.descriptor, _MAX_RECORD, 0)
        ours = held.token is None or held.token.encode() in record
        if ours and os.path.samestat(os.fstat(held.descriptor), os.lstat(lock)):
            lock.unlink()
    except OSError:
        pass  # gone or replaced: nothing of ours to remove
    os.close(held.descriptor)
    _remove_if_empty(held.created)


@contextlib.contextmanager
def hold(path: Path | str) -> Iterator[None]:
    """Hold the lock of the output at `path` while the block runs; `OutputBusy` when another live
    process holds it. The same process may hold it again inside (a recipe's step, a nested call)."""
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 writes the output and holds its lock
        yield
        return
    lock = lock_file(path)
    if any(p.exists() and not p.is_dir() for p in (lock.parent, *lock.parent.parents)):
        yield  # nothing can be written there: the command's own check of its output says why
        return
    with _registry:
        held = _held.get(lock)
        if held is not None:
            held.count += 1
        else:
            missing = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]
            lock.parent.mkdir(parents=True, exist_ok=True)
            try:
                descriptor, token = _acquire(Path(path), lock)
            except BaseException:
                _remove_if_empty(missing)
                raise
            held = _held[lock] = _Held(descriptor, token, missing)
    try:
        yield
    finally:
        with _registry:
            held.count -= 1
            if held.count == 0:
                del _held[lock]
                _release(lock, held)


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break  # not empty: the output, or another writer's lock, is in it


def holding(parameter: str) -> Callable[[Function], Function]:
    """Decorate a function so that it holds the lock of the output its argument `parameter` names
    while it runs (see `hold`)."""

    def decorate(function: Function) -> Function:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with hold(signature.bind(*args, **kwargs).arguments[parameter]):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def check_not_held(folder: Path | str) -> None:
    """Raise `OutputBusy` when another live process holds a lock inside `folder` (an embedding part
    being encoded there, say), before what it writes is removed."""
    folder = Path(folder)
    for child in folder.iterdir() if folder.is_dir() else ():
        if not LOCK_NAME.match(child.name) or child.resolve() in _held:
            continue
        try:
            descriptor = os.open(child, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            output = child.with_name(child.name[1 : -len(LOCK_SUFFIX)])
            raise _busy(output, child) from None
        finally:
            os.close(descriptor)
