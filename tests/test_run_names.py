"""Results a reader can tell apart: `compare` labels each run by a whole name (its path from the current
folder, or `--name`), wrapped rather than cut; a recipe's `expected` score is set beside the run's only
on the collection it was measured on; a step says on the console what it left out."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from densekit.cli.main import app
from densekit.data.trec import write_run
from densekit.recipes.runner import collection_digest, run_recipe

from .conftest import CORPUS, QUERIES, SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]
QUERIES_ELSEWHERE = [{**QUERIES[0], "text": "which animals were tamed"}, *QUERIES[1:]]

runner = CliRunner()
QRELS = {"q1": {"a": 1, "b": 0}, "q2": {"c": 2}, "q3": {"d": 1}}
RUNS = {
    "bench-round1-hard-negatives": {"q1": {"b": 3.0, "a": 2.0}, "q2": {"c": 1.0}, "q3": {"x": 1.0, "d": 0.5}},
    "bench-round2-hard-negatives": {"q1": {"a": 3.0, "b": 2.0}, "q2": {"c": 1.0}, "q3": {"d": 1.0}},
    "bench-round3-hard-negatives": {"q1": {"a": 3.0}},
}


def _runs_under(root: Path) -> tuple[Path, list[str]]:
    """The judgements and one run per RUNS entry as `<name>/scifact/dense.trec` under `root`, as a
    recipe's benchmark steps leave them; returns the judgements and the runs' paths from `root`."""
    qrels = root / "qrels.tsv"
    rows = "".join(f"{q}\t{d}\t{r}\n" for q, docs in QRELS.items() for d, r in docs.items())
    qrels.write_text("query-id\tcorpus-id\tscore\n" + rows)
    paths = []
    for name, run in RUNS.items():
        (root / name / "scifact").mkdir(parents=True)
        write_run(root / name / "scifact" / "dense.trec", run)
        paths.append(f"{name}/scifact/dense.trec")
    return qrels, paths


def _first_column(table: str) -> str:
    """The text of a rich table's first column, its lines joined: a name wrapped over lines reads whole."""
    cells = [re.split(r"[│┃]", line)[1].strip() for line in table.splitlines() if line.count("│") > 2]
    return "".join(cells)


