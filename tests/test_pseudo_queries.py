"""Pseudo-queries from a corpus alone, their mined negatives, and modules and routes trained on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from densekit.cli import app
from densekit.data.dataset import Dataset
from densekit.data.examples import read_examples
from densekit.data.pseudo_queries import (
    PseudoQueryReport,
    PseudoQuerySettings,
    WordStatistics,
    pseudo_queries,
    write_pseudo_queries,
)
from densekit.data.records import Document
from densekit.mining.filters import MiningSettings
from densekit.mining.mine import mine

from .conftest import write_beir

runner = CliRunner()

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


def corpus_rows() -> list[dict]:
    """Documents of varied lengths; d3 and d4 share their text (a near-duplicate pair), d5 is too short
    for a span and has no title, d6's text is a single sentence."""
    rows = []
    for i in range(3):
        words = [WORDS[(i * 5 + j) % len(WORDS)] for j in range(30)]
        rows.append(
            {"_id": f"d{i}", "title": f"title {i} {WORDS[i]}", "text": "First one. " + " ".join(words)}
        )
    shared = " ".join(WORDS) + ". And a second sentence here."
    rows.append({"_id": "d3", "title": "twin", "text": shared})
    rows.append({"_id": "d4", "title": "twin", "text": shared})
    rows.append({"_id": "d5", "title": "", "text": "too short"})
    rows.append({"_id": "d6", "title": "single", "text": "a single sentence with no end"})
    return rows


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    root = tmp_path / "collection"
    write_beir(root, corpus_rows(), [{"_id": "q1", "text": "alpha"}], {"test": [("q1", "d0", 1)]})
    return root


def make(corpus_dir: Path, output: Path, *args: str) -> dict:
    result = runner.invoke(app, ["pseudo-queries", str(corpus_dir), "-o", str(output), *args])
    assert result.exit_code == 0, result.output
    return json.loads(Path(f"{output}.report.json").read_text())


def test_pseudo_queries_are_deterministic_for_a_seed_and_come_from_their_own_document(
    corpus_dir: Path, tmp_path: Path
):
    texts = {row["_id"]: row for row in corpus_rows()}
    report = make(corpus_dir, tmp_path / "a.jsonl", "--words", "4-9", "--per-document", "3", "--domain", "x")
    make(corpus_dir, tmp_path / "b.jsonl", "--words", "4-9", "--per-document", "3", "--domain", "x")
    make(corpus_dir, tmp_path / "c.jsonl", "--words", "4-9", "--per-document", "3", "--seed", "1")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    examples = read_examples(tmp_path / "a.jsonl")  # the training format
    assert report["queries"] == len(examples) == 6 * 3 and report["documents_without_query"] == {
        "fewer than 5 words": 1
    }
    assert len({e.query_id for e in examples}) == len(examples)
    for example in examples:
        [positive] = example.positives
        words = example.query.split()
        assert 4 <= len(words) <= 9 and example.domain == "x" and not example.negatives
        assert f" {example.query} " in f" {texts[positive]['text']} "  # a crop of its own text
        assert example.query != texts[positive]["text"]  # never the whole of it

    report = make(corpus_dir, tmp_path / "titles.jsonl", "--method", "title")
    titles = {e.positives[0]: e.query for e in read_examples(tmp_path / "titles.jsonl")}
    assert titles == {k: v["title"] for k, v in texts.items() if v["title"]}
    assert report["documents_without_query"] == {"no title": 1}
    make(corpus_dir, tmp_path / "leads.jsonl", "--method", "lead")
    leads = {e.positives[0]: e.query for e in read_examples(tmp_path / "leads.jsonl")}
    assert leads["d0"] == "First one." and leads["d3"] == " ".join(WORDS) + "." and "d6" not in leads


def test_a_draw_of_documents_is_the_same_streamed_or_listed_and_words_without_letters_are_skipped():
    documents = [
        Document(f"d{i}", " ".join([". . . ."] + [f"w{i}x{j}" for j in range(12)])) for i in range(50)
    ]
    exactly = PseudoQuerySettings(min_words=12, max_words=20)
    report = PseudoQueryReport()
    assert not list(pseudo_queries(documents[:3], exactly, report))  # a crop of 12 would be all 12 words
    assert report.skipped == {"fewer than 13 words": 3}
    settings = PseudoQuerySettings(max_documents=7, min_words=3, max_words=5, seed=3)
    listed = list(pseudo_queries(documents, settings))
    streamed = list(pseudo_queries(iter(documents), settings, count=len(documents)))
    assert listed == streamed and len(listed) == 7
    assert all("." not in e.query for e in listed)
    with pytest.raises(ValueError, match="span length 5-3 words is empty"):
        PseudoQuerySettings(min_words=5, max_words=3)


