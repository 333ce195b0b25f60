"""Line-by-line reading of UTF-8 text files, accepting a BOM and CRLF line endings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from densekit.diagnostics import DataError, Problem

_BOM = b"\xef\xbb\xbf"


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield `(line number, text)` for each line of `path`, without its line ending.

    Raises `DataError` naming the file (and the line, for bad bytes) when the file is missing, empty or
    not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError([Problem(path, None, "file not found")])
    with path.open("rb") as handle:
        lineno = 0
        for lineno, raw in enumerate(handle, start=1):
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    [
                        Problem(
                            path,
                            lineno,
                            f"not valid UTF-8: byte 0x{raw[err.start]:02x} at column {err.start + 1}",
                        )
                    ]
                ) from None
            yield lineno, text.rstrip("\n").rstrip("\r")
        if lineno == 0:
            raise DataError([Problem(path, None, "file is empty")])


def count_lines(path: Path) -> int:
    """Count the lines of `path` (a last one without its line ending too), reading it in binary blocks."""
    count, last = 0, b"\n"
    with Path(path).open("rb") as handle:
        while block := handle.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def count_nonblank_lines(path: Path) -> int:
    """Count the lines of `path` holding anything but whitespace, as the readers skip them (`str.strip`,
    so a line of only U+00A0 is blank too), reading it in binary."""
    count = 0
    with Path(path).open("rb") as handle:
        for raw in handle:
            count += not _is_blank(raw)
    return count


def _is_blank(raw: bytes) -> bool:
    """Whether a line is only whitespace, Unicode's included; decoded only when it starts with a byte
    past ASCII (whitespace of ASCII alone is stripped as bytes)."""
    stripped = raw.strip()
    if not stripped:
        return True
    if stripped[0] < 0x80:  # an ASCII character that is not whitespace
        return False
    return not stripped.decode("utf-8", errors="replace").strip()
