"""compression on a tiny collection and model: every method's memory, quality and speed, measured from
the same vectors; the figures checked against the indexes and sentence-transformers searched here; a
run started again encodes nothing and keeps every stage."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

from benchmarks import compression
from benchmarks.ann_measures import recall_against
from benchmarks.tests import wiki_fixtures
from benchmarks.tests.wiki_fixtures import one_thread, write_collection  # noqa: F401 (fixture)
from densekit.encoding.store import EmbeddingStore
from densekit.index import SearchIndex

DOCUMENTS, TEST_QUERIES, DIMENSION = 150, 20, 32  # the tiny model's width
FULL = 25  # 25 x 10 candidates: every document, so rescoring against float32 is exact search


@pytest.fixture
def small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding one collection of `DOCUMENTS` passages, `TEST_QUERIES` test queries."""
    monkeypatch.setattr(wiki_fixtures, "PASSAGES", DOCUMENTS)
    monkeypatch.setattr(wiki_fixtures, "QUERIES", {"test": TEST_QUERIES, "train": 10})
    write_collection(tmp_path / "shared" / "small")
    return tmp_path / "shared"


def test_every_method_measured_from_the_same_vectors_and_a_second_run_keeps_it(
    small: Path, tmp_path: Path, tiny_st_model: Path
):
    work, output = tmp_path / "work", tmp_path / "results" / "compression.json"
    argv = ["--shared", str(small), "--collections", "small", "--model", str(tiny_st_model),
            "--work", str(work), "--output", str(output), "--rescore", "2", str(FULL), "--threads", "1",
            "--batches", "1", "8", "--seconds", "0.01", "--rounds", "2", "--device", "cpu"]  # fmt: skip
    compression.main(argv)
    results = json.loads(output.read_text())
    target = results["collections"]["small"]
    assert target["collection"]["documents"] == DOCUMENTS
    assert target["collection"]["test_queries"] == TEST_QUERIES
    names = [m.name for m in compression.methods([2, FULL], [])]
    assert list(compression.entries(target)) == names
    assert "st ubinary x25" in names and "binary + float32 x2" in names and "ivfpq" in names

    # memory: float32 4 bytes a dimension, int8 one, binary one bit; the rescoring copy on disk only;
    # sentence-transformers' int8 for faiss is held as float32 in its IndexFlatIP
    memory = {name: compression.entries(target)[name]["build"]["memory"] for name in names}
    ram = {name: value["ram_bytes_per_vector"] for name, value in memory.items()}
    assert ram["flat"] == 4 * DIMENSION and ram["int8"] == DIMENSION and ram["binary"] == DIMENSION / 8
    assert ram["binary + int8 x2"] == ram["binary + float32 x2"] == ram["st ubinary x2"] == DIMENSION / 8
    assert ram["st int8"] == 4 * DIMENSION
    disk = {name: value["disk_bytes_per_vector"] for name, value in memory.items()}
    assert DIMENSION / 8 + DIMENSION < disk["binary + int8 x2"] < DIMENSION / 8 + DIMENSION + 2
    assert DIMENSION / 8 + 4 * DIMENSION < disk["binary + float32 x2"] < DIMENSION / 8 + 4 * DIMENSION + 2
    assert compression.entries(target)["binary + int8 x2"]["build"]["command"] == (
        "densekit index --type binary --rescore 2"
    )

    # quality, against what the saved indexes and sentence-transformers give when searched here
    quality = {name: compression.entries(target)[name]["quality"] for name in names}
    vectors = EmbeddingStore.open(work / "small" / "embeddings").vectors()
    test = np.load(next((work / "queries").glob("test-*.npy")))
    _, exact = faiss.knn(test, vectors, 10, metric=faiss.METRIC_INNER_PRODUCT)
    for name in ("int8", "binary + int8 x2", "binary + float32 x2"):
        found = SearchIndex.load(work / "small" / name.replace(" + ", "-").replace(" ", "-")).search(test, 10)
        assert quality[name]["recall@10"] == recall_against(found.labels, exact)
    codes = quantize_embeddings(vectors, precision="ubinary")
    st, _ = semantic_search_faiss(test, codes, corpus_precision="ubinary", top_k=10, rescore_multiplier=2)
    st_labels = np.array([[hit["corpus_id"] for hit in hits] for hits in st])
    assert quality["st ubinary x2"]["recall@10"] == recall_against(st_labels, exact)
    assert quality["flat"]["recall@10"] == 1.0 and quality["flat"]["share_of_flat"] == 1.0
    assert quality["binary + float32 x25"]["recall@10"] == 1.0  # every document rescored exactly
    assert quality["binary + float32 x25"]["nDCG@10"] == quality["flat"]["nDCG@10"]
    for measure in ("nDCG@10", "recall@10"):  # the same codes in the same faiss index
        assert quality["binary"][measure] == quality["st ubinary"][measure]
    for name in names:
        assert quality[name]["share_of_flat"] == quality[name]["nDCG@10"] / quality["flat"]["nDCG@10"]

    # speed: every method in the same rounds, at each setting, with the load average and the ratios
    for setting in ("1 thread, 1 a call", "1 thread, 8 a call"):
        measured = target["speed"][setting]
        assert len(measured["load_average_before"]) == len(measured["load_average_after"]) == 3
        for name in names:
            speed = compression.entries(target)[name]["speed"][setting]
            assert speed["qps"] > 0 and len(measured["rounds"][name]) == 2
        rival = compression.entries(target)["binary + int8 x2"]["speed"][setting]["x_rival"]
        assert rival == compression.ratio(measured, "binary + int8 x2", "st ubinary x2")

    goals = target["goals"]
    depths = goals["binary_int8_rescoring_0.99"]["depths"]
    assert sorted(int(depth) for depth in depths) == [2, FULL]
    for depth, value in depths.items():
        share = quality[f"binary + int8 x{depth}"]["share_of_flat"]
        assert value["met"] == (share >= 0.99) and value["ram_fraction_of_float32"] == 1 / 32
    against = goals["against_sentence_transformers"]["binary + int8 x2"]
    assert against["rival"] == "st ubinary x2"
    ours, theirs = quality["binary + int8 x2"]["nDCG@10"], quality["st ubinary x2"]["nDCG@10"]
    assert against["as_good"] == (ours >= theirs)
    table = output.with_suffix(".md").read_text()
    assert all(f"| {name} |" in table for name in names) and "Load average" in table
    assert output.with_suffix(".png").stat().st_size > 0

    # again: the embeddings are not encoded again and every stage is kept
    part = next((work / "small" / "embeddings").glob("*.npy"))
    written = part.stat().st_mtime_ns
    compression.main(argv)
    again = json.loads(output.read_text())
    assert part.stat().st_mtime_ns == written and len(again["runs"]) == 2
    for name in names:
        for stage in ("build", "quality"):
            assert compression.entries(again["collections"]["small"])[name][stage]["measured_in"] == 0
    assert again["collections"]["small"]["speed"]["measured_in"] == 0