def test_keyword_queries_draw_distinct_words_of_their_document_by_tf_idf_in_text_order(tmp_path: Path):
    # d0 holds `zebra` three times and no other document does; `everywhere` is in all eleven documents, so
    # has no weight; the `commonN` words are in six of them
    zebra = "Zebra, common1 zebra the common2 common3 zebra common4 everywhere."
    rows = [{"_id": "d0", "title": "", "text": zebra}]
    for i in range(1, 10):
        common = " ".join(f"common{j}" for j in range(1, 5)) if i <= 5 else "other"
        rows.append({"_id": f"d{i}", "title": "", "text": f"{common} filler{i} everywhere and more{i}"})
    rows.append({"_id": "short", "title": "", "text": "everywhere alone"})
    root = tmp_path / "collection"
    write_beir(root, rows, [{"_id": "q1", "text": "zebra"}], {"test": [("q1", "d0", 1)]})
    args = ["--method", "keywords", "--words", "2-2", "--per-document", "200", "--domain", "x"]
    report = make(root, tmp_path / "a.jsonl", *args)
    make(root, tmp_path / "b.jsonl", *args)
    make(root, tmp_path / "c.jsonl", *args, "--seed", "1")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert report["documents_without_query"] == {"fewer than 3 keywords": 1}  # `short`: no weighted word
    examples = read_examples(tmp_path / "a.jsonl")  # the training format
    texts = {row["_id"]: row["text"].lower() for row in rows}
    for example in examples:
        [positive] = example.positives
        words = example.query.split()
        assert len(words) == len(set(words)) == 2 and example.domain == "x" and not example.negatives
        assert "everywhere" not in words and "the" not in words and "and" not in words
        assert all(word in texts[positive] for word in words)
        assert sorted(words, key=texts[positive].index) == words  # in the order they first occur
    from_d0 = [e.query.split() for e in examples if e.positives == ["d0"]]
    # by tf-idf, zebra (3 x log 11) outweighs each common word (log 11/6) 12 to 1; uniform draws would
    # take it in 2 queries of 5
    assert len(from_d0) == 200 and sum("zebra" in words for words in from_d0) > 180

    documents = [Document(row["_id"], row["text"]) for row in rows]
    settings = PseudoQuerySettings(method="keywords", min_words=2, max_words=2)
    assert list(pseudo_queries(documents, settings)) == list(
        pseudo_queries(iter(documents), settings, statistics=WordStatistics.of(documents))
    )
    with pytest.raises(ValueError, match="needs the corpus's WordStatistics"):
        list(pseudo_queries(iter(documents), settings))


def test_mined_pseudo_queries_never_take_their_own_passage_or_a_copy_of_it_as_a_negative(
    corpus_dir: Path, tmp_path: Path
):
    make(corpus_dir, tmp_path / "pq.jsonl", "--words", "4-12", "--per-document", "2", "--domain", "x")
    out = tmp_path / "mined.jsonl"
    result = runner.invoke(
        app,
        ["mine", str(corpus_dir), "--examples", str(tmp_path / "pq.jsonl"), "-o", str(out), "--ranks", "1-10",
         "--count", "10"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    texts = {doc.id: doc.full_text for doc in Dataset.open(corpus_dir).iter_corpus()}
    pseudo, mined = read_examples(tmp_path / "pq.jsonl"), read_examples(out)
    assert [(e.query_id, e.query, e.positives, e.domain) for e in mined] == [
        (e.query_id, e.query, e.positives, e.domain) for e in pseudo
    ]
    assert sum(len(e.negatives) for e in mined) > 0
    for example in mined:
        [positive] = example.positives
        assert positive not in example.negatives
        assert all(texts[n] != texts[positive] for n in example.negatives)  # d3 never a negative of d4
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["removed_positive"] > 0 and report["removed_identical_text"] > 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"query_id": "a", "query": "alpha", "positives": ["d0"]}\n'
        '{"query_id": "b", "query": "beta", "positives": ["nope"]}\n'
    )
    result = runner.invoke(app, ["mine", str(corpus_dir), "--examples", str(bad), "-o", str(tmp_path / "x")])
    assert (
        result.exit_code != 0 and "bad.jsonl:2" in str(result.exception) and "'nope'" in str(result.exception)
    )
    assert not (tmp_path / "x").exists()


