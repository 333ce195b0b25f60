"""A `.npy` file's header read on its own: shape, type and order, checked against the file's size, without
loading or mapping the data, so that a file of many gigabytes is judged in microseconds; its rows read
a chunk at a time; and a float32 matrix written a chunk of rows at a time."""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densekit.errors import InputError
from densekit.io.write_errors import naming

_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


@dataclass(frozen=True)
class NpyHeader:
    """What a `.npy` file says it holds, and where its data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int

    def describe(self) -> str:
        """The array in words: `120 x 16 float32`."""
        return f"{' x '.join(str(n) for n in self.shape) or 'scalar'} {self.dtype}"


def read_npy_header(path: Path | str) -> NpyHeader:
    """The header of the `.npy` file at `path`; `ValueError` says why it is unreadable (numpy's words) or
    shorter than its header promises (the caller names the file)."""
    with Path(path).open("rb") as handle:
        try:
            version = np.lib.format.read_magic(handle)
        except ValueError as err:
            raise InputError(" ".join(str(err).split())) from None
        reader = _READERS.get(version)
        if reader is None:
            raise InputError(f".npy format version {version[0]}.{version[1]}; densekit reads 1.0 and 2.0")
        try:
            shape, fortran_order, dtype = reader(handle)
        except (ValueError, EOFError) as err:
            raise InputError(" ".join(str(err).split())) from None
        header = NpyHeader(tuple(int(n) for n in shape), np.dtype(dtype), bool(fortran_order), handle.tell())
        size = os.fstat(handle.fileno()).st_size
    needed = header.offset + math.prod(header.shape) * header.dtype.itemsize
    if size < needed:
        raise InputError(f"truncated: {size} bytes, fewer than the {needed} of the {header.describe()} array "
                         "its header announces")  # fmt: skip
    return header


def iter_row_chunks(
    path: Path | str, header: NpyHeader, chunk_rows: int, into: np.ndarray | None = None
) -> Iterator[tuple[int, np.ndarray]]:
    """The rows of the 2-D `.npy` at `path` (whose header is `header`), `chunk_rows` at a time, as (first
    row, a copy in memory). Each chunk is read through a memory map of its own bytes, dropped once copied,
    so that the file's pages do not pile up in the process's resident memory however large it is; a
    Fortran-order file, whose rows are spread over all of it, is mapped whole instead. With `into` (an
    array of the file's shape), each chunk is copied into its rows, and the chunk given is that view."""
    rows, dimension = header.shape
    if header.fortran_order:
        whole = np.memmap(path, header.dtype, "r", header.offset, header.shape, order="F")
        for start in range(0, rows, chunk_rows):
            yield start, _copied(whole[start : start + chunk_rows], into, start)
        return
    row_bytes = dimension * header.dtype.itemsize
    for start in range(0, rows, chunk_rows):
        count = min(chunk_rows, rows - start)
        mapped = np.memmap(path, header.dtype, "r", header.offset + start * row_bytes, (count, dimension))
        chunk = _copied(mapped, into, start)
        del mapped  # unmapped now, before the next chunk is read
        yield start, chunk


def _copied(rows: np.ndarray, into: np.ndarray | None, start: int) -> np.ndarray:
    """`rows` copied into a new C-order array, or into `into`'s rows from `start`."""
    if into is None:
        return np.array(rows, order="C")
    target = into[start : start + len(rows)]
    target[...] = rows
    return target


@contextlib.contextmanager
def float32_rows_writer(
    path: Path | str, rows: int, dimension: int, resume: bool = False
) -> Iterator[Callable[[int, np.ndarray], None]]:
    """Write a `rows` x `dimension` float32 `.npy` at `path` a chunk of rows at a time: yields
    `write(first_row, chunk)`, whose rows are on disk when it returns.

    The file is written with ordinary writes, never through a memory map: a full disk is then an
    `OSError` naming `path`, where a write into a mapped file the disk cannot hold kills the process
    with SIGBUS. A new file gets all of its space when it is made (`posix_fallocate`), so a disk too
    small refuses it before any row is written (and the file is removed); with `resume` the file is one
    made so before, its rows kept. The bytes are those numpy writes (`np.save`, `open_memmap`)."""
    path = Path(path)
    row_bytes = dimension * np.dtype(np.float32).itemsize
    with naming(path):
        if resume:
            offset = read_npy_header(path).offset
            descriptor = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        else:
            descriptor, offset = _new_npy(path, rows, dimension)

    def write(first_row: int, chunk: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(chunk, dtype=np.float32)).cast("B")
        position = offset + first_row * row_bytes
        with naming(path):
            while data:
                written = os.pwrite(descriptor, data, position)
                data, position = data[written:], position + written
            os.fsync(descriptor)

    try:
        yield write
    finally:
        os.close(descriptor)


def float32_header(rows: int, dimension: int) -> bytes:
    """The header numpy writes for a `rows` x `dimension` float32 matrix in C order."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                 "shape": (rows, dimension)}
    )  # fmt: skip
    return header.getvalue()


def _new_npy(path: Path, rows: int, dimension: int) -> tuple[int, int]:
    """Make the `.npy` file of a `rows` x `dimension` float32 matrix, its header written and its space
    taken; returns its open descriptor and where its data starts."""
    header = float32_header(rows, dimension)
    path.unlink(missing_ok=True)  # an earlier file (or a link) is replaced, never written through
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(descriptor, header, 0)
        size = len(header) + rows * dimension * np.dtype(np.float32).itemsize
        try:
            os.posix_fallocate(descriptor, 0, size)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            os.ftruncate(descriptor, size)  # a file system that cannot reserve: writes say when it is full
    except BaseException:
        os.close(descriptor)
        path.unlink(missing_ok=True)
        raise
    return descriptor, len(header)
