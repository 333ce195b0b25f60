"""`densekit import-embeddings`: vectors encoded elsewhere become an embedding folder that `index` and
`search` take as one `encode` made; bad input is refused in one line naming the file before the vectors
are read; the folder appears whole or not at all, and replaces only densekit's embeddings."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from densekit.data import Dataset
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.encoding import imported as imported_module
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.imported import import_embeddings
from densekit.encoding.store import EmbeddingStore
from densekit.io.artefact import differences
from densekit.io.fingerprint import file_digest
from densekit.models import DenseEncoder

from .conftest import CORPUS
from .test_outputs import cli


@pytest.fixture(scope="module")
def encoder(tiny_st_model: Path) -> DenseEncoder:
    return DenseEncoder.load(tiny_st_model)


@pytest.fixture
def encoded(encoder, beir_dir: Path, tmp_path: Path) -> tuple[EmbeddingStore, Path]:
    """The collection encoded by densekit, and its vectors saved alone as one `.npy` elsewhere."""
    encode_corpus(encoder, Dataset.open(beir_dir), tmp_path / "encoded", show_progress=False)
    store = EmbeddingStore.open(tmp_path / "encoded")
    (tmp_path / "elsewhere").mkdir()
    np.save(tmp_path / "elsewhere" / "vectors.npy", np.asarray(store.vectors()))
    return store, tmp_path / "elsewhere" / "vectors.npy"


def _import(capsys, model: Path, data: Path, vectors: Path, output: Path) -> int:
    return cli(capsys, "import-embeddings", model, data, vectors, "-o", output, "--no-progress")[0]


def _ids_file(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(f"{doc_id}\n" for doc_id in ids))
    return path


@pytest.mark.parametrize("with_ids", [False, True])
def test_an_imported_folder_is_indexed_and_searched_as_an_encoded_one(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, encoded, with_ids: bool
):
    store, vectors = encoded
    ids = ["--ids", _ids_file(tmp_path / "ids.txt", store.ids())] if with_ids else []
    code, err, _ = cli(capsys, "import-embeddings", tiny_st_model, beir_dir, vectors, "-o", tmp_path / "imp",
                       *ids, "--no-progress")  # fmt: skip
    assert code == 0, err
    imported = EmbeddingStore.open(tmp_path / "imp")  # checks every header and checksum
    assert imported.ids() == store.ids() == [d["_id"] for d in CORPUS]
    assert np.array_equal(imported.vectors(), store.vectors())
    assert differences(store.identity, imported.identity) == ["imported"]
    assert imported.identity["imported"] == {"vectors": file_digest(vectors)}
    runs = []
    for name, folder in (("encoded", store.folder), ("imported", tmp_path / "imp")):
        assert cli(capsys, "index", folder, "-o", tmp_path / f"{name}-index", "--no-progress")[0] == 0
        code, err, _ = cli(capsys, "search", tiny_st_model, tmp_path / f"{name}-index", beir_dir,
                           "-o", tmp_path / f"{name}.trec", "--no-progress")  # fmt: skip
        assert code == 0, err
        runs.append(read_run(tmp_path / f"{name}.trec", Diagnostics()))
    assert runs[0] == runs[1] and runs[0]


def test_big_endian_and_fortran_order_input_is_copied_in_chunks_to_the_same_vectors(
    encoder, beir_dir: Path, tmp_path: Path, encoded, monkeypatch
):
    store, _ = encoded
    expected = np.asarray(store.vectors())
    real_memmap = np.memmap
    mapped_whole = {"big": [], "fortran": [(8, 32)]}  # rows spread over the whole file: mapped whole
    for name, array in (("big", expected.astype(">f4")), ("fortran", np.asfortranarray(expected))):
        source = tmp_path / f"{name}.npy"
        np.save(source, array)
        before = source.read_bytes()
        shapes: list[tuple] = []
        record = lambda *a, shapes=shapes, **k: shapes.append(a[4]) or real_memmap(*a, **k)  # noqa: E731
        with monkeypatch.context() as patch:  # numpy's own memmap, seen only while importing
            patch.setattr(np, "memmap", record)
            patch.setattr(np, "load", lambda *a, **k: pytest.fail("the whole file was loaded"))
            import_embeddings(encoder, Dataset.open(beir_dir), source, tmp_path / name, chunk_rows=3,
                              show_progress=False)  # fmt: skip
        assert shapes == mapped_whole[name] or shapes == [(3, 32), (3, 32), (2, 32)]  # a map per chunk
        assert np.array_equal(EmbeddingStore.open(tmp_path / name).vectors(), expected)
        assert source.read_bytes() == before


def _rows_short(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors[:7])
    message = "7 rows, but {corpus} holds 8 documents: one row a document"
    return [tmp / "v.npy"], f"{tmp / 'v.npy'}: error: {message}"


def _ids_short(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors)
    ids = _ids_file(tmp / "ids.txt", [d["_id"] for d in CORPUS][:7])
    return [tmp / "v.npy", "--ids", ids], f"{ids}: error: 7 ids for the 8 rows of {tmp / 'v.npy'}"


def _ids_swapped(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors)
    order = [d["_id"] for d in CORPUS]
    order[1], order[2] = order[2], order[1]
    ids = _ids_file(tmp / "ids.txt", order)
    message = "id 'd3', but document 2 of {corpus} is 'd2': the rows must be in corpus order"
    return [tmp / "v.npy", "--ids", ids], f"{ids}:2: error: {message}"


def _id_unknown(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors)
    ids = _ids_file(tmp / "ids.txt", [*(d["_id"] for d in CORPUS[:7]), "nowhere"])
    message = "id 'nowhere', but document 8 of {corpus} is 'd8': the rows must be in corpus order"
    return [tmp / "v.npy", "--ids", ids], f"{ids}:8: error: {message}"


def _float64(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors.astype(np.float64))
    message = "holds float64 values, not float32; convert it (numpy: array.astype('float32'))"
    return [tmp / "v.npy"], f"{tmp / 'v.npy'}: error: {message}"


def _three_d(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors.reshape(8, 4, 8))
    message = "holds a 8 x 4 x 8 float32 array; expected 2-D: (rows, dimension)"
    return [tmp / "v.npy"], f"{tmp / 'v.npy'}: error: {message}"


def _narrow(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors[:, :16].copy())
    return [tmp / "v.npy"], f"{tmp / 'v.npy'}: error: 16-dimensional vectors, but {{model}} makes 32"


def _not_npy(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    (tmp / "v.npy").write_text("0.1 0.2 0.3\n")
    return [tmp / "v.npy"], f"{tmp / 'v.npy'}: error: not a readable .npy file: "


def _truncated(tmp: Path, vectors: np.ndarray) -> tuple[list, str]:
    np.save(tmp / "v.npy", vectors)
    (tmp / "v.npy").write_bytes((tmp / "v.npy").read_bytes()[:-4])
    message = "not a readable .npy file: truncated: 1148 bytes, fewer than the 1152 of the 8 x 32 float32"
    return [tmp / "v.npy"], f"{tmp / 'v.npy'}: error: {message}"


REFUSED: dict[str, Callable[[Path, np.ndarray], tuple[list, str]]] = {
    "rows other than documents": _rows_short,
    "ids other than rows": _ids_short,
    "ids out of corpus order": _ids_swapped,
    "an id not of the corpus": _id_unknown,
    "float64": _float64,
    "3-D": _three_d,
    "another width": _narrow,
    "not a .npy file": _not_npy,
    "truncated": _truncated,
}


@pytest.mark.parametrize("make", REFUSED.values(), ids=REFUSED.keys())
def test_bad_input_is_refused_in_one_line_before_the_vectors_are_read(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, monkeypatch, make
):
    good = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    (tmp_path / "in").mkdir()
    arguments, expected = make(tmp_path / "in", good)
    copies = []
    monkeypatch.setattr(imported_module, "_copy_vectors", lambda *a: copies.append(a))
    command = ["import-embeddings", tiny_st_model, beir_dir, *arguments, "-o", tmp_path / "imp"]
    code, err, _ = cli(capsys, *command)
    expected = expected.format(corpus=beir_dir / "corpus.jsonl", model=tiny_st_model)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().startswith(expected), err
    assert copies == [] and not (tmp_path / "imp").exists()


def test_a_nan_row_stops_the_copy_and_leaves_no_folder_and_no_temporary(
    encoder, beir_dir: Path, tmp_path: Path, encoded
):
    store, _ = encoded
    vectors = np.array(store.vectors())
    vectors[6, 3] = np.nan
    np.save(tmp_path / "nan.npy", vectors)
    with pytest.raises(ValueError, match=r"nan\.npy: error: row 6 holds NaN$"):
        import_embeddings(encoder, Dataset.open(beir_dir), tmp_path / "nan.npy", tmp_path / "imp",
                          chunk_rows=2, show_progress=False)  # fmt: skip
    assert not (tmp_path / "imp").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".imp")]


def test_only_densekit_embeddings_are_replaced_and_only_with_overwrite(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, encoded
):
    store, vectors = encoded
    command = ["import-embeddings", tiny_st_model, beir_dir, vectors, "--no-progress", "-o"]
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    code, err, _ = cli(capsys, *command, tmp_path / "theirs", "--overwrite")
    assert code == 2 and "densekit did not make as embeddings" in err
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "mine"
    before = {p.name: p.read_bytes() for p in store.folder.iterdir()}
    code, err, _ = cli(capsys, *command, store.folder)
    assert code == 2 and err.strip() == (
        f"error: {store.folder} holds embeddings already; pass --overwrite to replace them"
    )
    assert {p.name: p.read_bytes() for p in store.folder.iterdir()} == before
    (store.folder / "notes.txt").write_text("mine")
    code, err, _ = cli(capsys, *command, store.folder, "--overwrite")
    assert code == 2 and "also holds notes.txt, which densekit did not make" in err
    (store.folder / "notes.txt").unlink()
    assert cli(capsys, *command, store.folder, "--overwrite")[0] == 0
    assert "imported" in EmbeddingStore.open(store.folder).identity
    code, err, _ = cli(capsys, *command, vectors.parent)
    assert code == 2 and "an input of this command" in err
    assert vectors.is_file()


def test_encode_refuses_an_imported_folder_as_another_encoding(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, encoded
):
    _, vectors = encoded
    imp = tmp_path / "imp"
    assert _import(capsys, tiny_st_model, beir_dir, vectors, imp) == 0
    code, err, _ = cli(capsys, "encode", tiny_st_model, beir_dir, "-o", imp, "--no-progress")
    assert code == 2 and "differs in: imported" in err, err
    meta = json.loads((imp / "part-00000-of-00001.json").read_text())
    assert meta["identity"]["imported"]["vectors"] == file_digest(vectors)


def test_an_index_of_imported_vectors_refuses_another_model_and_corpus(
    capsys, tiny_st_model: Path, tiny_model: Path, beir_dir: Path, make_beir, tmp_path: Path, encoded
):
    _, vectors = encoded
    imp, index = tmp_path / "imp", tmp_path / "index"
    assert _import(capsys, tiny_st_model, beir_dir, vectors, imp) == 0
    assert cli(capsys, "index", imp, "-o", index, "--no-progress")[0] == 0
    other_corpus = make_beir(corpus=[{**d, "text": d["text"] + " More."} for d in CORPUS])
    for model, data, message in (
        (tiny_model, beir_dir, "passages encoded with other settings"),
        (tiny_st_model, other_corpus, "from another corpus than"),
    ):
        code, err, _ = cli(capsys, "search", model, index, data, "-o", tmp_path / "run.trec", "--no-progress")
        assert code == 2 and message in err, err