def test_corpus_modules_and_a_route_trained_on_their_pseudo_queries_load_and_search_like_any(
    tiny_st_model: Path, tmp_path: Path
):
    from densekit.index import SearchIndex
    from densekit.models.encoder import DenseEncoder
    from densekit.recipes.runner import load_recipe, run_recipe
    from densekit.routing.route import Route
    from densekit.training.fine_tuning import run_training

    from .test_modules import put_module
    from .test_training import make_config
    from .training_fixtures import write_training_collection

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    first = tmp_path / "runs" / "first"
    write_training_collection(tmp_path / "first")
    overrides = [f"data.path={tmp_path / 'first'}", "data.domain=first", f"model.path={tiny_st_model}",
                 "pseudo_queries.min_words=2", "pseudo_queries.max_words=4", "train.batch_size=4",
                 "bm25_negatives.first_rank=1", "bm25_negatives.count=2", "dense_negatives.count=2",
                 "dense_negatives.relative_margin=null"]  # fmt: skip
    metrics = run_recipe(recipes / "corpus-module.yaml", first, overrides, device="cpu", show_progress=False)
    rows = json.loads((first / "table.json").read_text())["rows"]
    assert list(rows) == ["BM25", "base zero-shot", "round 1", "round 2"]
    assert all(0 <= row["first"] <= 1 for row in rows.values())
    assert metrics["nDCG@10"] == pytest.approx(rows["round 2"]["first"])
    module = DenseEncoder.load(first / "round2" / "model")
    assert module.own == "first" and module.passage_module() is None  # passages stay the base's

    # a second collection's pseudo-queries, and a query-only module for it, route with the first's
    write_training_collection(tmp_path / "second")
    second_examples = tmp_path / "second.jsonl"
    settings = PseudoQuerySettings(min_words=2, max_words=4, domain="second")
    write_pseudo_queries(Dataset.open(tmp_path / "second"), settings, tmp_path / "second-pq.jsonl")
    negatives = MiningSettings(first_rank=1, count=2)
    mine(Dataset.open(tmp_path / "second"), "train", second_examples, "bm25", negatives, show_progress=False,
         examples_file=tmp_path / "second-pq.jsonl")  # fmt: skip
    encoder = DenseEncoder.load(tiny_st_model)
    put_module(encoder, "query-lora", "second", seed=1)
    encoder.save(tmp_path / "second-module")
    examples = tmp_path / "mixed.jsonl"
    examples.write_text((first / "round1-examples.jsonl").read_text() + second_examples.read_text())
    folders = {"first": str(first / "round2" / "model"), "second": str(tmp_path / "second-module")}
    config = make_config(
        (tmp_path / "first", examples), tiny_st_model, route={"type": "soft", "modules": folders},
        data={"collections": {"second": str(tmp_path / "second")}, "group_size": 2, "shortfall": "random"},
        model={"pooling": None},
    )  # fmt: skip
    run_training(config, tmp_path / "router", show_progress=False)
    route = Route.load(tmp_path / "router" / "model")
    assert route.spec.modules == ["first", "second"]
    index = SearchIndex.load(first / "index")
    queries = route.encode_queries(["about the first topic", "and another"])
    assert len(index.search_run(queries, ["a", "b"], 3)["a"]) == 3

    # the routing recipe over four such runs is valid as written
    load_recipe(recipes / "corpus-routing.yaml", tmp_path / "routing", [f"model.path={tiny_st_model}"])


def test_mining_an_examples_file_refuses_the_options_it_would_ignore(corpus_dir: Path, tmp_path: Path):
    make(corpus_dir, tmp_path / "pq.jsonl")
    for extra in (["--split", "test"], ["--min-relevance", "2"]):
        args = ["mine", str(corpus_dir), "--examples", str(tmp_path / "pq.jsonl"), "-o", str(tmp_path / "m")]
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code != 0 and "do not apply" in str(result.exception)
    assert not (tmp_path / "m").exists()