def test_a_slice_is_measured_from_the_vectors_given_never_encoded(tmp_path: Path, tiny_st_model: Path):
    _, part, embeddings = wiki_fixtures.wiki_like(tmp_path, tiny_st_model)
    work, output = tmp_path / "work", tmp_path / "wiki.json"
    skip = ["ivfpq", "st int8", "st int8 x2", "binary + float32 x2"]
    compression.main(["--sizes", f"small={part}", "--embeddings", str(embeddings), "--model",
                      str(tiny_st_model), "--work", str(work), "--output", str(output), "--rescore", "2",
                      "--threads", "1", "--batches", "4", "--seconds", "0.01", "--rounds", "1",
                      "--binary-index", "hnsw", "ivf", "--skip", *skip])  # fmt: skip
    target = json.loads(output.read_text())["collections"]["small"]
    assert target["collection"]["documents"] == wiki_fixtures.SLICE
    assert target["collection"]["test_queries"] == wiki_fixtures.QUERIES["test"]
    measured = ["flat", "int8", "binary", "binary + int8 x2", "binary hnsw + int8 x2", "binary ivf + int8 x2",
                "st ubinary", "st ubinary x2"]  # fmt: skip
    assert list(compression.entries(target)) == measured
    # the slice's rows, taken by id from the whole corpus's vectors: flat's top 10 are exact search's
    store = EmbeddingStore.open(work / "small" / "embeddings")
    full = EmbeddingStore.open(embeddings)
    rows = {doc: row for row, doc in enumerate(full.ids())}
    assert np.array_equal(store.vectors(), full.vectors()[[rows[doc] for doc in store.ids()]])
    test = np.load(next((work / "queries").glob("test-*.npy")))
    _, exact = faiss.knn(test, store.vectors(), 10, metric=faiss.METRIC_INNER_PRODUCT)
    assert recall_against(np.load(work / "small" / "exact-test.npy"), exact) == 1.0
    assert target["binary"]["quality"]["nDCG@10"] == target["st ubinary"]["quality"]["nDCG@10"]
    assert target["speed"]["1 thread, 4 a call"]["binary + int8 x2_qps"] > 0

    # --binary-index hnsw ivf: the codes in faiss's binary HNSW or IVF index, rescored; measured as
    # searched here, with no sentence-transformers rival (its search scans every code)
    for structure, kind in (("hnsw", faiss.IndexBinaryHNSW), ("ivf", faiss.IndexBinaryIVF)):
        graph = target[f"binary {structure} + int8 x2"]
        assert (
            graph["build"]["command"]
            == f"densekit index --type binary --binary-index {structure} --rescore 2"
        )
        index = SearchIndex.load(work / "small" / f"binary-{structure}-int8-x2")
        assert isinstance(index.index, kind)
        assert graph["quality"]["recall@10"] == recall_against(index.search(test, 10).labels, exact)
        assert "x_rival" not in graph["speed"]["1 thread, 4 a call"]
        assert graph["speed"]["1 thread, 4 a call"]["qps"] > 0
    assert (
        target["binary hnsw + int8 x2"]["build"]["memory"]["ram_bytes_per_vector"]
        > target["binary + int8 x2"]["build"]["memory"]["ram_bytes_per_vector"]
    )  # the graph's links beside the codes


