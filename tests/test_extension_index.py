"""docs/design.md's "How to add an index backend", done as it says: its example, written as one new file
on the backends package's path (in a folder of this test's: nothing in src/ is touched), is found by the
registry and runs through the shared index tests, `densekit index --backend`/`--type`, `densekit search`
and a recipe's index step, with no other file edited."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from densekit.data import Dataset, Diagnostics
from densekit.data.trec import read_run
from densekit.encoding.corpus import encode_corpus
from densekit.index import SearchIndex
from densekit.index.base import BACKENDS_PACKAGE, registered_backends
from densekit.models import DenseEncoder
from densekit.recipes.runner import run_recipe

from . import test_index_backends as shared
from .hostile.commands import cli
from .test_architecture import ROOT, design_example

EXAMPLE = "a new file src/densekit/index/backends/numpy_index.py"
CASE = ("numpy", "exhaustive")


@pytest.fixture
def numpy_backend(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> type[SearchIndex]:
    """The example's backend, registered for this test only: its file in a folder added to the backends
    package's path, as if it were in src/densekit/index/backends/."""
    folder = tmp_path_factory.mktemp("backends")
    (folder / "numpy_index.py").write_text(design_example(EXAMPLE), encoding="utf-8")
    monkeypatch.setattr(SearchIndex, "backends", dict(registered_backends()))
    package = importlib.import_module(BACKENDS_PACKAGE)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    yield registered_backends()["numpy"]
    sys.modules.pop(f"{BACKENDS_PACKAGE}.numpy_index", None)


def test_the_example_is_a_new_file_found_by_the_registry(numpy_backend):
    assert not (ROOT / "src/densekit/index/backends/numpy_index.py").exists()
    assert numpy_backend.__module__ == f"{BACKENDS_PACKAGE}.numpy_index"
    assert numpy_backend.types == ("exhaustive",) and numpy_backend.backend == "numpy"


def test_the_example_runs_through_the_shared_index_tests(numpy_backend, tmp_path: Path, capsys):
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((shared.ROWS, shared.DIMENSION)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for number, check in enumerate([
        shared.check_loads_and_ranks_as_exact_search,
        shared.check_another_index_is_replaced_only_with_overwrite,
        shared.check_files_and_ids_are_checked_on_load,
        shared.check_bad_queries_and_unused_parameters_are_refused,
    ]):  # fmt: skip
        check(CASE, vectors, tmp_path / str(number))
    shared.check_the_command_line_builds_what_python_builds(CASE, vectors, tmp_path / "cli", capsys)


def test_the_command_line_and_a_recipe_build_and_search_the_new_backends_index(
    numpy_backend, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, capsys
):
    encode_corpus(
        DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), tmp_path / "emb", show_progress=False
    )
    runs = {}
    for name, choice in (("flat", []), ("by-backend", ["--backend", "numpy"]),
                         ("by-type", ["--type", "exhaustive"])):  # fmt: skip
        code, err, _ = cli(capsys, "index", tmp_path / "emb", "-o", tmp_path / name, *choice, "--no-progress")
        assert code == 0, err
        code, err, _ = cli(capsys, "search", tiny_st_model, tmp_path / name, beir_dir, "-o",
                           tmp_path / f"{name}.trec", "--device", "cpu", "--no-progress")  # fmt: skip
        assert code == 0, err
        runs[name] = read_run(tmp_path / f"{name}.trec", Diagnostics())
    assert type(SearchIndex.load(tmp_path / "by-type")) is numpy_backend
    assert type(SearchIndex.load(tmp_path / "flat")).__name__ == "FaissIndex"
    assert runs["by-backend"] == runs["by-type"]
    assert [list(ranked) for ranked in runs["by-backend"].values()] == [
        list(ranked) for ranked in runs["flat"].values()
    ]  # exact search, as a flat faiss index searches
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"steps": {
        "index": {"type": "index", "embeddings": str(tmp_path / "emb"), "output": "{out}/index",
                  "backend": "numpy"},
        "search": {"type": "search", "model": str(tiny_st_model), "index": "{out}/index",
                   "data": str(beir_dir), "output": "{out}/test.trec"},
    }}))  # fmt: skip
    run_recipe(recipe, tmp_path / "out", device="cpu", show_progress=False)
    assert type(SearchIndex.load(tmp_path / "out" / "index")) is numpy_backend
    assert read_run(tmp_path / "out" / "test.trec", Diagnostics()) == runs["by-backend"]
