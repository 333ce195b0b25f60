"""An embedding folder's parts are checked from their headers before any long work: every part's `.npy`
holds float32 vectors of the folder's width, one per line of its `.ids`, as many as its `.json` records;
a part that does not is named in one line before a single checksum is computed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from densekit.data import DataError
from densekit.encoding import store as store_module
from densekit.encoding.store import EmbeddingStore
from densekit.io.fingerprint import file_digest

from .test_index import fake_store
from .test_outputs import cli

PART = "part-00001-of-00002"


@pytest.fixture
def vectors() -> np.ndarray:
    return np.random.default_rng(5).standard_normal((120, 16)).astype(np.float32)


def _saved(folder: Path, suffix: str) -> None:
    """Record part 1's `suffix` file's present bytes in its `.json`, as if densekit had written them, so
    that only the header checks can catch what was changed."""
    meta_file = folder / f"{PART}.json"
    meta = json.loads(meta_file.read_text())
    meta["checksums"][suffix] = file_digest(folder / f"{PART}.{suffix}")
    meta_file.write_text(json.dumps(meta))


def _narrow(folder: Path) -> str:
    np.save(folder / f"{PART}.npy", np.zeros((60, 8), dtype=np.float32))
    _saved(folder, "npy")
    return f"{folder / PART}.npy: error: holds (60, 8) vectors, not the 60 x 16 recorded"


def _float64(folder: Path) -> str:
    np.save(folder / f"{PART}.npy", np.zeros((60, 16), dtype=np.float64))
    _saved(folder, "npy")
    return f"{folder / PART}.npy: error: holds float64 vectors, not float32; encode it again"


def _row_short(folder: Path) -> str:
    np.save(folder / f"{PART}.npy", np.zeros((59, 16), dtype=np.float32))
    _saved(folder, "npy")
    return f"{folder / PART}.npy: error: holds (59, 16) vectors, not the 60 x 16 recorded"


def _flat(folder: Path) -> str:
    np.save(folder / f"{PART}.npy", np.zeros(960, dtype=np.float32))
    _saved(folder, "npy")
    return f"{folder / PART}.npy: error: holds (960,) vectors, not the 60 x 16 recorded"


def _id_short(folder: Path) -> str:
    ids = folder / f"{PART}.ids"
    ids.write_text("".join(f"{line}\n" for line in ids.read_text().splitlines()[:-1]))
    _saved(folder, "ids")
    return f"{ids}: error: 59 ids for 60 rows"


def _other_width_recorded(folder: Path) -> str:
    np.save(folder / f"{PART}.npy", np.zeros((60, 8), dtype=np.float32))
    _saved(folder, "npy")
    meta_file = folder / f"{PART}.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "dimension": 8}))
    return f"{meta_file}: error: dimension 8, but the folder's first part has 16"


BREAKS: dict[str, Callable[[Path], str]] = {
    "narrower vectors": _narrow,
    "float64 vectors": _float64,
    "a row short": _row_short,
    "a 1-D array": _flat,
    "an id short": _id_short,
    "another width recorded": _other_width_recorded,
}


@pytest.mark.parametrize("damage", BREAKS.values(), ids=BREAKS.keys())
def test_a_bad_part_is_refused_from_its_header_before_any_checksum(
    vectors, tmp_path: Path, monkeypatch, damage: Callable[[Path], str]
):
    folder = fake_store(tmp_path / "emb", vectors, parts=2).folder
    expected = damage(folder)
    hashed: list[Path] = []
    monkeypatch.setattr(store_module, "file_digest", lambda path: hashed.append(path) or file_digest(path))
    with pytest.raises(DataError) as err:
        EmbeddingStore.open(folder)
    assert str(err.value) == expected
    assert hashed == []  # refused before reading any part whole, the first (good) one included


def test_index_names_the_bad_part_in_one_line_and_writes_nothing(capsys, vectors, tmp_path: Path):
    folder = fake_store(tmp_path / "emb", vectors, parts=2).folder
    expected = _narrow(folder)
    code, err, _ = cli(capsys, "index", folder, "-o", tmp_path / "index", "--no-progress")
    assert code == 2 and err.strip() == expected
    assert not (tmp_path / "index").exists()


def test_good_parts_still_open_and_are_checksummed(vectors, tmp_path: Path, monkeypatch):
    folder = fake_store(tmp_path / "emb", vectors, parts=2).folder
    hashed: list[str] = []
    record = lambda path: hashed.append(path.name) or file_digest(path)  # noqa: E731
    monkeypatch.setattr(store_module, "file_digest", record)
    store = EmbeddingStore.open(folder)
    assert len(store) == 120 and store.dimension == 16
    assert sorted(hashed) == sorted(f"part-0000{i}-of-00002.{s}" for i in range(2) for s in ("npy", "ids"))
