"""Line-by-line reading of UTF-8 text files, accepting a BOM and CRLF line endings, plain or
gzip-compressed (`densekit.data.collection_files`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from densekit.data.collection_files import iter_blocks, iter_raw_lines
from densekit.diagnostics import DataError, Problem

_BOM = b"\xef\xbb\xbf"


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield `(line number, text)` for each line of `path`, without its line ending.

    Raises `DataError` naming the file (and the line, for bad bytes) when the file is missing, empty,
    not UTF-8, or gzip that is truncated or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError([Problem(path, None, "file not found")])
    lineno = 0
    for lineno, raw in enumerate(iter_raw_lines(path), start=1):
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            message = f"not valid UTF-8: byte 0x{raw[err.start]:02x} at column {err.start + 1}"
            raise DataError([Problem(path, lineno, message)]) from None
        yield lineno, text.rstrip("\n").rstrip("\r")
    if lineno == 0:
        raise DataError([Problem(path, None, "file is empty")])


def count_lines(path: Path) -> int:
    """Count the lines of `path` (a last one without its line ending too), reading it in binary blocks."""
    count, last = 0, b"\n"
    for block in iter_blocks(Path(path)):
        count += block.count(b"\n")
        last = block[-1:]
    return count + (last != b"\n")


def count_nonblank_lines(path: Path) -> int:
    """Count the lines of `path` holding anything but whitespace, as the readers skip them (`str.strip`,
    so a line of only U+00A0 is blank too), reading it in binary."""
    return sum(not _is_blank(raw) for raw in iter_raw_lines(Path(path)))


def _is_blank(raw: bytes) -> bool:
    """Whether a line is only whitespace, Unicode's included; decoded only when it starts with a byte
    past ASCII (whitespace of ASCII alone is stripped as bytes)."""
    stripped = raw.strip()
    if not stripped:
        return True
    if stripped[0] < 0x80:  # an ASCII character that is not whitespace
        return False
    return not stripped.decode("utf-8", errors="replace").strip()
