"""`split-queries`: a few-shot split of a collection's judged queries, as a collection of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from densekit.cli import app
from densekit.data import Dataset
from densekit.data.query_split import split_judged_queries
from densekit.io.outputs import OutputError


def test_the_two_splits_partition_the_judgements_by_query_and_the_view_reads_as_the_collection(
    beir_dir: Path, tmp_path: Path
):
    made = split_judged_queries(beir_dir, "test", 2, 0, tmp_path / "split")
    assert (made.fit, made.held_out, made.reused) == (2, 2, False)
    original, view = Dataset.open(beir_dir), Dataset.open(tmp_path / "split")
    fit_queries, fit = view.split_queries("fit")
    held_queries, held = view.split_queries("held-out")
    assert len(fit) == 2 and not set(fit) & set(held)
    assert {**fit, **held} == original.qrels("test")  # every judgement, each on its query's side
    assert {**fit_queries, **held_queries} == original.split_queries("test")[0]
    assert view.corpus_digest() == original.corpus_digest()  # an index of the original corpus serves it
    assert list(view.iter_corpus()) == list(original.iter_corpus())


def test_a_split_is_drawn_by_its_seed_reused_when_unchanged_and_replaced_only_with_overwrite(
    beir_dir: Path, tmp_path: Path
):
    def fit_of(seed: int, folder: str, overwrite: bool = False) -> set[str]:
        split_judged_queries(beir_dir, "test", 2, seed, tmp_path / folder, overwrite)
        return set(Dataset.open(tmp_path / folder).qrels("fit"))

    first = fit_of(0, "a")
    assert fit_of(0, "b") == first  # the same seed draws the same queries
    assert split_judged_queries(beir_dir, "test", 2, 0, tmp_path / "a").reused
    seeds = {frozenset(fit_of(seed, f"s{seed}")) for seed in range(1, 8)}
    assert len(seeds | {frozenset(first)}) > 1  # other seeds draw other queries
    with pytest.raises(OutputError, match=r"differs in: seed"):
        split_judged_queries(beir_dir, "test", 2, 5, tmp_path / "a")
    assert fit_of(5, "a", overwrite=True) == fit_of(5, "c")


def test_bad_splits_and_outputs_are_refused(beir_dir: Path, tmp_path: Path):
    refusal = r"--take 4: split 'test' .* has 4 judged queries; take between 1 and 3"
    with pytest.raises(ValueError, match=refusal):
        split_judged_queries(beir_dir, "test", 4, 0, tmp_path / "x")
    with pytest.raises(OutputError, match="is an input of this command"):
        split_judged_queries(beir_dir, "test", 1, 0, beir_dir)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="did not make"):
        split_judged_queries(beir_dir, "test", 1, 0, mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    tsv = tmp_path / "tsv"
    tsv.mkdir()
    (tsv / "collection.tsv").write_text("d1\tsome text\n")
    with pytest.raises(ValueError, match="needs a BEIR folder"):
        split_judged_queries(tsv, "test", 1, 0, tmp_path / "y")


def test_the_command_writes_the_split_and_says_so(beir_dir: Path, tmp_path: Path):
    command = ["split-queries", str(beir_dir), "--take", "1", "-o", str(tmp_path / "split")]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "fit 1 queries, held-out 3 (written)" in result.output
    again = CliRunner().invoke(app, command)
    assert "already there, unchanged" in again.output
