"""Index builds that stream: filled in batches from memory-mapped parts, they equal the one-shot index;
a build killed mid-way leaves no half index; one that cannot fit in memory is refused before any work;
a saved index can be searched memory-mapped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from densekit.data import Dataset
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.encoding.corpus import encode_corpus
from densekit.index import FaissIndex, IndexSpec, SearchIndex, build_index
from densekit.index import memory as memory_module
from densekit.index.backends import faiss_index
from densekit.index.memory import IndexTooLarge, build_bytes, index_bytes
from densekit.models import DenseEncoder

from .test_index import fake_store
from .test_outputs import cli

SPECS = {
    "flat": IndexSpec(type="flat"),
    "hnsw": IndexSpec(type="hnsw", ef_search=1024),  # candidates >= rows: an exhaustive, exact search
    "ivfpq": IndexSpec(type="ivfpq"),
}


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    data = np.random.default_rng(11).standard_normal((600, 32)).astype(np.float32)
    return data / np.linalg.norm(data, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", SPECS)
def test_a_build_in_small_batches_over_parts_equals_the_one_shot_index(
    vectors, tmp_path: Path, monkeypatch, kind: str
):
    store = fake_store(tmp_path / "emb", vectors, parts=3)
    real_memmap, mapped = np.memmap, []

    def record(*args, **kwargs):
        mapped.append(kwargs["shape"] if "shape" in kwargs else args[4])
        return real_memmap(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(np, "memmap", record)
        build_index(store, SPECS[kind], tmp_path / "index", show_progress=False, add_batch=7)
    assert all(rows <= 7 for rows, _ in mapped)  # no map of more than one batch, not even for training
    passes = 2 if kind == "ivfpq" else 1  # training reads every batch once to draw its sample
    assert sum(rows for rows, _ in mapped) == passes * len(vectors)
    streamed = SearchIndex.load(tmp_path / "index")
    one_shot = FaissIndex.from_vectors(vectors, store.ids(), SPECS[kind])
    assert streamed.rows == one_shot.rows == len(vectors)
    assert list(streamed.ids) == list(one_shot.ids) == store.ids()
    assert streamed.meta["spec"] == one_shot.meta["spec"]
    queries = vectors[:40] + np.random.default_rng(1).normal(0, 0.05, (40, 32)).astype(np.float32)
    got, expected = streamed.search(queries, 10), one_shot.search(queries, 10)
    assert np.array_equal(got.doc_ids(), expected.doc_ids())
    assert np.allclose(got.scores, expected.scores, atol=1e-5)


_KILLED_BUILD = textwrap.dedent(
    """
    import pathlib, sys, time
    import faiss
    from densekit.encoding.store import EmbeddingStore
    from densekit.index import IndexSpec, build_index
    from densekit.index.backends import faiss_index

    emb, out, stage, here = sys.argv[1:5]

    def wait_to_be_killed():
        pathlib.Path(here).write_text("here")
        time.sleep(600)

    if stage == "add":  # stop after the first batch went in
        check = faiss_index.check_finite_rows
        def checked(vectors, source, ids, start=0):
            if start > 0:
                wait_to_be_killed()
            check(vectors, source, ids, start)
        faiss_index.check_finite_rows = checked
    else:  # stop with the index file written and the rest of the folder not
        write = faiss.write_index
        def written(index, path):
            write(index, path)
            wait_to_be_killed()
        faiss_index.faiss.write_index = written
    store = EmbeddingStore.open(emb)
    spec = IndexSpec(type="hnsw")
    build_index(store, spec, pathlib.Path(out), show_progress=False, add_batch=100, overwrite=True)
    """
)


@pytest.mark.parametrize(("stage", "previous"), [("add", False), ("write", False), ("write", True)])
def test_a_build_killed_mid_way_leaves_no_half_index_and_the_next_completes(
    vectors, tmp_path: Path, stage: str, previous: bool
):
    store = fake_store(tmp_path / "emb", vectors, parts=3)
    out = tmp_path / "index"
    if previous:
        build_index(store, IndexSpec(type="flat"), out, show_progress=False)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
    here = tmp_path / "here"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, store.folder, out, stage, here])
    deadline = time.monotonic() + 120
    while not here.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert here.exists(), f"the build never reached its {stage} stage (exit {child.poll()})"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".index.tmp-")]
    assert len(left) == (1 if stage == "write" else 0)  # the killed writer's temporary, and only that
    if previous:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert SearchIndex.load(out).spec.type == "flat"
    else:
        assert not out.exists()
    build_index(store, IndexSpec(type="hnsw"), out, show_progress=False, overwrite=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".index.")] == []
    rebuilt = SearchIndex.load(out)
    assert rebuilt.spec.type == "hnsw" and rebuilt.rows == len(vectors) and list(rebuilt.ids) == store.ids()


@pytest.mark.parametrize("kind", SPECS)
def test_the_memory_estimate_is_what_faiss_holds(tmp_path: Path, kind: str):
    data = np.random.default_rng(2).standard_normal((5000, 64)).astype(np.float32)
    store = fake_store(tmp_path / "emb", data)
    build_index(store, SPECS[kind], tmp_path / "index", show_progress=False)
    written = (tmp_path / "index" / "index.faiss").stat().st_size  # faiss writes what it holds
    spec = SearchIndex.load(tmp_path / "index").spec
    assert abs(index_bytes(spec, 5000, 64) - written) / written < 0.03


def test_an_index_that_cannot_fit_is_refused_before_any_work(vectors, tmp_path: Path, monkeypatch):
    store = fake_store(tmp_path / "emb", vectors)
    monkeypatch.setattr(memory_module, "available_memory", lambda: (50_000, "a test's figure"))
    monkeypatch.setattr(faiss_index, "_training_sample", lambda *a: pytest.fail("training began"))
    spec = IndexSpec(type="ivfpq").resolved(600, 32)
    needed = build_bytes(spec, 600, 32, faiss_index._ADD_BATCH, 600)
    assert needed > 50_000
    with pytest.raises(IndexTooLarge) as err:
        build_index(store, IndexSpec(type="ivfpq"), tmp_path / "index", show_progress=False)
    assert str(err.value) == (
        f"a ivfpq index of 600 x 32 vectors needs about {needed} bytes (0.00 GiB) to build; 50000 bytes "
        "(0.00 GiB) are available (a test's figure): --pq-m 8 x --pq-bits 3 make its codes 6.45 KiB; "
        "choose a smaller --pq-m, free memory, or pass --no-memory-check to build it anyway"
    )
    assert not (tmp_path / "index").exists()


def test_index_refuses_in_one_line_unless_told_not_to_check(capsys, vectors, tmp_path: Path, monkeypatch):
    folder = fake_store(tmp_path / "emb", vectors).folder
    monkeypatch.setattr(memory_module, "available_memory", lambda: (1000, "MemAvailable in /proc/meminfo"))
    code, err, _ = cli(capsys, "index", folder, "-o", tmp_path / "index", "--no-progress")
    assert code == 2 and err.startswith("error: a flat index of 600 x 32 vectors needs about 153600 bytes")
    assert not (tmp_path / "index").exists()
    command = ["index", folder, "-o", tmp_path / "index", "--no-progress"]
    code, err, _ = cli(capsys, *command, "--no-memory-check")
    assert code == 0, err
    assert SearchIndex.load(tmp_path / "index").rows == 600


def test_available_memory_is_a_positive_figure_below_the_machine_s_memory():
    available, source = memory_module.available_memory()
    assert 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and source


@pytest.mark.parametrize("kind", SPECS)
def test_a_memory_mapped_index_searches_as_a_loaded_one(vectors, tmp_path: Path, monkeypatch, kind: str):
    build_index(fake_store(tmp_path / "emb", vectors), SPECS[kind], tmp_path / "index", show_progress=False)
    flags = []
    read = faiss.read_index
    monkeypatch.setattr(faiss_index.faiss, "read_index", lambda path, f=0: flags.append(f) or read(path, f))
    loaded, mapped = SearchIndex.load(tmp_path / "index"), SearchIndex.load(tmp_path / "index", mmap=True)
    assert flags == [0, faiss.IO_FLAG_MMAP if kind == "ivfpq" else faiss.IO_FLAG_MMAP_IFC]
    queries = vectors[:20]
    assert np.array_equal(loaded.search(queries, 10).doc_ids(), mapped.search(queries, 10).doc_ids())
    with pytest.raises(ValueError, match="a memory-mapped index is searched on the CPU"):
        SearchIndex.load(tmp_path / "index", gpu=True, mmap=True)


def test_search_mmap_index_writes_the_same_run(capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_st_model)
    encode_corpus(encoder, Dataset.open(beir_dir), tmp_path / "emb", show_progress=False)
    assert cli(capsys, "index", tmp_path / "emb", "-o", tmp_path / "index", "--no-progress")[0] == 0
    for name, extra in (("loaded", []), ("mapped", ["--mmap-index"])):
        command = ["search", tiny_st_model, tmp_path / "index", beir_dir, "-o", tmp_path / f"{name}.trec"]
        assert cli(capsys, *command, "--no-progress", *extra)[0] == 0
    runs = [read_run(tmp_path / f"{name}.trec", Diagnostics()) for name in ("loaded", "mapped")]
    assert runs[0] == runs[1] and runs[0]
