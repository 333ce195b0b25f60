"""Approximate indexes against exact search: the training sample, recall recorded at build, and the
search setting chosen for a target recall (`densekit.index.recall`)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import faiss
import numpy as np
import pytest

from densekit.index import FaissIndex, IndexSpec, SearchIndex, build_index
from densekit.index import memory as memory_module
from densekit.index.backends import faiss_index
from densekit.index.recall import RecallSettings, TargetUnreachable, smallest_meeting
from densekit.index.spec import MIN_POINTS_PER_CENTROID
from densekit.io.artefact import read_manifest
from densekit.io.fingerprint import file_digest
from densekit.progress import INTERVAL_VARIABLE

from .conftest import tiny_bert
from .hostile.commands import cli
from .test_index import fake_store


@pytest.fixture(autouse=True)
def one_faiss_thread():
    """faiss on one thread: its threads spin waiting for each other on a busy two-core machine."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


@pytest.fixture(scope="module")
def clustered() -> np.ndarray:
    """2,000 unit vectors of 32 dimensions around 40 centres: neighbours an index can find."""
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((40, 32))
    data = centres[rng.integers(0, 40, 2000)] + 0.6 * rng.standard_normal((2000, 32))
    return (data / np.linalg.norm(data, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def queries(clustered: np.ndarray) -> np.ndarray:
    """300 queries near the collection's vectors, not among them."""
    rng = np.random.default_rng(4)
    near = clustered[rng.integers(0, len(clustered), 300)] + 0.3 * rng.standard_normal((300, 32))
    return (near / np.linalg.norm(near, axis=1, keepdims=True)).astype(np.float32)


def exact_rows(queries: np.ndarray, vectors: np.ndarray, depth: int, own: np.ndarray | None = None) -> list:
    """Each query's top `depth` rows by inner product, by numpy (its own row left out, given `own`)."""
    scores = queries @ vectors.T
    if own is not None:
        scores[np.arange(len(queries)), own] = -np.inf
    return [set(row[:depth]) for row in np.argsort(-scores, axis=1, kind="stable")]


def recount(
    index: SearchIndex, queries: np.ndarray, vectors: np.ndarray, depth: int, own=None, truth=None
) -> float:
    """Recall@`depth` of a loaded index as set now, counted by numpy against brute force (`truth`, when
    given, its result)."""
    labels = index.search(queries, depth + (own is not None)).labels
    found = [[r for r in row if own is None or r != own[i]][:depth] for i, row in enumerate(labels)]
    truth = truth or exact_rows(queries, vectors, depth, own)
    return float(np.mean([len(set(f) & t) / len(t) for f, t in zip(found, truth, strict=True)]))


@pytest.mark.parametrize("rows", [78, 1000, 10**5, 262_144, 10**6, 2_883_000, 8_841_823, 20 * 10**6, 10**8])
def test_every_automatic_nlist_trains_on_at_least_39_vectors_a_list(rows: int):
    spec = IndexSpec(type="ivfpq").resolved(rows, 384)
    assert spec.nlist is not None
    assert faiss_index._training_rows(spec, rows) >= MIN_POINTS_PER_CENTROID * spec.nlist


def test_the_build_trains_on_the_sample_the_memory_check_counts(clustered, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(faiss_index, "_MAX_TRAINING_POINTS", 300)  # a floor below 39 x 40 lists
    drawn = []
    sample = faiss_index._training_sample
    monkeypatch.setattr(faiss_index, "_training_sample", lambda *a: drawn.append(sample(*a)) or drawn[-1])
    store = fake_store(tmp_path / "emb", clustered)
    spec = IndexSpec(type="ivfpq", nlist=40, pq_m=8, pq_bits=4)
    build_index(store, spec, tmp_path / "index", show_progress=False)
    assert len(drawn[0]) >= MIN_POINTS_PER_CENTROID * 40
    needed = memory_module.build_bytes(
        spec.resolved(2000, 32), 2000, 32, faiss_index._ADD_BATCH, len(drawn[0])
    )
    monkeypatch.setattr(memory_module, "available_memory", lambda: (needed - 1, "a test's figure"))
    with pytest.raises(memory_module.IndexTooLarge, match=f"needs about {needed} bytes"):
        build_index(store, spec, tmp_path / "index2", show_progress=False)


@pytest.mark.parametrize(
    "spec", [IndexSpec(type="ivfpq", pq_m=8), IndexSpec(type="hnsw", hnsw_m=4, ef_construction=16)]
)
def test_the_recall_in_the_manifest_equals_a_recount(clustered, queries, tmp_path: Path, spec: IndexSpec):
    store = fake_store(tmp_path / "emb", clustered)
    build_index(store, spec, tmp_path / "sampled", show_progress=False, recall=RecallSettings(queries=200))
    given = RecallSettings(vectors=queries, source="test queries")
    build_index(store, spec, tmp_path / "given", show_progress=False, recall=given)
    for folder in ("sampled", "given"):
        recorded = read_manifest(tmp_path / folder).about["recall"]  # type: ignore[union-attr]
        index = SearchIndex.load(tmp_path / folder)
        own = np.array(recorded["rows"]) if folder == "sampled" else None
        held = clustered[own] if own is not None else queries
        assert recorded["queries"] == len(held)
        assert recorded["parameters"] == ({"nprobe": 32} if spec.type == "ivfpq" else {"ef_search": 256})
        for depth in (10, 100):
            assert recorded[f"recall@{depth}"] == pytest.approx(
                recount(index, held, clustered, depth, own), abs=1e-9
            )
        assert 0.2 < recorded["recall@10"] < 1.0  # approximate: a measurement, not a constant


def smallest_by_sweep(index: SearchIndex, name: str, values, queries, vectors, target: float) -> int:
    """The smallest value whose recall@10, counted by numpy, meets `target`: every value tried in order."""
    truth = exact_rows(queries, vectors, 10)
    for value in values:
        index.set_search_parameters(**{name: value})
        if recount(index, queries, vectors, 10, truth=truth) >= target:
            return value
    raise AssertionError("no value meets the target")


@pytest.mark.parametrize(
    ("spec", "name", "target"),
    [(IndexSpec(type="ivfpq", pq_m=32, pq_bits=5), "nprobe", 0.9),
     (IndexSpec(type="hnsw", hnsw_m=8, ef_construction=32), "ef_search", 0.97)],
)  # fmt: skip
def test_the_chosen_setting_is_the_smallest_a_brute_force_sweep_finds(
    clustered, queries, tmp_path: Path, spec: IndexSpec, name: str, target: float
):
    store = fake_store(tmp_path / "emb", clustered)
    settings = RecallSettings(target=target, vectors=queries, source="test queries")
    build_index(store, spec, tmp_path / "index", show_progress=False, recall=settings)
    index = SearchIndex.load(tmp_path / "index")
    chosen = getattr(index.spec, name)
    recorded = read_manifest(tmp_path / "index").about["recall"]  # type: ignore[union-attr]
    assert recorded["parameters"] == {name: chosen} and recorded["target"] == target
    assert recorded["recall@10"] >= target
    values = range(1, index.spec.nlist + 1) if name == "nprobe" else range(10, 2000)
    assert chosen == smallest_by_sweep(index, name, values, queries, clustered, target)
    assert chosen > values[0]  # the target chose: the smallest value does not meet it


def saturating(cap: float, rate: float, shape: str):
    """A recall curve over values 1, 2, ... that rises ever more slowly as the value doubles, towards
    `cap` (`concave`), or slowly first and then so (`s-shaped`, as a tiny nprobe can give)."""
    if shape == "concave":
        return lambda value: cap * (1 - value**-rate)
    return lambda value: cap / (1 + np.exp(-rate * (np.log2(value) - 4)))


@pytest.mark.parametrize("shape", ["concave", "s-shaped"])
def test_giving_up_at_a_plateau_never_changes_what_the_search_chooses(shape: str):
    candidates = list(range(1, 2191))  # an IVF of 2,190 lists, as at 300k wiki1m vectors
    gave_up_early = 0
    for cap in (0.8, 0.85, 0.9, 0.95, 0.99, 1.0):
        for rate in (0.3, 0.6, 1.0, 2.0):
            curve = saturating(cap, rate, shape)
            for target in (0.5, 0.8, 0.9, 0.95, 0.97):
                swept = next((value for value in candidates if curve(value) >= target), None)
                chosen, tried = smallest_meeting(candidates, curve, target, str)
                assert chosen == swept, (cap, rate, target)
                gave_up_early += chosen is None and candidates[-1] not in tried
    assert gave_up_early > 10  # the plateau rule took effect where the target is out of reach


def test_a_second_choice_whose_largest_value_met_the_target_never_gives_up():
    # flat until the last value, which (as the widest re-ranking at the nprobe it chose) meets the target
    def recall_of(value: int) -> float:
        return 0.96 if value == 64 else 0.5

    candidates = list(range(1, 65))
    assert smallest_meeting(candidates, recall_of, 0.95, str)[0] is None  # the plateau, taken as final
    assert smallest_meeting(candidates, recall_of, 0.95, str, largest_meets=True)[0] == 64


def test_an_ivfpq_target_its_codes_cannot_reach_stops_probing_where_recall_stops_growing(caplog):
    recall_by_nprobe = {1: 0.3919, 3: 0.5621, 7: 0.6608, 15: 0.7276, 31: 0.7729, 63: 0.8041, 127: 0.8256,
                        255: 0.8381, 511: 0.8452, 1023: 0.8480, 2047: 0.8489, 2190: 0.8489}  # fmt: skip
    # measured on 300,000 wiki1m vectors (benchmarks/wiki_ann.py's log): every doubling up to all lists
    with caplog.at_level(logging.INFO, logger="densekit.index.recall"):
        chosen, tried = smallest_meeting(list(range(1, 2191)), recall_by_nprobe.__getitem__, 0.95, str)
    assert chosen is None and max(tried) == 255
    assert "cannot reach 0.95 at that rate: stopping" in caplog.text


def test_search_mining_and_serving_load_the_recorded_setting_unless_told(clustered, queries, tmp_path: Path):
    store = fake_store(tmp_path / "emb", clustered)
    for spec, name in ((IndexSpec(type="ivfpq", pq_m=32, pq_bits=5), "nprobe"),
                       (IndexSpec(type="hnsw", hnsw_m=4, ef_construction=16), "ef_search")):  # fmt: skip
        settings = RecallSettings(target=0.9, vectors=queries, source="test queries")
        build_index(store, spec, tmp_path / name, show_progress=False, recall=settings)
        loaded = SearchIndex.load(tmp_path / name)  # as search, mine and serve (the Retriever) load it
        chosen = getattr(loaded.spec, name)
        assert chosen != getattr(IndexSpec(), name)
        setting = (
            (lambda i: faiss.extract_index_ivf(i).nprobe) if name == "nprobe" else (lambda i: i.hnsw.efSearch)
        )
        assert setting(loaded.index) == chosen
        loaded.set_search_parameters(**{name: 5 + chosen})  # `search --nprobe` / `--ef-search`
        assert setting(loaded.index) == 5 + chosen
        assert recount(loaded, queries, clustered, 10) != pytest.approx(0.0)


def test_ivfpq_re_ranks_with_the_exact_vectors_where_its_codes_cannot_meet_the_target(
    clustered, queries, tmp_path: Path
):
    store = fake_store(tmp_path / "emb", clustered)
    spec = IndexSpec(type="ivfpq", pq_m=2, pq_bits=4)  # codes too coarse to rank the top 10
    settings = RecallSettings(target=0.95, vectors=queries, source="test queries")
    build_index(store, spec, tmp_path / "index", show_progress=False, recall=settings)
    index = SearchIndex.load(tmp_path / "index")
    recorded = read_manifest(tmp_path / "index").about["recall"]  # type: ignore[union-attr]
    k_factor = index.spec.refine_k_factor
    assert k_factor is not None and isinstance(faiss.downcast_index(index.index), faiss.IndexRefine)
    assert recorded["parameters"] == {"nprobe": index.spec.nprobe, "refine_k_factor": k_factor}
    assert recorded["refine_bytes"] == 2000 * 32 * 4 == memory_module.refine_bytes(index.spec, 2000, 32)
    assert recorded["recall@10"] == pytest.approx(recount(index, queries, clustered, 10), abs=1e-9)
    assert recorded["recall@10"] >= 0.95
    truth = exact_rows(queries, clustered, 10)
    for smaller in range(1, k_factor):  # at the chosen nprobe
        faiss.ParameterSpace().set_index_parameter(index.index, "k_factor_rf", smaller)
        assert recount(index, queries, clustered, 10, truth=truth) < 0.95
    meta = {**index.meta, "spec": {**index.meta["spec"], "refine_k_factor": None}}
    plain = FaissIndex(faiss.downcast_index(index.index).base_index, list(index.ids), meta, tmp_path)
    plain.set_search_parameters(nprobe=index.spec.nlist)
    assert recount(plain, queries, clustered, 10, truth=truth) < 0.95  # its codes alone, every list probed


@pytest.mark.parametrize(
    ("spec", "target", "names"),
    [(IndexSpec(type="hnsw", hnsw_m=8, ef_construction=32), 0.97, ["ef_search"]),
     (IndexSpec(type="ivfpq", pq_m=2, pq_bits=4), 0.95, ["nprobe", "refine_k_factor"])],
)  # fmt: skip
def test_each_setting_tried_is_logged_with_its_recall_and_the_exact_search_shows_progress(
    clustered, queries, tmp_path: Path, caplog, capfd, monkeypatch, spec: IndexSpec, target: float, names
):
    monkeypatch.setenv(INTERVAL_VARIABLE, "60")  # plain lines: at the start and at the end
    store = fake_store(tmp_path / "emb", clustered)
    settings = RecallSettings(target=target, vectors=queries, source="test queries")
    with caplog.at_level(logging.INFO, logger="densekit.index.recall"):
        build_index(store, spec, tmp_path / "index", show_progress=True, recall=settings)
    tried = read_manifest(tmp_path / "index").about["recall"]["tried"]  # type: ignore[union-attr]
    chosen = SearchIndex.load(tmp_path / "index").spec
    labels = {"ef_search": "ef_search {}", "nprobe": "nprobe {}, re-ranking 64 x k",
              "refine_k_factor": f"nprobe {chosen.nprobe}, refine_k_factor {{}}"}  # fmt: skip
    expected = [f"{labels[name].format(value)}: recall@10 {recall:.4f} (target {target})"
                for name in names for value, recall in tried[name].items()]  # fmt: skip
    logged = [record.getMessage() for record in caplog.records]
    before = logged[: len(logged) - len(expected)]  # IVF-PQ: its codes alone first, not recorded
    assert logged[len(before) :] == expected
    codes_alone = rf"nprobe \d+: recall@10 0\.\d{{4}} \(target {target}\)"
    gained = r"gained -?0\.\d{4} and -?0\.\d{4} on the last two doublings"
    gave_up = rf"nprobe \d+: recall@10 0\.\d{{4}} {gained}; .*: stopping"
    assert all(re.fullmatch(codes_alone, line) for line in before[:-1])
    assert (spec.type == "hnsw" and not before) or re.fullmatch(f"{codes_alone}|{gave_up}", before[-1])
    err = capfd.readouterr().err
    assert "exact search of 300 held-out queries: 2000/2000 100%" in err, err


def test_a_target_that_cannot_be_met_is_refused_in_one_line(capsys, tmp_path: Path):
    scattered = np.random.default_rng(5).standard_normal((2000, 32)).astype(np.float32)  # no clusters
    folder = fake_store(tmp_path / "emb", scattered).folder
    command = ["index", folder, "-o", tmp_path / "index", "--type", "ivfpq", "--pq-m", "1", "--pq-bits", "1"]
    # --quiet: without it each value tried is logged first (test_each_setting_tried_is_logged_...)
    code, err, _ = cli(capsys, "--quiet", *command, "--target-recall", "0.99", "--no-progress")
    assert code == 2 and err.count("\n") == 1, err
    assert re.fullmatch(
        r"error: --target-recall 0.99: the best recall@10 reached on 1000 held-out queries was 0\.\d{4} "
        r"\(--nprobe \d+ and re-ranking 64 x k candidates with the exact vectors\); choose a larger --pq-m, "
        r"a lower --target-recall, or --type flat\n",
        err,
    )
    assert not (tmp_path / "index").exists()
    store = fake_store(tmp_path / "emb2", scattered)
    spec = IndexSpec(type="hnsw", hnsw_m=2, ef_construction=1)
    with pytest.raises(TargetUnreachable, match=r"\(--ef-search \d+\); build with a larger --hnsw-m"):
        build_index(store, spec, tmp_path / "index", show_progress=False, recall=RecallSettings(target=1.0))


def test_index_prints_and_records_recall_and_a_target(clustered, capsys, tmp_path: Path):
    folder = fake_store(tmp_path / "emb", clustered).folder
    command = ["index", folder, "-o", tmp_path / "index", "--type", "hnsw", "--hnsw-m", "4", "--no-progress"]
    code, err, _ = cli(capsys, *command, "--target-recall", "0.9", "--recall-queries", "150")
    assert code == 0, err
    recorded = read_manifest(tmp_path / "index").about["recall"]  # type: ignore[union-attr]
    ef_search = SearchIndex.load(tmp_path / "index").spec.ef_search
    assert recorded["parameters"] == {"ef_search": ef_search} and recorded["queries"] == 150
    assert f"recall@10 {recorded['recall@10']:.4f}, recall@100 {recorded['recall@100']:.4f}" in err
    assert f"ef_search {ef_search}, meeting --target-recall 0.9" in err
    code, err, _ = cli(capsys, *command, "--target-recall", "0", "--overwrite")
    assert code == 2 and err == "error: --target-recall 0.0: give a recall above 0, at most 1\n"


def test_recall_options_on_an_exact_index_are_refused_in_one_line(capsys, tmp_path: Path):
    folder = fake_store(tmp_path / "emb", np.eye(8, dtype=np.float32)).folder
    command = ["index", folder, "-o", tmp_path / "index", "--no-progress", "--target-recall", "0.9"]
    code, err, _ = cli(capsys, *command)
    assert code == 2 and err == (
        "error: --target-recall: an index of --type flat searches exactly (recall 1); these options are for "
        "--type hnsw, ivfpq, binary or int8\n"
    )
    code, err, _ = cli(capsys, *command, "--backend", "milvus", "--uri", str(tmp_path / "m.db"))
    assert code == 2 and "an index of --backend milvus searches exactly" in err and err.count("\n") == 1
    assert not (tmp_path / "index").exists() and not (tmp_path / "m.db").exists()


def test_recall_on_real_queries_encoded_by_the_model_that_made_the_vectors(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path
):
    other = tiny_bert(tmp_path / "other", seed=1)  # other weights
    from densekit.data import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.models import DenseEncoder

    encode_corpus(
        DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), tmp_path / "emb", show_progress=False
    )
    queries = beir_dir / "queries.jsonl"
    command = ["index", tmp_path / "emb", "-o", tmp_path / "index", "--type", "hnsw", "--no-progress"]
    code, err, _ = cli(
        capsys, *command, "--queries", queries, "--model", tiny_st_model, "--target-recall", "0.5"
    )
    assert code == 0, err
    recorded = read_manifest(tmp_path / "index").about["recall"]  # type: ignore[union-attr]
    assert recorded["held_out"] == f"4 queries of {queries}, encoded by {tiny_st_model}"
    assert recorded["queries"] == 4 and "rows" not in recorded
    identity = read_manifest(tmp_path / "index").identity  # type: ignore[union-attr]
    assert identity["recall_target"] == {"target": 0.5, "queries": file_digest(queries)}
    code, err, _ = cli(capsys, *command, "--queries", queries, "--model", other, "--overwrite")
    assert code == 2 and err == (
        f"error: --model {other}: {tmp_path / 'emb'} was encoded by other model weights; give the model "
        "that encoded it\n"
    )
    code, err, _ = cli(capsys, *command, "--queries", queries, "--overwrite")
    assert code == 2 and err.startswith("error: --queries and --model go together")


def test_hnsw_returns_as_many_results_as_asked_whatever_its_ef_search(clustered, tmp_path: Path):
    store = fake_store(tmp_path / "emb", clustered)
    spec = IndexSpec(type="hnsw", hnsw_m=8, ef_search=16)  # as a low target can choose
    build_index(store, spec, tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    labels = index.search(clustered[:20], 300).labels
    assert (labels >= 0).all()  # faiss alone, with 16 candidates, returns fewer than 300
    assert recount(index, clustered[:20], clustered, 300) > 0.9
