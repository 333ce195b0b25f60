"""Binary and int8 indexes with rescoring (`densekit.index.backends.quantized_index`): full rescoring is
exact search; the rescoring reads the copy on disk while memory holds the codes; a recall target
chooses the smallest rescoring depth; the manifest records the calibration and the memory a vector
takes; bad options are refused in one line; search and the recipes use them unchanged."""

from __future__ import annotations

import math
import re
from pathlib import Path

import faiss
import numpy as np
import pytest
import yaml

from densekit.data import Dataset, Diagnostics
from densekit.data.trec import read_run
from densekit.encoding.corpus import encode_corpus
from densekit.index import SearchIndex, build_index
from densekit.index.backends.quantized_index import (
    MAX_RESCORE,
    PROJECTION_FILE,
    QuantizedIndex,
    QuantizedSpec,
    binarize,
)
from densekit.index.recall import RecallSettings
from densekit.io.artefact import read_manifest
from densekit.models import DenseEncoder
from densekit.recipes.runner import run_recipe

from .hostile.commands import assert_refused, cli
from .test_index import fake_store, rewrite_checksum
from .test_index_recall import exact_rows, recount

ROWS, DIMENSION = 600, 36  # a dimension that is no multiple of 8: the codes are padded


@pytest.fixture(autouse=True)
def one_faiss_thread():
    """faiss on one thread: its threads spin waiting for each other on a busy two-core machine."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    """`ROWS` unit vectors around 30 centres, not centred on 0 (as a model's are not)."""
    rng = np.random.default_rng(12)
    centres = rng.standard_normal((30, DIMENSION)) + 0.3
    data = centres[rng.integers(0, 30, ROWS)] + 0.5 * rng.standard_normal((ROWS, DIMENSION))
    return (data / np.linalg.norm(data, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def queries(vectors: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(13)
    near = vectors[rng.integers(0, ROWS, 200)] + 0.3 * rng.standard_normal((200, DIMENSION))
    return (near / np.linalg.norm(near, axis=1, keepdims=True)).astype(np.float32)


def built(store, folder: Path, **spec) -> QuantizedIndex:
    build_index(store, QuantizedSpec(**spec), folder, show_progress=False)
    index = SearchIndex.load(folder)
    assert isinstance(index, QuantizedIndex)
    return index


FULL = {"rescore": MAX_RESCORE, "rescore_with": "float32"}  # 64 x 10 candidates of 600 rows: all of them


@pytest.mark.parametrize(
    "spec",
    [{"type": "binary", **FULL}, {"type": "binary", "binary_index": "hnsw", **FULL},
     {"type": "binary", "binary_index": "ivf", "nlist": 8, "nprobe": 8, **FULL}, {"type": "int8", **FULL},
     {"type": "binary", "code_bits": 16, **FULL},
     {"type": "binary", "binary_index": "ivf", "nlist": 8, "nprobe": 8, "code_bits": 24, **FULL},
     {"type": "binary", "binary_index": "ivf", "nlist": 8, "nprobe": 8, "ivf_centroids": "int8", **FULL}],
    ids=["binary", "binary-hnsw", "binary-ivf", "int8", "binary-16-bits", "binary-ivf-24-bits",
         "binary-ivf-int8-centroids"],
)  # fmt: skip
def test_full_rescoring_with_the_float32_copy_is_exact_search(vectors, queries, tmp_path: Path, spec):
    index = built(fake_store(tmp_path / "emb", vectors, parts=2), tmp_path / "index", **spec)
    hits = index.search(queries, 10)
    exact = queries @ vectors.T
    expected = np.argsort(-exact, axis=1, kind="stable")[:, :10]
    assert hits.labels.tolist() == expected.tolist()
    assert np.allclose(hits.scores, np.take_along_axis(exact, expected, axis=1), atol=1e-5)


def test_rescoring_with_the_int8_copy_scores_within_its_quantisation(vectors, queries, tmp_path: Path):
    index = built(
        fake_store(tmp_path / "emb", vectors), tmp_path / "index", type="binary", rescore=MAX_RESCORE
    )
    assert index.spec.rescore_with == "int8" and index.copy.dtype == np.uint8
    hits = index.search(queries, 10)
    step = (vectors.max(axis=0) - vectors.min(axis=0)) / 255  # a code's width in each dimension
    bound = np.abs(queries) @ step  # no decoded value lies further than one code's width away
    exact = np.take_along_axis(queries @ vectors.T, hits.labels, axis=1)
    assert (np.abs(hits.scores - exact) <= bound[:, None] + 1e-6).all()
    assert recount(index, queries, vectors, 10) >= 0.9  # every row rescored: ranked by its int8 copy


def test_int8_codes_alone_score_within_their_quantisation(vectors, queries, tmp_path: Path):
    index = built(fake_store(tmp_path / "emb", vectors), tmp_path / "index", type="int8")
    assert index.copy is None
    hits = index.search(queries, 10)
    step = (vectors.max(axis=0) - vectors.min(axis=0)) / 255  # a code's width in each dimension
    exact = np.take_along_axis(queries @ vectors.T, hits.labels, axis=1)
    assert (np.abs(hits.scores - exact) <= (np.abs(queries) @ step)[:, None] + 1e-6).all()
    assert recount(index, queries, vectors, 10) >= 0.9


def test_without_rescoring_binary_ranks_by_hamming_distance(vectors, queries, tmp_path: Path):
    index = built(fake_store(tmp_path / "emb", vectors), tmp_path / "index", type="binary")
    assert index.copy is None and not (tmp_path / "index" / "rescore.npy").exists()
    hits = index.search(queries[:20], 10)
    signs = lambda values: np.where(values > 0, 1, -1)  # noqa: E731
    agreement = signs(queries[:20]) @ signs(vectors).T  # dimension - 2 x Hamming distance
    assert np.array_equal(hits.scores, np.take_along_axis(agreement, hits.labels, axis=1).astype(np.float32))
    assert (np.diff(hits.scores, axis=1) <= 0).all()
    assert np.array_equal(np.sort(hits.scores, axis=1)[:, ::-1], -np.sort(-agreement, axis=1)[:, :10])


def score_of_row_0(index: QuantizedIndex, vectors: np.ndarray) -> float:
    """Row 0's score for its own vector as a query, every row a candidate and rescored."""
    hits = index.search(vectors[:1], ROWS)
    return float(hits.scores[0][hits.labels[0] == 0][0])


def test_the_codes_are_in_memory_and_the_rescoring_reads_the_copy_on_disk(vectors, tmp_path: Path):
    folder = tmp_path / "index"
    for kind, code_size in (("binary", math.ceil(DIMENSION / 8)), ("int8", DIMENSION)):
        index = built(fake_store(tmp_path / kind, vectors), folder / kind, type=kind, **FULL)
        assert index.index.code_size == code_size and index.index.ntotal == ROWS
        assert (
            isinstance(index.copy, np.memmap) and Path(index.copy.filename) == folder / kind / "rescore.npy"
        )
        held = {name: value for name, value in vars(index).items() if isinstance(value, np.ndarray)}
        in_memory = {name: value.shape for name, value in held.items() if not isinstance(value, np.memmap)}
        calibrated = {"ranges": (2, DIMENSION)} if kind == "int8" else {}  # binary's float32 copy needs none
        assert in_memory == {"ids": (ROWS,), **calibrated}  # no vectors: the codes are faiss's
        memory = read_manifest(folder / kind).about["memory"]  # type: ignore[union-attr]
        assert memory["ram_bytes_per_vector"] == code_size
        assert memory["disk_bytes_per_vector"] > code_size + 4 * DIMENSION
        assert index.mapped_file == folder / kind / "rescore.npy"
        # the copy changed on disk under the loaded index: the rescored score is the file's
        assert score_of_row_0(index, vectors) == pytest.approx(1.0, abs=1e-5)
        on_disk = np.load(folder / kind / "rescore.npy", mmap_mode="r+")
        on_disk[0] *= 0.5
        on_disk.flush()
        assert score_of_row_0(index, vectors) == pytest.approx(0.5, abs=1e-5)


@pytest.mark.parametrize(("spec", "target"), [({"type": "binary"}, 0.95), ({"type": "int8"}, 0.99)])
def test_a_target_recall_chooses_the_smallest_rescoring_depth_a_sweep_finds(
    vectors, queries, tmp_path: Path, spec, target: float
):
    store = fake_store(tmp_path / "emb", vectors)
    settings = RecallSettings(target=target, vectors=queries, source="test queries")
    build_index(store, QuantizedSpec(**spec), tmp_path / "index", show_progress=False, recall=settings)
    index = SearchIndex.load(tmp_path / "index")
    chosen = index.spec.rescore
    recorded = read_manifest(tmp_path / "index").about["recall"]  # type: ignore[union-attr]
    assert recorded["parameters"] == {"rescore": chosen} and recorded["target"] == target
    assert recorded["recall@10"] == pytest.approx(recount(index, queries, vectors, 10), abs=1e-9)
    assert recorded["recall@10"] >= target
    truth = exact_rows(queries, vectors, 10)
    sweep = {}
    for depth in range(0, chosen + 1):
        index.spec = index.spec.model_copy(update={"rescore": depth or None})
        sweep[depth] = recount(index, queries, vectors, 10, truth=truth)
    assert next(depth for depth, found in sweep.items() if found >= target) == chosen > 1
    assert {int(depth) for depth in recorded["tried"]["rescore"]} <= set(range(MAX_RESCORE + 1))


def test_a_target_recall_chooses_the_smallest_nprobe_of_int8_centroids_a_sweep_finds(
    vectors, queries, tmp_path: Path
):
    store = fake_store(tmp_path / "emb", vectors)
    settings = RecallSettings(target=0.9, vectors=queries, source="test queries")
    spec = QuantizedSpec(type="binary", binary_index="ivf", nlist=8, ivf_centroids="int8")
    build_index(store, spec, tmp_path / "index", show_progress=False, recall=settings)
    index = SearchIndex.load(tmp_path / "index")
    chosen = index.spec.nprobe
    recorded = read_manifest(tmp_path / "index").about["recall"]  # type: ignore[union-attr]
    assert recorded["parameters"] == {"rescore": index.spec.rescore, "nprobe": chosen}
    truth = exact_rows(queries, vectors, 10)
    sweep = {}
    for nprobe in range(1, 9):  # the lists probed, each with the deepest rescoring
        index.spec = index.spec.model_copy(update={"rescore": MAX_RESCORE})
        index.set_search_parameters(nprobe=nprobe)
        sweep[nprobe] = recount(index, queries, vectors, 10, truth=truth)
    assert next(nprobe for nprobe, found in sweep.items() if found >= 0.9) == chosen > 1


def test_the_manifest_records_the_calibration_and_the_memory_and_index_prints_them(
    vectors, capsys, tmp_path: Path
):
    store = fake_store(tmp_path / "emb", vectors, parts=3)
    code, err, _ = cli(capsys, "index", store.folder, "-o", tmp_path / "index", "--type", "binary",
                       "--rescore", "4", "--no-progress")  # fmt: skip
    assert code == 0, err
    about = read_manifest(tmp_path / "index").about  # type: ignore[union-attr]
    calibration = about["calibration"]
    assert np.array_equal(np.array(calibration["low"], np.float32), vectors.min(axis=0))
    assert np.array_equal(np.array(calibration["high"], np.float32), vectors.max(axis=0))
    memory = about["memory"]
    assert memory["ram_bytes_per_vector"] == 5 and memory["rescore_copy"] == "int8"  # 36 bits in 5 bytes
    files = sum((tmp_path / "index" / name).stat().st_size for name in ("codes.faiss", "rescore.npy"))
    assert memory["disk_bytes"] == files and memory["disk_bytes_per_vector"] == pytest.approx(files / ROWS)
    printed = " ".join(err.split())
    assert "5.0 bytes a vector in RAM" in printed and f"{files / ROWS:.1f} on disk" in printed
    assert "rescore 4; 5.0 bytes a vector in RAM" in printed and "recall@10" in printed
    assert about["recall"]["parameters"] == {"rescore": 4}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--rescore", "4"], "--rescore 4: not a setting of the faiss backend"),
        (
            ["--type", "int8", "--rescore", "4", "--rescore-with", "int8"],
            "--rescore-with int8: an int8 index",
        ),
        (["--type", "binary", "--rescore-with", "float32"], "--rescore-with float32: nothing is rescored"),
        (
            ["--type", "binary", "--rescore", "4", "--target-recall", "0.9"],
            "--rescore 4: --target-recall chooses",
        ),
        (["--type", "binary", "--rescore", "0"], "--rescore 0: Input should be greater than or equal to 1"),
        (
            ["--type", "binary", "--rescore", str(MAX_RESCORE + 1)],
            f"--rescore {MAX_RESCORE + 1}: Input should",
        ),
        (["--type", "int8", "--binary-index", "hnsw"], "--binary-index hnsw: an int8 index is a flat"),
        (["--type", "binary", "--binary-index", "lsh"], "--binary-index lsh: Input should be 'flat', 'hnsw'"),
        (["--type", "binary", "--pq-m", "4"], "--pq-m 4: not a setting of the quantized backend"),
        (["--type", "binary", "--code-bits", "20"], "--code-bits 20: codes are whole bytes"),
        (["--type", "binary", "--code-bits", "40"], "--code-bits 40: more bits than the vectors' 36"),
        (["--type", "int8", "--code-bits", "16"], "--code-bits 16: an int8 index holds one byte a dimension"),
        (["--type", "binary", "--ivf-centroids", "int8"], "--ivf-centroids int8: only a binary ivf index"),
        (
            ["--type", "binary", "--binary-index", "ivf", "--ivf-centroids", "float"],
            "--ivf-centroids float: Input should be 'binary' or 'int8'",
        ),
    ],
)
def test_bad_options_are_refused_in_one_line(vectors, capsys, tmp_path: Path, options, expected):
    store = fake_store(tmp_path / "emb", vectors[:100])
    code, err, _ = cli(capsys, "index", store.folder, "-o", tmp_path / "index", *options, "--no-progress")
    assert_refused(code, err, expected)
    assert not (tmp_path / "index").exists()


def test_codes_of_fewer_bits_are_the_signs_of_a_centred_orthonormal_projection(
    vectors, queries, tmp_path: Path
):
    bits = 24
    index = built(fake_store(tmp_path / "emb", vectors), tmp_path / "index", type="binary", code_bits=bits,
                  binary_index="ivf", nlist=8, nprobe=8)  # fmt: skip
    projection = np.load(tmp_path / "index" / PROJECTION_FILE)
    matrix, bias = projection[:, :-1], projection[:, -1]
    assert matrix.shape == (bits, DIMENSION) and index.index.code_size == bits // 8
    assert np.allclose(matrix @ matrix.T, np.eye(bits), atol=1e-5)  # PCA's axes, rotated: orthonormal
    projected = vectors @ matrix.T + bias  # every row sampled (fewer rows than the sample): centred
    assert np.allclose(projected.mean(axis=0), 0, atol=1e-5)
    hits = index.search(queries[:20], 10)
    signs = lambda values: np.where(values > 0, 1, -1)  # noqa: E731
    agreement = signs(queries[:20] @ matrix.T + bias) @ signs(projected).T  # bits - 2 x Hamming distance
    assert np.array_equal(hits.scores, np.take_along_axis(agreement, hits.labels, axis=1).astype(np.float32))
    assert np.array_equal(np.sort(hits.scores, axis=1)[:, ::-1], -np.sort(-agreement, axis=1)[:, :10])
    memory = read_manifest(tmp_path / "index").about["memory"]  # type: ignore[union-attr]
    # each code's 3 bytes and 8-byte id, the 8 centroids' codes, and the projection
    assert memory["ram_bytes"] == ROWS * (3 + 8) + 8 * 3 + projection.nbytes
    assert memory["disk_bytes"] == sum(
        (tmp_path / "index" / name).stat().st_size for name in ("codes.faiss", PROJECTION_FILE)
    )


@pytest.mark.parametrize(
    ("damage", "expected"),
    [(lambda p: p[:-1], "not the float32 (24, 37)"), (lambda p: p.astype(np.float64), "holds float64"),
     (lambda p: np.where(p > 0, np.nan, p).astype(np.float32), "NaN or an infinity")],
    ids=["shape", "dtype", "nan"],
)  # fmt: skip
def test_a_damaged_projection_is_refused_on_loading_naming_the_file(
    vectors, tmp_path: Path, damage, expected: str
):
    built(fake_store(tmp_path / "emb", vectors), tmp_path / "index", type="binary", code_bits=24)
    path = tmp_path / "index" / PROJECTION_FILE
    np.save(path, damage(np.load(path)))
    rewrite_checksum(tmp_path / "index", PROJECTION_FILE)  # a folder made so: its checksums agree
    with pytest.raises(ValueError, match=re.escape(expected)) as caught:
        SearchIndex.load(tmp_path / "index")
    assert str(path) in str(caught.value)


def test_int8_centroids_choose_each_vectors_list_and_the_lists_a_float_query_probes(
    vectors, queries, tmp_path: Path
):
    index = built(fake_store(tmp_path / "emb", vectors, parts=2), tmp_path / "index", type="binary",
                  binary_index="ivf", nlist=8, nprobe=1, ivf_centroids="int8")  # fmt: skip
    assert index.lists is not None and index.index.quantizer.ntotal == 0  # faiss's own centroids unused
    centroids = np.load(tmp_path / "index" / "centroids.npy")
    assert centroids.shape == (8, DIMENSION) and np.allclose(np.linalg.norm(centroids, axis=1), 1, atol=1e-5)
    held = index.lists.reconstruct_n(0, 8)  # the int8 codes decoded: within a step of their ranges
    steps = (centroids.max(axis=0) - centroids.min(axis=0)) / 255
    assert np.all(np.abs(held - centroids) <= steps + 1e-6)
    invlists = faiss.downcast_InvertedLists(index.index.invlists)
    member = np.full(ROWS, -1)
    for number in range(8):
        listed = faiss.rev_swig_ptr(invlists.get_ids(number), invlists.list_size(number))
        member[np.asarray(listed)] = number
    assert np.array_equal(member, np.argmax(vectors @ held.T, axis=1))  # each row in its nearest list, once
    assert len(set(member.tolist())) > 4  # the vectors' 30 groups spread over the lists
    hits = index.search(queries, 10)
    probed = np.argmax(queries @ held.T, axis=1)
    found = hits.labels >= 0
    assert np.all(member[hits.labels[found]] == np.repeat(probed, found.sum(axis=1)))
    sizes = np.bincount(member, minlength=8)
    assert np.array_equal(found.sum(axis=1), np.minimum(10, sizes[probed]))  # the probed list's best
    memory = read_manifest(tmp_path / "index").about["memory"]  # type: ignore[union-attr]
    # each code's 5 bytes and 8-byte id, the centroids' byte a dimension and their ranges
    assert memory["ram_bytes"] == ROWS * (5 + 8) + 8 * DIMENSION + 2 * DIMENSION * 4


def test_damaged_centroids_are_refused_on_loading_naming_the_file(vectors, tmp_path: Path):
    built(fake_store(tmp_path / "emb", vectors), tmp_path / "index", type="binary", binary_index="ivf",
          nlist=8, ivf_centroids="int8")  # fmt: skip
    path = tmp_path / "index" / "centroids.npy"
    np.save(path, np.load(path)[:-1])
    rewrite_checksum(tmp_path / "index", "centroids.npy")
    with pytest.raises(ValueError, match=re.escape(f"not the float32 (8, {DIMENSION})")) as caught:
        SearchIndex.load(tmp_path / "index")
    assert str(path) in str(caught.value)


def test_search_parameters_of_a_binary_hnsw_or_ivf_and_none_else(vectors, tmp_path: Path):
    store = fake_store(tmp_path / "emb", vectors)
    hnsw = built(store, tmp_path / "hnsw", type="binary", binary_index="hnsw", ef_search=16)
    hnsw.set_search_parameters(ef_search=40)
    assert hnsw.spec.ef_search == 40
    ivf = built(store, tmp_path / "ivf", type="binary", binary_index="ivf", nlist=8)
    ivf.set_search_parameters(nprobe=3)
    assert ivf.index.nprobe == 3
    flat = built(store, tmp_path / "int8", type="int8")
    for index, values in ((hnsw, {"nprobe": 4}), (ivf, {"ef_search": 4}), (flat, {"ef_search": 4})):
        with pytest.raises(ValueError, match="it has no"):
            index.set_search_parameters(**values)


def test_binarize_packs_the_signs_as_sentence_transformers_ubinary_does():
    values = np.array([[0.5, -1.0, 0.0, 2.0, -0.1, 0.3, 0.2, -3.0, 1.0]], dtype=np.float32)
    # 1 where above 0, first dimension in the highest bit, the ninth bit padded to a second byte
    assert binarize(values).tolist() == [[0b10010110, 0b10000000]]


def test_search_and_a_recipe_use_a_binary_index_unchanged(
    tiny_st_model: Path, beir_dir: Path, tmp_path: Path, capsys
):
    encode_corpus(
        DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), tmp_path / "emb", show_progress=False
    )
    runs = {}
    for name, options in (("flat", []), ("binary", ["--type", "binary", "--rescore", "64", "--rescore-with",
                                                     "float32"])):  # fmt: skip
        code, err, _ = cli(
            capsys, "index", tmp_path / "emb", "-o", tmp_path / name, *options, "--no-progress"
        )
        assert code == 0, err
        code, err, _ = cli(capsys, "search", tiny_st_model, tmp_path / name, beir_dir, "-o",
                           tmp_path / f"{name}.trec", "--device", "cpu", "--no-progress")  # fmt: skip
        assert code == 0, err
        runs[name] = read_run(tmp_path / f"{name}.trec", Diagnostics())
    assert [list(ranked) for ranked in runs["binary"].values()] == [list(r) for r in runs["flat"].values()]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"steps": {
        "index": {"type": "index", "embeddings": str(tmp_path / "emb"), "output": "{out}/index",
                  "spec": {"type": "binary", "rescore": 64, "rescore_with": "float32"}},
        "search": {"type": "search", "model": str(tiny_st_model), "index": "{out}/index",
                   "data": str(beir_dir), "output": "{out}/test.trec"},
    }}))  # fmt: skip
    run_recipe(recipe, tmp_path / "out", device="cpu", show_progress=False)
    assert isinstance(SearchIndex.load(tmp_path / "out" / "index"), QuantizedIndex)
    assert read_run(tmp_path / "out" / "test.trec", Diagnostics()) == runs["binary"]