def test_each_nprobe_is_a_binary_ivf_method_of_its_own_that_builds_with_it():
    from benchmarks.compression import methods

    found = {m.name: m for m in methods([10], [], ("ivf",), (64, 256))}
    for nprobe in (64, 256):
        method = found[f"binary ivf nprobe {nprobe} + int8 x10"]
        assert method.spec().nprobe == nprobe and method.spec().binary_index == "ivf"
        assert (
            method.command(0.95)
            == f"densekit index --type binary --binary-index ivf --nprobe {nprobe} --rescore 10"
        )
    assert "binary ivf + int8 x10" not in found
    assert "binary ivf + int8 x10" in {m.name for m in methods([10], [], ("ivf",))}


@pytest.mark.parametrize("option", [["--nprobe", "64"], ["--nlist", "1024"], ["--ivf-centroids", "int8"]])
def test_a_binary_ivf_setting_without_a_binary_ivf_index_is_refused(capsys, option: list[str]):
    with pytest.raises(SystemExit):
        compression.main(option)
    assert f"{option[0]} sets binary ivf indexes: give --binary-index ivf with it" in capsys.readouterr().err


def test_each_kind_of_centroids_is_a_binary_ivf_method_of_its_own_with_the_lists_given():
    from benchmarks.compression import methods

    found = {m.name: m for m in methods([10], [], ("ivf",), (64,), (312,),
                                        {"nlist": 1024, "centroids": ("binary", "int8")})}  # fmt: skip
    method = found["binary ivf nlist 1024 nprobe 64 312 bits int8 centroids + int8 x10"]
    spec = method.spec()
    assert (spec.ivf_centroids, spec.nlist, spec.nprobe, spec.code_bits) == ("int8", 1024, 64, 312)
    assert method.command(0.95) == (
        "densekit index --type binary --binary-index ivf --nlist 1024 --nprobe 64 --code-bits 312 "
        "--ivf-centroids int8 --rescore 10"
    )
    binary = found["binary ivf nlist 1024 nprobe 64 312 bits + int8 x10"]
    assert binary.spec().ivf_centroids == "binary" and binary.spec().nlist == 1024


def test_each_code_bits_is_a_binary_ivf_method_of_its_own_that_builds_with_it():
    from benchmarks.compression import methods

    found = {m.name: m for m in methods([10], [], ("ivf",), (64,), (312,))}
    method = found["binary ivf nprobe 64 312 bits + int8 x10"]
    assert method.spec().code_bits == 312 and method.spec().nprobe == 64
    assert method.command(0.95) == (
        "densekit index --type binary --binary-index ivf --nprobe 64 --code-bits 312 --rescore 10"
    )
    assert found["binary ivf nprobe 64 + int8 x10"].spec().code_bits is None


def test_code_bits_without_a_binary_index_is_refused(capsys):
    with pytest.raises(SystemExit):
        compression.main(["--code-bits", "312"])
    assert "give --binary-index with it" in capsys.readouterr().err


def test_every_goal_needs_the_share_the_ram_and_the_speed_in_every_setting():
    def result(share: float, ram: float, speeds: list[float | None]) -> dict:
        timed = {f"setting {n}": {"x_flat": x} for n, x in enumerate(speeds)}
        return {"quality": {"share_of_flat": share}, "build": {"memory": {"ram_bytes_per_vector": ram}},
                "speed": timed}  # fmt: skip

    methods = {
        "binary ivf 312 bits + int8 x25": result(0.991, 47.6, [40, 10.2, 70, 16]),
        "binary ivf + int8 x10": result(0.991, 56.2, [40, 10.7, 70, 16]),  # 1/27
        "binary + int8 x10": result(0.999, 48, [18, 5.5, 38, 6]),  # too slow 32 a call
        "binary ivf nprobe 8 + int8 x10": result(0.95, 48, [140, 50, 300, 60]),  # loses too much
        "binary ivf nprobe 9 + int8 x10": result(0.995, 48, [140, None, 300, 60]),  # a setting not timed
        "st ubinary x10": result(0.999, 48, [40, 11, 70, 16]),  # not densekit's
        "flat": result(1.0, 1536, [1, 1, 1, 1]),
    }
    target = {"collection": {"dimension": 384}, **methods}
    found = compression.every_goal(target)
    assert set(found) == set(methods) - {"st ubinary x10", "flat"}
    assert [name for name, value in found.items() if value["met"]] == ["binary ivf 312 bits + int8 x25"]
    assert found["binary ivf + int8 x10"]["ram_fraction_of_float32"] == round(56.2 / 1536, 5)
    assert found["binary + int8 x10"]["least_x_flat"] == 5.5
    assert found["binary ivf nprobe 9 + int8 x10"]["least_x_flat"] is None