def test_compare_names_each_run_by_its_whole_path_from_here(tmp_path: Path, monkeypatch):
    qrels, paths = _runs_under(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["compare", str(qrels), *paths, "--trials", "100", "--json", "c.json"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert _first_column(result.output) == "".join(paths), result.output  # each whole, in order
    [saved] = json.loads((tmp_path / "c.json").read_text())
    assert saved["control"]["name"] == paths[0]
    assert [arm["name"] for arm in saved["runs"]] == paths[1:]


def test_compare_takes_a_name_per_run(tmp_path: Path, monkeypatch):
    qrels, paths = _runs_under(tmp_path)
    monkeypatch.chdir(tmp_path)
    names = ["round 1", "round 2", "round 3"]
    given = [arg for name in names for arg in ("--name", name)]
    args = ["compare", str(qrels), *paths, "--trials", "100", *given, "--json", "c.json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    [saved] = json.loads((tmp_path / "c.json").read_text())
    assert [saved["control"]["name"], *(arm["name"] for arm in saved["runs"])] == names
    short = runner.invoke(app, ["compare", str(qrels), *paths, "--name", "one", "--name", "two"])
    assert isinstance(short.exception, ValueError)  # `main` shows it in one line, exit status 2
    assert "--name given 2 times for 3 runs" in str(short.exception)
    twice = runner.invoke(app, ["compare", str(qrels), *paths, *given[:4], "--name", "round 1"])
    assert isinstance(twice.exception, ValueError) and "'round 1' is given twice" in str(twice.exception)


# --- a recipe's expected scores, the names of its runs, what its steps left out ---------------------


def _recipe(path: Path, data: Path, expected: dict | None = None, extra: dict | None = None) -> Path:
    """BM25 and its evaluation on `data`, with `expected` scores and `extra` steps first."""
    recipe = {"data": {"path": str(data)}, **({"expected": expected} if expected is not None else {}),
              "steps": {**(extra or {}),
                        "first-stage": {"type": "bm25", "data": "{data.path}", "output": "{out}/bm25.trec"},
                        "evaluate": {"type": "evaluate", "data": "{data.path}", "run": "{out}/bm25.trec",
                                     "output": "{out}/bm25.json", "measures": ["nDCG@10"]}}}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _said(caplog) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


def test_expected_scores_are_compared_only_on_the_collection_they_were_measured_on(
    beir_dir: Path, make_beir, tmp_path: Path, caplog
):
    caplog.set_level(logging.INFO, logger="densekit")
    measured_on = {"collection": "the tiny set", "digest": collection_digest(beir_dir, "test")}
    recipe = _recipe(tmp_path / "r.yaml", beir_dir, {"nDCG@10": 0.5, "measured_on": measured_on})
    metrics = run_recipe(recipe, tmp_path / "here", show_progress=False)
    said = _said(caplog)
    assert f"nDCG@10 {metrics['nDCG@10']:.4f}, expected 0.5000 on the tiny set" in said, said
    difference = metrics["nDCG@10"] - 0.5
    assert f"({difference:+.4f})" in said
    caplog.clear()
    other = make_beir(queries=QUERIES_ELSEWHERE)
    run_recipe(recipe, tmp_path / "there", [f"data.path={other}"], show_progress=False)
    said = _said(caplog)
    assert "expected 0.5000" not in said
    assert "not compared" in said and "the tiny set" in said and str(other) in said, said


def test_expected_scores_without_their_collection_are_not_compared(beir_dir: Path, tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="densekit")
    recipe = _recipe(tmp_path / "r.yaml", beir_dir, {"nDCG@10": 0.5})
    run_recipe(recipe, tmp_path / "out", show_progress=False)
    assert "expected scores not compared: the recipe does not say which collection" in _said(caplog)


def test_the_shipped_recipes_say_where_their_expected_scores_were_measured():
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        expected = yaml.safe_load(path.read_text())["expected"]
        assert expected["measured_on"]["digest"].startswith("sha256:"), path
    scifact = yaml.safe_load((ROOT / "recipes" / "scifact-two-round.yaml").read_text())["expected"]
    data = SHARED_DATA / "scifact"
    if (data / "corpus.jsonl").is_file():  # the digest is SciFact's test split, as the quickstart knows it
        assert scifact["measured_on"]["digest"] == collection_digest(data, "test")


def test_a_recipes_runs_carry_the_name_of_the_step_that_wrote_them(beir_dir: Path, tmp_path: Path):
    run_recipe(_recipe(tmp_path / "r.yaml", beir_dir), tmp_path / "out", show_progress=False)
    first = (tmp_path / "out" / "bm25.trec").read_text().splitlines()[0]
    assert first.split()[5] == "first-stage"


def test_a_step_says_on_the_console_what_it_left_out(make_beir, tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="densekit")
    corpus = [*CORPUS, *({"_id": f"short{n}", "title": "", "text": "Ants"} for n in range(2))]
    data = make_beir(corpus=corpus)
    pseudo = {"pseudo": {"type": "pseudo_queries", "data": "{data.path}", "output": "{out}/pseudo.jsonl",
                         "settings": {"method": "span", "min_words": 3, "max_words": 5}},
              "negatives": {"type": "mine", "data": "{data.path}", "split": "test",
                            "output": "{out}/neg.jsonl",
                            "settings": {"first_rank": 1, "last_rank": 3, "count": 5}}}  # fmt: skip
    run_recipe(_recipe(tmp_path / "r.yaml", data, extra=pseudo), tmp_path / "out", show_progress=False)
    said = _said(caplog)
    report = json.loads((tmp_path / "out" / "pseudo.jsonl.report.json").read_text())
    left = sum(report["documents_without_query"].values())
    assert left >= 2
    assert f"step pseudo: {left} of {len(corpus)} documents gave no pseudo-query (" in said, said
    assert f"see {tmp_path / 'out' / 'pseudo.jsonl.report.json'}" in said
    mined = json.loads((tmp_path / "out" / "neg.jsonl.report.json").read_text())
    short = mined["queries_with_fewer_negatives_than_count"]
    assert short > 0
    assert f"step negatives: {short} of {mined['queries']} queries got fewer than 5 negatives" in said, said


def test_a_benchmark_step_without_a_name_names_its_model_after_the_step(
    beir_dir: Path, tiny_st_model: Path, tmp_path: Path
):
    step = {"type": "benchmark", "model": str(tiny_st_model), "data": [str(beir_dir)],
            "output": "{out}/bench-tiny", "measures": ["nDCG@10"]}  # fmt: skip
    recipe = {"steps": {"bench-tiny": step}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    run_recipe(tmp_path / "r.yaml", tmp_path / "out", device="cpu", show_progress=False)
    results = json.loads((tmp_path / "out" / "bench-tiny" / "results.json").read_text())
    assert results["model"] == "bench-tiny"
