"""The tests every index backend runs through, each (backend, type) the registry knows a case: its folder
loads with its backend and, at settings that make it search every vector, ranks as exact search does;
every file it saves is checked on load and its ids against its identity; another index at its output
is replaced only with overwrite; bad queries and search parameters it has no use for are refused; the
command line builds what Python builds.

`tests/test_extension_index.py` runs a new backend through the same `check_*` functions."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from densekit.diagnostics import DataError
from densekit.encoding.store import EmbeddingStore
from densekit.index import SearchIndex, SpecError, build_index
from densekit.index.base import IDS_FILE, registered_backends
from densekit.index.registry import spec_for
from densekit.io.artefact import MANIFEST, read_manifest
from densekit.io.fingerprint import file_digest
from densekit.io.outputs import OutputError

from .hostile.commands import cli
from .test_index import fake_store

ROWS, DIMENSION = 600, 32
# Settings that make each type search every vector at `ROWS` (so that every case is held to exact
# search's ranking), as functions of the test's folder; a type not named here runs with its defaults.
EXHAUSTIVE: dict[tuple[str, str], Callable[[Path], dict[str, Any]]] = {
    ("faiss", "hnsw"): lambda tmp: {"ef_search": 1024},  # candidates >= rows
    ("faiss", "ivfpq"): lambda tmp: {"nprobe": 1024, "refine_k_factor": 64},  # 640 re-ranked of 600
    ("milvus", "flat"): lambda tmp: {"uri": str(tmp / "milvus.db")},
    ("quantized", "binary"): lambda tmp: {"rescore": 64, "rescore_with": "float32"},  # 640 rescored
    ("quantized", "int8"): lambda tmp: {"rescore": 64, "rescore_with": "float32"},
}
CASES = [(name, kind) for name, backend in registered_backends().items() for kind in backend.types]
NEEDS = {"milvus": "milvus_lite"}  # a backend's optional dependency: its cases skip without it


def case_id(case: tuple[str, str]) -> str:
    return "-".join(case)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    """`ROWS` unit vectors around 30 centres: neighbours with clear ranks."""
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((30, DIMENSION))
    data = centres[rng.integers(0, 30, ROWS)] + 0.5 * rng.standard_normal((ROWS, DIMENSION))
    return (data / np.linalg.norm(data, axis=1, keepdims=True)).astype(np.float32)


def settings_of(case: tuple[str, str], folder: Path) -> dict[str, Any]:
    """The case's settings that make it search every vector."""
    if case[0] in NEEDS:
        pytest.importorskip(NEEDS[case[0]])
    return EXHAUSTIVE.get(case, lambda tmp: {})(folder)


def build_case(case: tuple[str, str], store: EmbeddingStore, output: Path, **options: Any) -> SearchIndex:
    """Build the case's index of `store` at `output` from Python and load it."""
    spec = spec_for(case[1], case[0], settings_of(case, output.parent))
    build_index(store, spec, output, show_progress=False, **options)
    return SearchIndex.load(output)


def exact_ids(queries: np.ndarray, vectors: np.ndarray, depth: int) -> list[list[str]]:
    """Each query's top `depth` documents by inner product, by numpy."""
    order = np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :depth]
    return [[f"doc{row}" for row in rows] for rows in order]


def check_loads_and_ranks_as_exact_search(case: tuple[str, str], vectors: np.ndarray, tmp_path: Path) -> None:
    store = fake_store(tmp_path / "emb", vectors, parts=3)
    index = build_case(case, store, tmp_path / "index")
    assert type(index) is registered_backends()[case[0]] and index.spec.type == case[1]
    assert (index.rows, index.dimension) == (ROWS, DIMENSION)
    assert index.ids.tolist() == store.ids()
    queries = vectors[:20] + np.random.default_rng(1).normal(0, 0.05, (20, DIMENSION)).astype(np.float32)
    hits = index.search(queries, 10)
    assert hits.doc_ids().tolist() == exact_ids(queries, vectors, 10)
    assert np.allclose(hits.scores, np.sort(queries @ vectors.T, axis=1)[:, ::-1][:, :10], atol=1e-4)
    own = index.search_run(vectors[:5], [f"doc{row}" for row in range(5)], 10)
    assert [list(ranked) for ranked in own.values()] == [
        [doc for doc in ranked if doc != f"doc{row}"][:10]
        for row, ranked in enumerate(exact_ids(vectors[:5], vectors, 11))
    ]  # each document's own row left out
    assert index.search(queries[:2], 10**6).labels.shape == (2, ROWS)  # k capped at the rows held


