"""Content fingerprints: what an artefact records of its inputs, to notice when any of them changed."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

_CHUNK = 1 << 20


def file_digest(path: Path | str) -> str:
    """The SHA-256 of a file's bytes, as `sha256:<hex>`."""
    with Path(path).open("rb") as handle:
        return stream_digest(iter(lambda: handle.read(_CHUNK), b""))


def stream_digest(blocks: Iterable[bytes]) -> str:
    """The SHA-256 of the bytes `blocks` give one after the other, as `file_digest` writes it."""
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def write_digested(path: Path | str, write_all: Callable[[Callable[[bytes], None]], None]) -> str:
    """Create `path` from the blocks `write_all` passes to the function it is given, and return the
    file's digest (as `file_digest` gives it), computed as the blocks go by on a thread of its own
    (hashlib lets go of the interpreter lock), so a large file is neither read back nor hashed after."""
    digest = hashlib.sha256()
    blocks: queue.Queue[bytes | None] = queue.Queue(maxsize=16)

    def hash_blocks() -> None:
        while (block := blocks.get()) is not None:
            digest.update(block)

    hasher = threading.Thread(target=hash_blocks, daemon=True)
    hasher.start()
    try:
        with Path(path).open("wb") as handle:

            def write(block: bytes) -> None:
                handle.write(block)
                blocks.put(block)

            write_all(write)
    finally:
        blocks.put(None)
        hasher.join()
    return f"sha256:{digest.hexdigest()}"


def digest_of(values: dict[str, str]) -> str:
    """One digest for named digests (a folder's files), independent of their order."""
    digest = hashlib.sha256()
    for name in sorted(values):
        digest.update(f"{name}\0{values[name]}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def tree_checksums(folder: Path | str, skip: set[str] | None = None) -> dict[str, str]:
    """The digest of every file under `folder` by its relative path, hidden files and `skip` left out."""
    folder = Path(folder)
    checksums = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts) or relative.as_posix() in (skip or set()):
            continue
        if path.is_file():
            checksums[relative.as_posix()] = file_digest(path)
    return checksums
