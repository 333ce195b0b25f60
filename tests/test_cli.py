"""The command line, end to end on a tiny model and collection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from densekit.cli import app

from .test_bm25_and_evaluation import ranked_lists, reference_scores

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return result


def test_pipeline_from_files_to_metrics(tiny_st_model: Path, beir_dir: Path, tmp_path: Path):
    assert invoke("validate", beir_dir).exit_code == 0
    emb, index, run, scores = tmp_path / "emb", tmp_path / "index", tmp_path / "run.trec", tmp_path / "m.json"
    assert (
        invoke("encode", tiny_st_model, beir_dir, "-o", emb, "--no-progress", "--shard", "0/2").exit_code == 0
    )
    assert (
        invoke("encode", tiny_st_model, beir_dir, "-o", emb, "--no-progress", "--shard", "1/2").exit_code == 0
    )
    assert invoke("index", emb, "-o", index, "--type", "hnsw", "--no-progress").exit_code == 0
    result = invoke(
        "search", tiny_st_model, index, beir_dir, "--split", "test", "-o", run, "--k", "3", "--no-progress"
    )
    assert result.exit_code == 0
    lines = run.read_text().splitlines()
    assert len(lines) == 4 * 3
    assert all(line.split()[0] != line.split()[2] for line in lines)  # q3 never retrieves itself
    qrels_file = beir_dir / "qrels" / "test.tsv"
    names = ["nDCG@10", "RR@10", "R@10", "R@100", "AP", "P@1"]
    result = invoke("evaluate", qrels_file, run, "--json", scores, *(arg for n in names for arg in ("-m", n)))
    assert result.exit_code == 0
    written = json.loads(scores.read_text())
    assert list(written) == names
    qrels: dict[str, dict[str, int]] = {}
    for line in qrels_file.read_text().splitlines()[1:]:
        query, doc, relevance = line.split("\t")
        qrels.setdefault(query, {})[doc] = int(relevance)
    assert written == pytest.approx(reference_scores(qrels, ranked_lists(run)), abs=1e-9)


def test_bm25_command_writes_a_run(beir_dir: Path, tmp_path: Path):
    result = invoke(
        "bm25", beir_dir, "--split", "test", "-o", tmp_path / "bm25.trec", "--k", "2", "--no-progress"
    )
    assert result.exit_code == 0
    assert len((tmp_path / "bm25.trec").read_text().splitlines()) == 8


def test_evaluate_per_query_output(beir_dir: Path, tmp_path: Path):
    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 d1 1 2.0 t\nq1 Q0 d9 2 1.0 t\nq2 Q0 d4 1 1.0 t\n")
    out = tmp_path / "per-query.tsv"
    assert (
        invoke("evaluate", beir_dir / "qrels" / "test.tsv", run, "-m", "RR@10", "--per-query", out).exit_code
        == 0
    )
    assert sorted(out.read_text().splitlines()) == [
        "q1\tRR@10\t1.000000",
        "q2\tRR@10\t1.000000",
        "q3\tRR@10\t0.000000",  # judged but absent from the run: counted as 0, as ir_measures does
        "q4\tRR@10\t0.000000",
    ]


def test_validate_fails_listing_file_and_line(beir_dir: Path):
    (beir_dir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\tyes\n")
    result = invoke("validate", beir_dir)
    assert result.exit_code == 1
    assert "test.tsv:2: error: relevance 'yes' is not an integer" in result.output.replace("\n", "")


def test_bad_input_exits_with_a_message_not_a_traceback(beir_dir: Path, tmp_path: Path):
    (beir_dir / "queries.jsonl").write_text('{"_id": "q1"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from densekit.cli import main; main()",
            "bm25",
            str(beir_dir),
            "-o",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert 'queries.jsonl:1: error: missing "text"' in proc.stderr.replace("\n", "")
    assert "Traceback" not in proc.stderr
