"""Slices of a collection that keep every judged document: nested, reproducible, recording their
source, refused in one line when they cannot keep the judgements."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from densekit.data import Dataset
from densekit.data.slices import KIND, SliceError, slice_collection
from densekit.io.artefact import read_manifest

from .conftest import write_beir
from .hostile.commands import assert_refused, cli

DOCUMENTS = 200


def collection(root: Path, compressed: bool = False) -> Path:
    """200 documents; split test judges 6 of them (one judged twice, one with relevance 0) for 3 queries,
    split train 4 others for 2 queries, and split dev 2 for a query of its own."""
    docs = [{"_id": f"doc{i}", "title": f"T{i}", "text": f"text of document {i}"} for i in range(DOCUMENTS)]
    queries = [{"_id": f"q{i}", "text": f"document {i}"} for i in range(7)]
    qrels = {
        "test": [("q0", "doc3", 1), ("q0", "doc77", 2), ("q1", "doc77", 1), ("q1", "doc150", 0),
                 ("q2", "doc199", 1), ("q2", "doc0", 1), ("q2", "doc42", 1)],
        "train": [("q3", "doc5", 1), ("q3", "doc6", 1), ("q4", "doc120", 1), ("q4", "doc121", 1)],
        "dev": [("q5", "doc9", 1), ("q5", "doc10", 1)],
    }  # fmt: skip
    write_beir(root, docs, queries, qrels)
    if compressed:
        corpus = root / "corpus.jsonl"
        (root / "corpus.jsonl.gz").write_bytes(gzip.compress(corpus.read_bytes()))
        corpus.unlink()
    return root


TEST_JUDGED = {"doc3", "doc77", "doc150", "doc199", "doc0", "doc42"}
TRAIN_JUDGED = {"doc5", "doc6", "doc120", "doc121"}


def ids(folder: Path) -> list[str]:
    return [doc.id for doc in Dataset.open(folder).iter_corpus()]


def test_a_slice_keeps_every_judged_document_and_its_queries(tmp_path: Path):
    source = collection(tmp_path / "source")
    made = slice_collection(source, 30, tmp_path / "slice", ["test", "train"], seed=3)
    kept = ids(tmp_path / "slice")
    assert len(kept) == 30 == made.documents and len(set(kept)) == 30
    assert set(kept) >= TEST_JUDGED | TRAIN_JUDGED
    assert made.judged == len(TEST_JUDGED | TRAIN_JUDGED)
    source_order = ids(source)
    assert kept == [d for d in source_order if d in set(kept)]  # in the source's order
    original, sliced = Dataset.open(source), Dataset.open(tmp_path / "slice")
    assert sliced.splits() == ["test", "train"]
    for split in ("test", "train"):
        assert sliced.split_queries(split) == original.split_queries(split)
    assert set(sliced.queries()) == {"q0", "q1", "q2", "q3", "q4"} and made.queries == 5
    documents = {d.id: d for d in original.iter_corpus()}
    assert all(documents[d.id] == d for d in sliced.iter_corpus())  # texts and titles as they were


def test_slices_are_nested_reproducible_and_drawn_by_the_seed(tmp_path: Path):
    source = collection(tmp_path / "source")
    sizes = [6, 20, 60, 150, DOCUMENTS]
    slices = [
        set(ids(slice_collection(source, n, tmp_path / f"s{n}", ["test"], seed=7).folder)) for n in sizes
    ]
    for smaller, larger in itertools.pairwise(slices):
        assert smaller < larger
    assert slices[0] == TEST_JUDGED and slices[-1] == set(ids(source))
    again = slice_collection(source, 60, tmp_path / "again", ["test"], seed=7).folder
    assert (again / "corpus.jsonl").read_bytes() == (tmp_path / "s60" / "corpus.jsonl").read_bytes()
    other = set(ids(slice_collection(source, 60, tmp_path / "other", ["test"], seed=8).folder))
    assert other != slices[2] and other >= TEST_JUDGED
    # the draw is of ids, not of places: a corpus in another order gives the same slice
    shuffled = tmp_path / "shuffled"
    write_beir(shuffled)
    lines = (source / "corpus.jsonl").read_text().splitlines()
    (shuffled / "corpus.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    for name in ("queries.jsonl", "qrels/test.tsv", "qrels/train.tsv"):
        (shuffled / name).write_bytes((source / name).read_bytes())
    (shuffled / "qrels" / "dev.tsv").write_bytes((source / "qrels" / "dev.tsv").read_bytes())
    assert (
        set(ids(slice_collection(shuffled, 60, tmp_path / "from-shuffled", ["test"], seed=7).folder))
        == slices[2]
    )


def test_the_manifest_records_the_source_and_a_slice_is_reused_or_refused(capsys, tmp_path: Path):
    source = collection(tmp_path / "source", compressed=True)
    out = tmp_path / "slice"
    code, err, printed = cli(
        capsys, "slice", source, "--size", "40", "--split", "test", "--seed", "2", "-o", out
    )
    assert code == 0, err
    assert printed.strip() == f"{out}: 40 documents (6 judged), 3 queries (written)"
    assert (out / "corpus.jsonl.gz").is_file() and not (
        out / "corpus.jsonl"
    ).exists()  # as the source stores it
    manifest = read_manifest(out)
    assert manifest is not None and manifest.kind == KIND
    assert manifest.identity["source"] == Dataset.open(source).fingerprint()
    assert (manifest.identity["size"], manifest.identity["seed"], manifest.identity["splits"]) == (
        40,
        2,
        ["test"],
    )
    assert (
        manifest.about["source_folder"] == str(source.resolve()) and manifest.about["source_documents"] == 200
    )
    written = (out / "corpus.jsonl.gz").read_bytes()

    code, _, printed = cli(
        capsys, "slice", source, "--size", "40", "--split", "test", "--seed", "2", "-o", out
    )
    assert code == 0 and "(already there, unchanged)" in printed
    code, err, _ = cli(capsys, "slice", source, "--size", "50", "--split", "test", "--seed", "2", "-o", out)
    assert_refused(code, err, "differs in: size", "--overwrite")
    assert (out / "corpus.jsonl.gz").read_bytes() == written
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\tdoc3\t1\n")  # damaged: cut again
    assert cli(capsys, "slice", source, "--size", "40", "--split", "test", "--seed", "2", "-o", out)[0] == 0
    assert Dataset.open(out).qrels("test") == Dataset.open(source).qrels("test")
    assert (out / "corpus.jsonl.gz").read_bytes() == written  # the same bytes: no time in the gzip header


@pytest.mark.parametrize(
    ("size", "splits", "says"),
    [
        (9, ["test", "train"], "--size 9: splits test, train of {source} judge 10 documents, all of which a "
                               "slice keeps; give a size of at least 10"),
        (5, ["test"], "--size 5: split test of {source} judges 6 documents"),
        (201, ["test"], "--size 201: {source}/corpus.jsonl holds only 200 documents"),
        (20, ["nope"], "split 'nope' not found; splits here: dev, test, train"),
    ],
)  # fmt: skip
def test_a_slice_that_cannot_be_cut_is_refused_in_one_line(capsys, tmp_path: Path, size, splits, says):
    source = collection(tmp_path / "source")
    options = [arg for split in splits for arg in ("--split", split)]
    code, err, _ = cli(capsys, "slice", source, "--size", size, *options, "-o", tmp_path / "slice")
    assert_refused(code, err, says.format(source=source))
    assert not (tmp_path / "slice").exists()


def test_seeds_out_of_range_are_refused(tmp_path: Path):
    source = collection(tmp_path / "source")
    with pytest.raises(SliceError, match="--seed -1"):
        slice_collection(source, 20, tmp_path / "slice", seed=-1)


def test_a_slice_of_every_split_by_default_is_a_collection_for_every_command(capsys, tmp_path: Path):
    source = collection(tmp_path / "source")
    made = slice_collection(source, 25, tmp_path / "slice")
    assert Dataset.open(made.folder).splits() == ["dev", "test", "train"]
    assert made.judged == 12 and made.queries == 6
    code, _, printed = cli(capsys, "validate", made.folder)
    assert code == 0 and "25 documents, 6 queries" in printed
    code, err, _ = cli(capsys, "bm25", made.folder, "--split", "dev", "-o", tmp_path / "run", "--no-progress")
    assert code == 0, err
    assert {line.split()[0] for line in (tmp_path / "run").read_text().splitlines()} == {"q5"}
    written = [json.loads(line) for line in (made.folder / "queries.jsonl").read_text().splitlines()]
    assert sorted(written, key=lambda q: q["_id"]) == [
        {"_id": f"q{i}", "text": f"document {i}"} for i in range(6)
    ]