def check_files_and_ids_are_checked_on_load(
    case: tuple[str, str], vectors: np.ndarray, tmp_path: Path
) -> None:
    store = fake_store(tmp_path / "emb", vectors[:100])
    build_case(case, store, tmp_path / "index")
    folder = tmp_path / "index"
    checksums = read_manifest(folder).checksums  # type: ignore[union-attr]
    assert {IDS_FILE, "index.json"} <= set(checksums)
    for name in checksums:
        saved = (folder / name).read_bytes()
        changed = bytearray(saved)
        changed[len(changed) // 2] ^= 0x01
        (folder / name).write_bytes(bytes(changed))
        with pytest.raises(DataError, match=f"{name}: error: its checksum differs"):
            SearchIndex.load(folder)
        (folder / name).write_bytes(saved)
    lines = (folder / IDS_FILE).read_text().splitlines()
    (folder / IDS_FILE).write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    manifest = read_manifest(folder)
    manifest.checksums[IDS_FILE] = file_digest(folder / IDS_FILE)  # type: ignore[union-attr]
    (folder / MANIFEST).write_text(manifest.to_json())  # type: ignore[union-attr]
    with pytest.raises(DataError, match="not the ids the index was built with"):
        SearchIndex.load(folder)


def check_bad_queries_and_unused_parameters_are_refused(
    case: tuple[str, str], vectors: np.ndarray, tmp_path: Path
) -> None:
    index = build_case(case, fake_store(tmp_path / "emb", vectors[:100]), tmp_path / "index")
    with pytest.raises(ValueError, match=f"dimension {DIMENSION}"):
        index.search(np.zeros((1, DIMENSION + 1), dtype=np.float32), 3)
    with pytest.raises(ValueError, match="k=0"):
        index.search(vectors[:1], 0)
    with pytest.raises(SpecError):  # no type uses both
        index.set_search_parameters(ef_search=8, nprobe=8)


def check_the_command_line_builds_what_python_builds(
    case: tuple[str, str], vectors: np.ndarray, tmp_path: Path, capsys
) -> None:
    store = fake_store(tmp_path / "emb", vectors[:100])
    python = build_case(case, store, tmp_path / "python")
    settings = [f"--setting={name}={value}" for name, value in settings_of(case, tmp_path).items()]
    code, err, _ = cli(capsys, "index", store.folder, "-o", tmp_path / "cli", "--backend", case[0], "--type",
                       case[1], *settings, "--no-progress")  # fmt: skip
    assert code == 0, err
    built = SearchIndex.load(tmp_path / "cli")
    assert type(built) is type(python)
    meta = {
        folder: json.loads((tmp_path / folder / "index.json").read_text()) for folder in ("python", "cli")
    }
    meta["python"].pop("collection", None), meta["cli"].pop("collection", None)  # named by each folder
    assert meta["python"] == meta["cli"]
    assert np.array_equal(built.search(vectors[:5], 10).doc_ids(), python.search(vectors[:5], 10).doc_ids())


def check_another_index_is_replaced_only_with_overwrite(
    case: tuple[str, str], vectors: np.ndarray, tmp_path: Path
) -> None:
    first = fake_store(tmp_path / "first", vectors[:100], corpus="first")
    other = fake_store(tmp_path / "other", vectors[100:250], corpus="other")
    build_case(case, first, tmp_path / "index")
    saved = {path.name: path.read_bytes() for path in (tmp_path / "index").iterdir()}
    with pytest.raises(
        OutputError, match=r"holds an index made from other inputs or settings \(differs in: "
    ):
        build_case(case, other, tmp_path / "index")
    assert {path.name: path.read_bytes() for path in (tmp_path / "index").iterdir()} == saved
    assert SearchIndex.load(tmp_path / "index").rows == 100
    build_case(case, first, tmp_path / "index")  # the same index again: no --overwrite needed
    assert build_case(case, other, tmp_path / "index", overwrite=True).rows == 150


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_backends_folder_loads_with_it_and_ranks_as_exact_search(case, vectors, tmp_path: Path):
    check_loads_and_ranks_as_exact_search(case, vectors, tmp_path)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_backends_files_and_ids_are_checked_on_load(case, vectors, tmp_path: Path):
    check_files_and_ids_are_checked_on_load(case, vectors, tmp_path)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_backend_refuses_bad_queries_and_parameters_it_has_no_use_for(case, vectors, tmp_path: Path):
    check_bad_queries_and_unused_parameters_are_refused(case, vectors, tmp_path)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_command_line_builds_what_python_builds(case, vectors, tmp_path: Path, capsys):
    check_the_command_line_builds_what_python_builds(case, vectors, tmp_path, capsys)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_another_index_is_replaced_only_with_overwrite(case, vectors, tmp_path: Path):
    check_another_index_is_replaced_only_with_overwrite(case, vectors, tmp_path)


SHARED = [
    test_a_backends_folder_loads_with_it_and_ranks_as_exact_search,
    test_another_index_is_replaced_only_with_overwrite,
    test_a_backends_files_and_ids_are_checked_on_load,
    test_a_backend_refuses_bad_queries_and_parameters_it_has_no_use_for,
    test_the_command_line_builds_what_python_builds,
]


def test_every_registered_backend_and_type_runs_through_the_shared_tests():
    assert {"faiss", "milvus"} <= set(registered_backends())
    for test in SHARED:
        (mark,) = [mark for mark in test.pytestmark if mark.name == "parametrize"]
        assert set(mark.args[1]) == {
            (name, kind) for name, b in registered_backends().items() for kind in b.types
        }
