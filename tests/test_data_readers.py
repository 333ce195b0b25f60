"""Reading collections: each kind of bad input is an error naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densekit.data import DataError, Dataset, Diagnostics
from densekit.data.trec import read_qrels, read_run, write_run
from densekit.data.validate import validate_dataset

from .conftest import CORPUS, QUERIES, write_beir


def corpus_lines(lines: list[str], tmp_path: Path) -> Dataset:
    root = write_beir(tmp_path / "c")
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return Dataset.open(root)


def only_problem(err: pytest.ExceptionInfo[DataError]):
    assert len(err.value.problems) == 1
    return err.value.problems[0]


def test_reads_a_valid_collection(beir_dir: Path):
    dataset = Dataset.open(beir_dir)
    docs = list(dataset.iter_corpus())
    assert [d.id for d in docs] == [d["_id"] for d in CORPUS]
    assert docs[0].full_text == "Cats Cats are small domesticated carnivorous mammals."
    assert docs[2].full_text == CORPUS[2]["text"]  # no title, no leading space
    queries, qrels = dataset.split_queries("test")
    assert set(queries) == {"q1", "q2", "q3", "q4"}
    assert qrels["q1"] == {"d1": 1, "d2": 2}
    assert dataset.splits() == ["test", "train"]
    assert dataset.count_documents() == len(CORPUS)


def test_malformed_json_names_file_and_line(tmp_path: Path):
    dataset = corpus_lines([json.dumps(CORPUS[0]), '{"_id": "x", "text": oops}'], tmp_path)
    with pytest.raises(DataError) as err:
        list(dataset.iter_corpus())
    problem = only_problem(err)
    assert problem.path == dataset.corpus_path and problem.line == 2
    assert "malformed JSON" in problem.message
    assert f"{dataset.corpus_path}:2:" in str(err.value)


@pytest.mark.parametrize(
    ("record", "message"),
    [({"title": "t", "text": "x"}, 'missing "_id"'), ({"_id": "a", "title": "t"}, 'missing "text"')],
)
def test_missing_field_names_file_and_line(tmp_path: Path, record: dict, message: str):
    dataset = corpus_lines([json.dumps(CORPUS[0]), json.dumps(CORPUS[1]), json.dumps(record)], tmp_path)
    with pytest.raises(DataError) as err:
        list(dataset.iter_corpus())
    problem = only_problem(err)
    assert (problem.path, problem.line, problem.message) == (dataset.corpus_path, 3, message)


def test_missing_query_text(make_beir):
    root = make_beir(queries=[*QUERIES, {"_id": "q9"}])
    with pytest.raises(DataError) as err:
        Dataset.open(root).queries()
    problem = only_problem(err)
    assert (problem.path.name, problem.line, problem.message) == ("queries.jsonl", 5, 'missing "text"')


def test_duplicate_ids_name_both_lines(tmp_path: Path):
    dataset = corpus_lines([json.dumps(CORPUS[0]), json.dumps(CORPUS[1]), json.dumps(CORPUS[0])], tmp_path)
    with pytest.raises(DataError) as err:
        list(dataset.iter_corpus())
    problem = only_problem(err)
    assert problem.line == 3
    assert "duplicate id 'd1' (first on line 1)" in problem.message


def test_id_with_whitespace_is_rejected(tmp_path: Path):
    dataset = corpus_lines([json.dumps({"_id": "a b", "text": "x"})], tmp_path)
    with pytest.raises(DataError, match="contains whitespace") as err:
        list(dataset.iter_corpus())
    assert only_problem(err).line == 1


def test_qrels_wrong_column_count(make_beir):
    root = make_beir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\n")
    with pytest.raises(DataError) as err:
        Dataset.open(root).qrels("test")
    problem = only_problem(err)
    assert (problem.path.name, problem.line) == ("test.tsv", 3)
    assert "expected 3 columns" in problem.message and "found 2" in problem.message


def test_qrels_non_integer_score(make_beir):
    root = make_beir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0.5\n")
    with pytest.raises(DataError) as err:
        Dataset.open(root).qrels("test")
    problem = only_problem(err)
    assert (problem.line, problem.message) == (3, "relevance '0.5' is not an integer")


def test_qrels_unknown_queries_are_listed_with_lines(make_beir):
    root = make_beir(qrels={"test": [("q1", "d1", 1), ("q7", "d2", 1), ("q8", "d2", 1), ("q7", "d3", 1)]})
    with pytest.raises(DataError) as err:
        Dataset.open(root).split_queries("test")
    problem = only_problem(err)
    assert problem.path.name == "test.tsv" and problem.line == 3
    assert "2 unknown query ids" in problem.message
    assert "'q7' (line 3)" in problem.message and "'q8' (line 4)" in problem.message


def test_validate_reports_unknown_documents_with_lines(make_beir):
    root = make_beir(qrels={"test": [("q1", "d1", 1), ("q1", "nope", 1)]})
    report = validate_dataset(root)
    assert not report.ok
    [problem] = report.problems
    assert problem.path.name == "test.tsv" and problem.line == 3
    assert "1 unknown document ids, not in corpus.jsonl: 'nope' (line 3)" in problem.message


def test_non_utf8_bytes_name_the_line(tmp_path: Path):
    root = write_beir(tmp_path / "c")
    good = json.dumps(CORPUS[0]).encode()
    (root / "corpus.jsonl").write_bytes(good + b"\n" + b'{"_id": "x", "text": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        list(Dataset.open(root).iter_corpus())
    problem = only_problem(err)
    assert problem.line == 2 and "not valid UTF-8: byte 0xe9" in problem.message


def test_empty_file_is_an_error(make_beir):
    root = make_beir()
    (root / "queries.jsonl").write_text("")
    with pytest.raises(DataError) as err:
        Dataset.open(root).queries()
    problem = only_problem(err)
    assert problem.path == root / "queries.jsonl" and problem.message == "file is empty"


def test_missing_split_names_the_ones_there_are(beir_dir: Path):
    with pytest.raises(DataError) as err:
        Dataset.open(beir_dir).split_queries("dev")
    problem = only_problem(err)
    assert problem.path == beir_dir / "qrels" / "dev.tsv"
    assert "split 'dev' not found; splits here: test, train" in problem.message


def test_empty_texts_are_one_warning_with_their_count(make_beir, caplog):
    corpus = [*CORPUS, {"_id": "e1", "title": "", "text": ""}, {"_id": "e2", "text": "   "}]
    root = make_beir(corpus=corpus)
    with caplog.at_level("WARNING", logger="densekit"):
        docs = list(Dataset.open(root).iter_corpus())
    assert len(docs) == len(corpus)  # kept, not dropped
    [record] = caplog.records
    assert "2 documents with empty text (lines 9, 10)" in record.getMessage()
    report = validate_dataset(root)
    assert report.ok and [p.severity for p in report.problems] == ["warning"]


def test_crlf_and_bom_are_accepted(make_beir):
    root = make_beir()
    for path in [root / "corpus.jsonl", root / "queries.jsonl", root / "qrels" / "test.tsv"]:
        text = path.read_text()
        path.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    dataset = Dataset.open(root)
    assert next(d.id for d in dataset.iter_corpus()) == "d1"
    queries, qrels = dataset.split_queries("test")
    assert queries["q1"] == QUERIES[0]["text"]
    assert qrels["q4"] == {"d5": 1}
    assert validate_dataset(root).problems == []


def test_corpus_is_streamed(tmp_path: Path):
    """Documents come one at a time: the first is available before a bad last line is read."""
    dataset = corpus_lines([json.dumps(CORPUS[0]), "not json"], tmp_path)
    documents = dataset.iter_corpus()
    assert next(documents).id == "d1"
    with pytest.raises(DataError):
        next(documents)


def test_validate_collects_every_error(make_beir):
    root = make_beir()
    (root / "corpus.jsonl").write_text('{"_id": "a", "text": "x"}\nbad\n{"_id": "a", "text": "y"}\n')
    (root / "qrels" / "test.tsv").write_text("q1\td1\tx\n")
    report = validate_dataset(root)
    found = {(p.path.name, p.line) for p in report.problems if p.severity == "error"}
    assert {("corpus.jsonl", 2), ("corpus.jsonl", 3), ("test.tsv", 1)} <= found


def test_msmarco_tsv_layout(tmp_path: Path):
    root = tmp_path / "marco"
    root.mkdir()
    (root / "collection.tsv").write_text("0\tfirst passage\n1\tTitle\tsecond passage\n")
    (root / "queries.dev.tsv").write_text("100\twhat is first\n")
    (root / "qrels.dev.tsv").write_text("100 0 0 1\n100 0 1 0\n")
    dataset = Dataset.open(root)
    assert dataset.layout == "tsv" and dataset.splits() == ["dev"]
    assert [d.full_text for d in dataset.iter_corpus()] == ["first passage", "Title second passage"]
    queries, qrels = dataset.split_queries("dev")
    assert queries == {"100": "what is first"} and qrels == {"100": {"0": 1, "1": 0}}
    (root / "collection.tsv").write_text("0\tfine\n1\n")
    with pytest.raises(DataError) as err:
        list(dataset.iter_corpus())
    assert only_problem(err).line == 2


def test_trec_qrels_must_keep_one_layout(tmp_path: Path):
    path = tmp_path / "qrels.txt"
    path.write_text("q1 0 d1 1\nq1\td2\t1\n")
    with pytest.raises(DataError) as err:
        read_qrels(path, Diagnostics())
    assert only_problem(err).line == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("q1 Q0 d1 1 2.5", "expected 6 columns"),
        ("q1 Q0 d1 one 2.5 t", "rank 'one' is not an integer"),
        ("q1 Q0 d1 1 high t", "score 'high' is not a number"),
        ("q1 Q0 d1 1 nan t", "score 'nan' is not a finite number: it cannot be ranked"),
        ("q1 Q0 d1 1 -NaN t", "score '-NaN' is not a finite number"),
        ("q1 Q0 d1 1 inf t", "score 'inf' is not a finite number"),
        ("q1 Q0 d1 1 -Infinity t", "score '-Infinity' is not a finite number"),
        ("q1 Q0 d1 1 1e999 t", "score '1e999' is not a finite number"),
    ],
)
def test_run_errors_name_the_line(tmp_path: Path, line: str, message: str):
    path = tmp_path / "run.trec"
    path.write_text(f"q1 Q0 d0 1 3.0 t\n{line}\n")
    with pytest.raises(DataError) as err:
        read_run(path, Diagnostics())
    problem = only_problem(err)
    assert problem.line == 2 and message in problem.message


@pytest.mark.parametrize("score", [float("nan"), float("inf"), float("-inf")])
def test_a_run_with_a_score_that_cannot_be_ranked_is_not_written(tmp_path: Path, score: float):
    with pytest.raises(ValueError, match=r"query 'q1', document 'd2': score (nan|inf|-inf) is not finite"):
        write_run(tmp_path / "run.trec", {"q1": {"d1": 2.0, "d2": score}})
    assert not (tmp_path / "run.trec").exists()
