"""Saved embeddings: float32 `.npy` parts beside their ids, loadable memory-mapped.

A folder holds the parts of one encoding, `part-<i>-of-<n>` for i in 0..n-1 (one part when the
corpus was not sharded), and densekit's manifest, whose identity (the model's weights and settings,
the corpus's digest, the sharding, MaxP) every part repeats. Each part is three files: `.npy` (rows
in corpus order), `.ids` (one id a line) and `.json` (its rows and the checksums of the other two).
The `.json` is written last, atomically: a part without one is incomplete and is never read. Opening a
folder checks every part from its headers (float32 vectors of the folder's width, as many as its ids and
its `.json` say) before any checksum reads a file whole.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from densekit.data.lines import count_lines
from densekit.diagnostics import DataError, Problem
from densekit.io.artefact import differences, open_artefact
from densekit.io.atomic import atomic_file, write_text_atomic
from densekit.io.fingerprint import file_digest
from densekit.io.npy import float32_header, iter_row_chunks, read_npy_header

KIND = "embeddings"
PART_PATTERNS = ("part-*", ".part-*")  # what an embedding folder of densekit's holds
_PART_META = re.compile(r"^part-(\d{5})-of-(\d{5})\.json$")


def part_stem(index: int, count: int) -> str:
    """The file name stem of part `index` of `count`."""
    return f"part-{index:05d}-of-{count:05d}"


def complete_part(folder: Path, index: int, count: int, vectors: Path, ids: list[str], meta: dict) -> Path:
    """Make part `index` of `count` complete: its ids, its vectors (moved from `vectors`, a finished
    `.npy`), then its `.json` with their checksums, last. Returns the `.json`."""
    stem = Path(folder) / part_stem(index, count)
    with atomic_file(stem.with_suffix(".ids")) as handle:
        handle.write("".join(f"{doc_id}\n" for doc_id in ids))
    os.replace(vectors, stem.with_suffix(".npy"))
    checksums = {suffix: file_digest(stem.with_suffix(f".{suffix}")) for suffix in ("npy", "ids")}
    meta_file = stem.with_suffix(".json")
    write_text_atomic(meta_file, json.dumps({**meta, "checksums": checksums}, indent=2))
    return meta_file


@dataclass(frozen=True)
class EmbeddingPart:
    """One complete part of an embedding folder."""

    folder: Path
    index: int
    count: int
    meta: dict[str, Any]

    @property
    def stem(self) -> Path:
        """The part's path without suffix."""
        return self.folder / part_stem(self.index, self.count)

    def vectors(self, mmap: bool = True) -> np.ndarray:
        """The part's vectors, memory-mapped read-only unless `mmap` is False."""
        path = self.stem.with_suffix(".npy")
        try:
            return np.load(path, mmap_mode="r" if mmap else None)
        except (ValueError, OSError, EOFError) as err:
            raise DataError([Problem(path, None, self._unreadable(path, err))]) from None

    def row_chunks(self, rows: int, into: np.ndarray | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """The part's vectors `rows` at a time, as (first row, array), each read through a memory map
        of its own (`iter_row_chunks`), so that resident memory stays one chunk; with `into` (an array
        of the part's shape) they are copied into it."""
        path = self.stem.with_suffix(".npy")
        try:
            header = read_npy_header(path)
        except (ValueError, OSError) as err:
            raise DataError([Problem(path, None, self._unreadable(path, err))]) from None
        yield from iter_row_chunks(path, header, rows, into)

    def _unreadable(self, path: Path, err: Exception) -> str:
        """Why numpy could not load the part's vectors, in words."""
        rows, dimension = int(self.meta["rows"]), int(self.meta["dimension"])
        needed = len(float32_header(rows, dimension)) + rows * dimension * np.dtype(np.float32).itemsize
        size = path.stat().st_size if path.is_file() else None
        if size is not None and size < needed:
            vectors = f"{rows} x {dimension} float32 vectors"
            return f"truncated: {size} bytes, fewer than the {needed} of {vectors}; encode it again"
        return f"not a readable .npy file ({' '.join(str(err).split())})"

    def ids(self) -> list[str]:
        """The ids of the part's rows, in order."""
        return self.stem.with_suffix(".ids").read_text(encoding="utf-8").splitlines()

    def check_shape(self, dimension: int) -> None:
        """Check, from the headers alone, that the part's `.npy` holds float32 vectors of `dimension` (the
        folder's), one for each line of its `.ids`, as many as its `.json` records."""
        rows = int(self.meta["rows"])
        if int(self.meta["dimension"]) != dimension:
            message = f"dimension {self.meta['dimension']}, but the folder's first part has {dimension}"
            raise DataError([Problem(self.stem.with_suffix(".json"), None, message)])
        ids, npy = self.stem.with_suffix(".ids"), self.stem.with_suffix(".npy")
        for path in (ids, npy):
            if not path.is_file():
                raise DataError([Problem(path, None, "missing: the embedding part is incomplete")])
        lines = count_lines(ids)
        if lines != rows:
            raise DataError([Problem(ids, None, f"{lines} ids for {rows} rows")])
        try:
            header = read_npy_header(npy)
        except ValueError as err:
            raise DataError([Problem(npy, None, self._unreadable(npy, err))]) from None
        if header.dtype != np.float32:
            message = f"holds {header.dtype} vectors, not float32; encode it again"
            raise DataError([Problem(npy, None, message)])
        if header.shape != (rows, dimension):
            message = f"holds {header.shape} vectors, not the {rows} x {dimension} recorded"
            raise DataError([Problem(npy, None, message)])

    def verify(self) -> None:
        """Check the part's files against the checksums saved when it was written."""
        for suffix, expected in self.meta.get("checksums", {}).items():
            path = self.stem.with_suffix(f".{suffix}")
            if not path.is_file():
                raise DataError([Problem(path, None, "missing: the embedding part is incomplete")])
            if file_digest(path) != expected:
                raise DataError(
                    [Problem(path, None, "its checksum differs from the one saved when it was written: "
                             "the file is damaged or was changed; encode this part again")]
                )  # fmt: skip


class EmbeddingStore:
    """A complete embedding folder: every part present, checked, all of one identity."""

    def __init__(self, folder: Path, parts: list[EmbeddingPart], identity: dict[str, Any], about: dict):
        self.folder = folder
        self.parts = parts
        self.identity = identity
        self.about = about

    @classmethod
    def open(cls, folder: Path | str) -> EmbeddingStore:
        """Open `folder`, raising `DataError` if it is not densekit's, a part is missing, damaged or
        made by something else than the folder's manifest says."""
        folder = Path(folder)
        manifest = open_artefact(folder, KIND, "embedding folder")
        found: dict[int, EmbeddingPart] = {}
        counts = set()
        for meta_file in sorted(folder.iterdir()):
            match = _PART_META.match(meta_file.name)
            if match:
                index, count = int(match.group(1)), int(match.group(2))
                meta = json.loads(meta_file.read_text(encoding="utf-8"))
                found[index] = EmbeddingPart(folder, index, count, meta)
                counts.add(count)
        if not found:
            raise DataError([Problem(folder, None, "no complete embedding part here; run densekit encode")])
        if len(counts) > 1:
            raise DataError(
                [Problem(folder, None, f"parts of different shardings mixed: of {sorted(counts)}")]
            )
        count = counts.pop()
        missing = [i for i in range(count) if i not in found]
        if missing:
            listed = ", ".join(f"{i}/{count}" for i in missing)
            raise DataError(
                [Problem(folder, None, f"missing or incomplete parts {listed}: encode them with --shard")]
            )
        parts = [found[i] for i in range(count)]
        dimension = int(parts[0].meta["dimension"])
        for part in parts:  # every cheap check of every part before the checksums read all the bytes
            changed = differences(manifest.identity, part.meta.get("identity"))
            if changed:
                raise DataError(
                    [Problem(part.stem.with_suffix(".json"), None,
                             f"made by another model, setting or corpus than the folder (differs in: "
                             f"{', '.join(changed)})")]
                )  # fmt: skip
            part.check_shape(dimension)
        for part in parts:
            part.verify()
        return cls(folder, parts, manifest.identity, manifest.about)

    @property
    def maxp(self) -> dict | None:
        """How documents were cut into passages (MaxP), or None for one vector a document."""
        return self.identity.get("maxp")

    @property
    def dimension(self) -> int:
        """The vectors' size."""
        return int(self.parts[0].meta["dimension"])

    def __len__(self) -> int:
        return sum(int(p.meta["rows"]) for p in self.parts)

    def ids(self) -> list[str]:
        """Every id, in corpus order across parts."""
        return [doc_id for part in self.parts for doc_id in part.ids()]

    def vectors(self) -> np.ndarray:
        """All vectors: memory-mapped when there is one part, concatenated into memory otherwise."""
        if len(self.parts) == 1:
            return self.parts[0].vectors()
        return np.concatenate([part.vectors(mmap=False) for part in self.parts])
