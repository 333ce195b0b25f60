"""wiki_quality on a small stand-in for wiki1m: a slice's vectors are the whole corpus's rows of its ids
(what encoding the slice gives), the rows and paired tests are of the runs it wrote, and a second run
keeps every stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks.tests.wiki_fixtures import SLICE, one_thread, wiki_like  # noqa: F401 (fixture)
from benchmarks.wiki_quality import BM25, FINE_TUNED, FUSED, ZERO_SHOT, main
from densekit.data import Dataset
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation.fusion import reciprocal_rank_fusion
from densekit.models import DenseEncoder


def test_quality_rows_at_two_sizes_from_one_encoding_resumed_without_measuring_again(
    tmp_path: Path, tiny_st_model: Path
):
    full, part, embeddings = wiki_like(tmp_path, tiny_st_model)
    work, output = tmp_path / "work", tmp_path / "results" / "quality.json"
    tuned = tmp_path / "tuned.trec"
    argv = ["--sizes", f"small={part}", f"full={full}", "--embeddings", str(embeddings), "--model",
            str(tiny_st_model), "--work", str(work), "--output", str(output), "--trials", "1000"]  # fmt: skip
    main(argv)

    # the slice's vectors, taken by id from the whole corpus's, are those encoding the slice gives
    encode_corpus(
        DenseEncoder.load(tiny_st_model).eval(), Dataset.open(part), tmp_path / "own", show_progress=False
    )
    own, taken = EmbeddingStore.open(tmp_path / "own"), EmbeddingStore.open(work / "small" / "embeddings")
    assert taken.ids() == own.ids() and len(taken) == SLICE
    assert np.allclose(taken.vectors(), own.vectors(), atol=1e-5)
    assert not (work / "full" / "embeddings").exists()  # the whole corpus's own embeddings are used as given

    results = json.loads(output.read_text())
    labels = (BM25, ZERO_SHOT, FUSED)
    runs = {name: {label: read_run(Path(size[label]["run"]), Diagnostics()) for label in labels}
            for name, size in results["sizes"].items()}  # fmt: skip
    for name, size in results["sizes"].items():
        assert (
            size["collection"]["queries"] == 40
            and size[ZERO_SHOT]["passages"] == size["collection"]["documents"]
        )
        fused = reciprocal_rank_fusion([runs[name][BM25], runs[name][ZERO_SHOT]], k=60)
        assert runs[name][FUSED].keys() == fused.keys()
        assert all(list(runs[name][FUSED][q]) == list(fused[q]) for q in fused)
        tested = {run["name"] for m in size["paired tests"]["measures"] for run in m["runs"]}
        assert tested == {BM25, FUSED} and size["paired tests"]["against"] == ZERO_SHOT
    small = {doc for ranked in runs["small"][ZERO_SHOT].values() for doc in ranked}
    assert small <= set(taken.ids())  # searched over the slice's passages alone
    table = output.with_suffix(".md").read_text()
    assert table.count(f"| {ZERO_SHOT} (torch float32) |") == 2  # the vectors' path, recorded
    assert "python -m benchmarks.wiki_quality --sizes" in table
    assert output.with_suffix(".png").stat().st_size > 0

    # a fine-tuned run of the slice's test queries is a fourth row, tested against zero-shot
    shutil.copy(results["sizes"]["small"][BM25]["run"], tuned)
    main([*argv, "--fine-tuned", f"small={tuned}"])
    again = json.loads(output.read_text())
    small_size = again["sizes"]["small"]
    assert small_size[FINE_TUNED]["metrics"] == small_size[BM25]["metrics"]
    # tested on its own against zero-shot: BM25's test before Holm's correction over BM25 and RRF
    (bm25,) = [run for run in small_size["paired tests"]["measures"][0]["runs"] if run["name"] == BM25]
    (own,) = small_size["paired tests"]["fine-tuned"][0]["runs"]
    assert own["mean_difference"] == bm25["mean_difference"] and own["better"] == bm25["better"]
    assert own["p_randomisation_holm"] == bm25["p_randomisation"] and own["p_t_test_holm"] == bm25["p_t_test"]
    assert f"| {FINE_TUNED} |" in output.with_suffix(".md").read_text()
    kept = [
        again["sizes"][n][label]["measured_in"]
        for n in ("small", "full")
        for label in (BM25, ZERO_SHOT, FUSED)
    ]
    assert kept == [0] * 6 and small_size[FINE_TUNED]["measured_in"] == 1 and len(again["runs"]) == 2

    # a run of other queries is refused, naming the file
    train = tmp_path / "train.trec"
    train.write_text("train-0 Q0 0-1 1 1.0 x\n")
    with pytest.raises(SystemExit, match=r"train\.trec: queries train-0 are not .*test queries"):
        main([*argv, "--fine-tuned", f"small={train}"])
