"""Saved embeddings: float32 `.npy` parts beside their ids, loadable memory-mapped.

A folder holds the parts of one encoding, `part-<i>-of-<n>` for i in 0..n-1 (one part when the
corpus was not sharded). Each part is three files: `.npy` (rows in corpus order), `.ids` (one id a
line) and `.json` (what made it). The `.json` is written last, atomically: a part without one is
incomplete and is never read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from densekit.data.diagnostics import DataError, Problem

_PART_META = re.compile(r"^part-(\d{5})-of-(\d{5})\.json$")


def part_stem(index: int, count: int) -> str:
    """The file name stem of part `index` of `count`."""
    return f"part-{index:05d}-of-{count:05d}"


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
        return np.load(self.stem.with_suffix(".npy"), mmap_mode="r" if mmap else None)

    def ids(self) -> list[str]:
        """The ids of the part's rows, in order."""
        return self.stem.with_suffix(".ids").read_text(encoding="utf-8").splitlines()


class EmbeddingStore:
    """A complete embedding folder: every part present, all of one model and dimension."""

    def __init__(self, folder: Path, parts: list[EmbeddingPart]):
        self.folder = folder
        self.parts = parts

    @classmethod
    def open(cls, folder: Path | str) -> EmbeddingStore:
        """Open `folder`, raising `DataError` if a part is missing or the parts disagree."""
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError([Problem(folder, None, "embedding folder not found")])
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
        for key in ("dimension", "model", "corpus_fingerprint"):
            values = {json.dumps(p.meta.get(key), sort_keys=True) for p in parts}
            if len(values) > 1:
                raise DataError([Problem(folder, None, f"parts disagree on {key}: {sorted(values)}")])
        return cls(folder, parts)

    @property
    def meta(self) -> dict[str, Any]:
        """What made these embeddings (model, encoder settings, corpus), from the first part."""
        return self.parts[0].meta

    @property
    def dimension(self) -> int:
        """The vectors' size."""
        return int(self.meta["dimension"])

    def __len__(self) -> int:
        return sum(int(p.meta["rows"]) for p in self.parts)

    def ids(self) -> list[str]:
        """Every id, in corpus order across parts."""
        return [doc_id for part in self.parts for doc_id in part.ids()]

    def iter_parts(self) -> Iterator[np.ndarray]:
        """Each part's memory-mapped vectors in order, so a large corpus never has to fit in memory."""
        for part in self.parts:
            yield part.vectors()

    def vectors(self) -> np.ndarray:
        """All vectors: memory-mapped when there is one part, concatenated into memory otherwise."""
        if len(self.parts) == 1:
            return self.parts[0].vectors()
        return np.concatenate([part.vectors(mmap=False) for part in self.parts])
