"""Index folders as outputs and inputs (issue 63): another index is never replaced without --overwrite,
not even by a build that started before it was made; an index whose identity cannot vouch for its ids
is refused; a recall target that is no number is refused as such."""

from __future__ import annotations

import numpy as np
import pytest

from densekit.diagnostics import DataError
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.index.backends import faiss_index
from densekit.io.artefact import MANIFEST, read_manifest
from densekit.io.outputs import OutputError

from ..test_index import fake_store
from .commands import assert_refused, cli
from .test_model_folders import resign


@pytest.fixture
def stores(tmp_path):
    """Two embedding folders of other vectors (one of 8 rows, one of 120) of 16 dimensions."""
    rng = np.random.default_rng(3)
    small, large = rng.standard_normal((8, 16)), rng.standard_normal((120, 16))
    return (fake_store(tmp_path / "emb_tiny", small.astype(np.float32), corpus="tiny"),
            fake_store(tmp_path / "emb", large.astype(np.float32), corpus="large"))  # fmt: skip


def folder_bytes(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# --- 7: an index of other embeddings or settings is replaced only with --overwrite --------------------


@pytest.mark.parametrize(
    ("second", "differs"),
    [
        (["emb"], "differs in: embeddings.corpus, ids"),
        (["emb_tiny", "--type", "hnsw"], "differs in: spec.type)"),
    ],
    ids=["other-embeddings", "other-settings"],
)
def test_7_index_refuses_to_replace_another_index_without_overwrite(
    capsys, stores, tmp_path, second, differs
):
    index = tmp_path / "ix"
    code, err, _ = cli(capsys, "index", tmp_path / "emb_tiny", "-o", index, "--no-progress")
    assert code == 0, err
    before = folder_bytes(index)
    code, err, _ = cli(capsys, "index", tmp_path / second[0], "-o", index, *second[1:], "--no-progress")
    assert_refused(code, err, f"error: {index} holds an index made from other inputs or settings", differs,
                   "pass --overwrite to replace it")  # fmt: skip
    assert folder_bytes(index) == before
    code, err, _ = cli(capsys, "index", tmp_path / second[0], "-o", index, *second[1:], "--no-progress",
                       "--overwrite")  # fmt: skip
    assert code == 0, err
    assert folder_bytes(index) != before


def test_7_the_same_index_built_again_needs_no_overwrite(capsys, stores, tmp_path):
    for _ in range(2):
        code, err, _ = cli(capsys, "index", tmp_path / "emb", "-o", tmp_path / "ix", "--type", "hnsw",
                           "--no-progress")  # fmt: skip
        assert code == 0, err


def test_7_a_build_that_finishes_second_refuses_instead_of_replacing(stores, tmp_path, monkeypatch):
    """Two builds of one folder without --overwrite: the one that finishes second finds the other's index
    at its final rename and refuses, leaving it whole (made here by building the other one while the
    first writes its files, after its check before the work)."""
    tiny, other = stores
    output = tmp_path / "ix"
    write_ids, started = faiss_index.write_ids, []

    def another_build_finishes_meanwhile(store, path):
        if not started:
            started.append(True)
            build_index(other, IndexSpec(type="hnsw"), output, show_progress=False)
        write_ids(store, path)

    monkeypatch.setattr(faiss_index, "write_ids", another_build_finishes_meanwhile)
    with pytest.raises(OutputError) as err:
        build_index(tiny, IndexSpec(type="flat"), output, show_progress=False)
    assert str(err.value).startswith(f"{output} holds an index made from other inputs or settings")
    assert "\n" not in str(err.value)
    survivor = SearchIndex.load(output)
    assert survivor.spec.type == "hnsw" and survivor.rows == 120
    assert [
        path.name for path in tmp_path.iterdir() if path.name.startswith(".ix")
    ] == []  # no temporary left


def test_7_overwrite_replaces_an_index_of_other_embeddings(stores, tmp_path):
    tiny, other = stores
    build_index(tiny, IndexSpec(), tmp_path / "ix", show_progress=False)
    build_index(other, IndexSpec(), tmp_path / "ix", show_progress=False, overwrite=True)
    assert SearchIndex.load(tmp_path / "ix").rows == 120


# --- 19: an index whose identity holds no digest of its ids -------------------------------------------


def test_19_an_index_whose_identity_lacks_the_ids_digest_is_refused_even_resigned(stores, tmp_path):
    tiny, _ = stores
    build_index(tiny, IndexSpec(), tmp_path / "ix", show_progress=False)
    folder = tmp_path / "ix"
    manifest = read_manifest(folder)
    manifest.identity.pop("ids")  # type: ignore[union-attr]
    (folder / MANIFEST).write_text(manifest.to_json())  # type: ignore[union-attr]
    lines = (folder / "ids.txt").read_text().splitlines()
    (folder / "ids.txt").write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    resign(folder)
    with pytest.raises(DataError) as err:
        SearchIndex.load(folder)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{folder / MANIFEST}: error: ")
    assert "digest of its ids" in message and "build the index again" in message


# --- 27: --target-recall that is no number -------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_27_a_target_recall_that_is_no_finite_number_is_refused_as_such(capsys, stores, tmp_path, value):
    code, err, _ = cli(capsys, "index", tmp_path / "emb", "-o", tmp_path / "ix", "--type", "hnsw",
                       "--target-recall", value, "--no-progress")  # fmt: skip
    assert_refused(
        code, err, f"--target-recall {value}: not a finite number; give a recall above 0, at most 1"
    )
    assert not (tmp_path / "ix").exists()
