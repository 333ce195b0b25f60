"""Collections stored gzip-compressed (`corpus.jsonl.gz`, `qrels/test.tsv.gz`...): read streaming as the
plain files are, with the same errors, known by their content, and refused in one line when broken."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from densekit.data import DataError, Dataset
from densekit.data.validate import validate_dataset

from .conftest import CORPUS, write_beir
from .hostile.commands import assert_refused, cli


def compress(path: Path) -> Path:
    """Replace `path` by `path.gz` of the same content."""
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    return packed


def packed_copy(plain: Path, target: Path) -> Path:
    """A copy of the collection `plain` with every file it reads gzip-compressed."""
    shutil.copytree(plain, target)
    for path in [target / "corpus.jsonl", target / "queries.jsonl", *(target / "qrels").glob("*.tsv")]:
        compress(path)
    return target


def tsv_collection(root: Path) -> Path:
    """An MS MARCO-style folder: collection.tsv, per-split queries and TREC qrels."""
    root.mkdir()
    (root / "collection.tsv").write_text("".join(f"{d['_id']}\t{d['title']}\t{d['text']}\n" for d in CORPUS))
    (root / "queries.test.tsv").write_text("q1\twhich mammals were domesticated\nq2\tprogramming language\n")
    (root / "qrels.test.tsv").write_text("q1 0 d1 1\nq1 0 d2 2\nq2 0 d4 1\n")
    return root


def read_everything(dataset: Dataset) -> tuple:
    splits = dataset.splits()
    return (
        dataset.layout,
        list(dataset.iter_corpus()),
        dataset.count_documents(),
        splits,
        [dataset.split_queries(split) for split in splits],
        dataset.corpus_digest(),
        dataset.fingerprint(),
    )


@pytest.mark.parametrize("layout", ["beir", "tsv"])
def test_a_compressed_collection_reads_and_digests_as_the_plain_one(tmp_path: Path, layout: str):
    plain = write_beir(tmp_path / "plain") if layout == "beir" else tsv_collection(tmp_path / "plain")
    packed = tmp_path / "packed"
    shutil.copytree(plain, packed)
    for path in [p for p in packed.rglob("*") if p.is_file()]:
        compress(path)
    dataset = Dataset.open(packed)
    assert dataset.corpus_path.name.endswith(".gz") and dataset.qrels_path("test").name.endswith(".tsv.gz")
    assert read_everything(dataset) == read_everything(Dataset.open(plain))
    assert read_everything(dataset)[2] == len(CORPUS)


def test_a_mixed_folder_reads_as_the_plain_one(tmp_path: Path):
    plain = write_beir(tmp_path / "plain")
    mixed = tmp_path / "mixed"
    shutil.copytree(plain, mixed)
    compress(mixed / "corpus.jsonl")  # as wiki1m: the corpus compressed, queries and qrels plain
    compress(mixed / "qrels" / "train.tsv")
    assert read_everything(Dataset.open(mixed)) == read_everything(Dataset.open(plain))


def test_errors_inside_a_compressed_file_name_it_and_the_line(tmp_path: Path):
    root = write_beir(tmp_path / "c")
    lines = [json.dumps(d) for d in CORPUS[:3]] + ['{"_id": "x", "text": oops}']
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    packed = compress(root / "corpus.jsonl")
    with pytest.raises(DataError) as err:
        list(Dataset.open(root).iter_corpus())
    assert str(err.value).startswith(f"{packed}:4: error: malformed JSON")

    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\tmaybe\n")
    qrels = compress(root / "qrels" / "test.tsv")
    with pytest.raises(DataError) as err:
        Dataset.open(root).qrels("test")
    assert str(err.value) == f"{qrels}:3: error: relevance 'maybe' is not an integer"

    (root / "queries.jsonl").write_bytes(b'{"_id": "q1", "text": "a"}\n{"_id": "q2", "text": "caf\xe9"}\n')
    queries = compress(root / "queries.jsonl")
    report = validate_dataset(root)
    assert [str(p) for p in report.problems if p.path == queries] == [
        f"{queries}:2: error: not valid UTF-8: byte 0xe9 at column 27"
    ]


def many_lines_corpus(root: Path, count: int = 3000) -> Path:
    """A BEIR folder whose corpus is gzip of `count` documents of varied text (so its compressed form
    is long enough to cut)."""
    docs = [{"_id": f"d{i}", "title": "", "text": f"passage {i} " + " ".join(str(i * j) for j in range(40))}
            for i in range(count)]  # fmt: skip
    write_beir(
        root, corpus=docs, queries=[{"_id": "q1", "text": "passage"}], qrels={"test": [("q1", "d1", 1)]}
    )
    return compress(root / "corpus.jsonl")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def bad_crc(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # the CRC-32 of the trailer
    path.write_bytes(bytes(data))


def flipped_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the compressed stream
    path.write_bytes(bytes(data))


def garbage(path: Path) -> None:
    path.write_bytes(b"this is not gzip at all\n" * 10)


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (truncate, "truncated gzip file: the data ends before its end-of-stream marker"),
        (bad_crc, "corrupt gzip file: CRC check failed"),
        (flipped_byte, "corrupt gzip file"),
        (garbage, "corrupt gzip file: Not a gzipped file"),
    ],
)
def test_a_broken_gzip_corpus_is_refused_in_one_line(capsys, tmp_path: Path, spoil, says: str):
    corpus = many_lines_corpus(tmp_path / "c")
    spoil(corpus)
    code, err, out = cli(capsys, "validate", tmp_path / "c")
    assert code == 1
    problems = [line for line in out.splitlines() if ": error: " in line]
    assert len(problems) == 1 and problems[0].startswith(f"{corpus}:") and says in problems[0], out
    if spoil is truncate:  # the line the reading reached is named
        line = int(problems[0][len(f"{corpus}:") :].split(":")[0])
        assert 1 < line < 3000

    code, err, _ = cli(capsys, "bm25", tmp_path / "c", "-o", tmp_path / "run.trec", "--no-progress")
    assert_refused(code, err, str(corpus), says)
    assert not (tmp_path / "run.trec").exists()


@pytest.mark.parametrize("name", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"])
def test_a_file_both_plain_and_compressed_is_refused_as_ambiguous(capsys, tmp_path: Path, name: str):
    root = write_beir(tmp_path / "c")
    plain = root / name
    plain.with_name(plain.name + ".gz").write_bytes(gzip.compress(plain.read_bytes()))
    code, err, _ = cli(capsys, "bm25", root, "-o", tmp_path / "run.trec", "--no-progress")
    assert_refused(code, err, f"{plain.parent}: error: holds both {plain.name} and {plain.name}.gz")
    code, _, out = cli(capsys, "validate", root)
    assert code == 1 and f"holds both {plain.name} and {plain.name}.gz" in out


def test_bm25_encode_and_search_on_a_compressed_collection(capsys, tiny_st_model: Path, tmp_path: Path):
    """The commands take the compressed folder and give what they give on the plain one; an embedding
    folder made from the plain corpus is the one of the compressed corpus (same content), so it is
    reused, and its index searches the compressed collection."""
    plain = write_beir(tmp_path / "plain")
    packed = packed_copy(plain, tmp_path / "packed")
    for data in (plain, packed):
        code, err, _ = cli(capsys, "bm25", data, "--split", "test", "-o", tmp_path / f"{data.name}.bm25",
                           "--no-progress")  # fmt: skip
        assert code == 0, err
    assert (tmp_path / "packed.bm25").read_text() == (tmp_path / "plain.bm25").read_text()

    emb, index = tmp_path / "emb", tmp_path / "index"
    assert cli(capsys, "encode", tiny_st_model, plain, "-o", emb, "--no-progress")[0] == 0
    made = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in emb.iterdir()}
    code, err, _ = cli(capsys, "encode", tiny_st_model, packed, "-o", emb, "--no-progress")
    assert code == 0, err
    assert "already complete" in err
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in emb.iterdir()} == made
    assert cli(capsys, "index", emb, "-o", index, "--no-progress")[0] == 0
    for data in (plain, packed):
        code, err, _ = cli(capsys, "search", tiny_st_model, index, data, "--split", "test",
                           "-o", tmp_path / f"{data.name}.dense", "--no-progress")  # fmt: skip
        assert code == 0, err
    assert (tmp_path / "packed.dense").read_text() == (tmp_path / "plain.dense").read_text()
    assert len((tmp_path / "packed.dense").read_text().splitlines()) == 4 * len(CORPUS) - 1  # q3 left out
