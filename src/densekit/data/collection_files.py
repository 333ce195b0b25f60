"""How densekit opens and digests a collection's files: as they are, or gzip-compressed when the name
ends in `.gz` (`corpus.jsonl.gz`, `queries.jsonl.gz`, `qrels/test.tsv.gz`, `collection.tsv.gz`...).

Every reader of a collection's lines and every digest of its files goes through here. A compressed
file is decompressed as it is read, never unpacked on disk; its identity is its content's: its digest
is the SHA-256 of the decompressed bytes, so `corpus.jsonl` and a `corpus.jsonl.gz` of the same
content are the same corpus to every artefact made from them (docs/data.md). A compressed file that
is truncated or corrupt is refused as a `DataError` naming the file and the line reached.

gzip checks its data only at the end of the file (a CRC of the whole), so a damaged file may first
give lines of garbage: an error found in the lines of a compressed file is checked against the whole
file, and the damage, when there is one, is what is reported (`reported_as_damage`).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from densekit.diagnostics import DataError, Problem
from densekit.io.fingerprint import stream_digest

COMPRESSED_SUFFIX = ".gz"
_BLOCK = 1 << 20


def is_compressed(path: Path | str) -> bool:
    """True when `path` is read as gzip (its name ends in `.gz`)."""
    return Path(path).name.endswith(COMPRESSED_SUFFIX)


def plain_name(path: Path | str) -> str:
    """The name `path` has uncompressed (`corpus.jsonl` for `corpus.jsonl.gz`): what a collection calls
    the file whichever way it is stored."""
    name = Path(path).name
    return name[: -len(COMPRESSED_SUFFIX)] if is_compressed(name) else name


def stored_file(folder: Path, name: str) -> Path | None:
    """The file `folder / name` as it is stored, plain or as `name.gz`; None when neither is there.
    Both there is ambiguous and refused: which one a command read would depend on the command."""
    plain, packed = folder / name, folder / f"{name}{COMPRESSED_SUFFIX}"
    has_plain, has_packed = plain.is_file(), packed.is_file()
    if has_plain and has_packed:
        raise DataError(
            [Problem(folder, None, f"holds both {name} and {packed.name}: keep one of them (which is read?)")]
        )
    return plain if has_plain else packed if has_packed else None


def iter_raw_lines(path: Path) -> Iterator[bytes]:
    """Each line of `path` as bytes, with its line ending, decompressed as it goes when the file is gzip."""
    lineno = 0
    with _opened(path) as handle, _gzip_errors(path, lambda: lineno + 1):
        for raw in handle:
            lineno += 1
            yield raw


def iter_blocks(path: Path) -> Iterator[bytes]:
    """The content of `path` in blocks of about a megabyte, decompressed when the file is gzip."""
    lines = 0  # the lines of the blocks given, for an error to name the line reached
    with _opened(path) as handle, _gzip_errors(path, lambda: lines + 1):
        while block := handle.read(_BLOCK):
            lines += block.count(b"\n")
            yield block


def content_digest(path: Path | str) -> str:
    """The SHA-256 of the content of `path` (decompressed when it is gzip), as `sha256:<hex>`: the
    digest every artefact records of a collection's file."""
    return stream_digest(iter_blocks(Path(path)))


def check_intact(path: Path) -> None:
    """Read a compressed file to its end: a `DataError` when it is truncated or corrupt."""
    if is_compressed(path):
        for _ in iter_raw_lines(path):  # by lines, for an error to name the line reached
            pass


@contextmanager
def reported_as_damage(path: Path) -> Iterator[None]:
    """Within the block, an error in the lines of the compressed file `path` is replaced by the file's
    damage when it is truncated or corrupt (its lines were then not what was written)."""
    try:
        yield
    except DataError:
        check_intact(path)
        raise


@contextmanager
def _opened(path: Path) -> Iterator[BinaryIO]:
    if not is_compressed(path):
        with path.open("rb") as handle:
            yield handle
        return
    with gzip.open(path, "rb") as handle:
        yield handle  # type: ignore[misc]  # GzipFile reads bytes as a binary file does


@contextmanager
def _gzip_errors(path: Path, reached: Callable[[], int]) -> Iterator[None]:
    """Turn the gzip module's failures (a missing end, a bad CRC, bytes that are not gzip) into one
    `DataError` naming the file and the line reached (`reached()`)."""
    try:
        yield
    except EOFError:
        raise DataError(
            [Problem(path, reached(), "truncated gzip file: the data ends before its end-of-stream marker")]
        ) from None
    except (gzip.BadGzipFile, zlib.error) as err:
        raise DataError([Problem(path, reached(), f"corrupt gzip file: {err}")]) from None
