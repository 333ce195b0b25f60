"""benchmarks/matryoshka on a small collection: each width's nDCG@10 is what densekit's own
`--dimensions` path gives (`densekit benchmark --dimensions d`: the encoder cuts, a flat index searches),
and a second run keeps every stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.matryoshka import main
from benchmarks.tests.wiki_fixtures import one_thread, write_collection  # noqa: F401 (fixture)
from densekit.cli import app


def benchmark_ndcg(model: Path, data: Path, output: Path, dimensions: int) -> float:
    """nDCG@10 of `densekit benchmark MODEL DATA --dimensions N` on the test queries."""
    arguments = ["benchmark", model, data, "-o", output, "--dimensions", dimensions, "--no-progress"]
    result = CliRunner().invoke(app, [str(a) for a in arguments], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (collection,) = json.loads((output / "results.json").read_text())["collections"]
    cut = f"({dimensions} dimensions)"
    (dense,) = [scores for name, scores in collection["scores"].items() if cut in name]
    return dense["nDCG@10"]


def test_each_width_scores_as_the_encoder_cut_to_it_and_a_second_run_measures_nothing(
    tmp_path: Path, tiny_st_model: Path
):
    write_collection(tmp_path / "shared" / "toy")
    output = tmp_path / "results" / "matryoshka.json"
    argv = ["--models", f"tiny={tiny_st_model}", "--collections", "toy", "--shared", str(tmp_path / "shared"),
            "--dims", "16", "8", "--work", str(tmp_path / "work"), "--output", str(output)]  # fmt: skip
    main(argv)
    entry = json.loads(output.read_text())["collections"]["toy"]["tiny"]
    assert entry["full_width"] == 32 and entry["normalize"] is True
    assert set(entry["widths"]) == {"32", "16", "8"}
    assert entry["widths"]["32"]["share_of_full_width"] == 1.0
    for width in (16, 8):
        own = benchmark_ndcg(tiny_st_model, tmp_path / "shared" / "toy", tmp_path / f"bench-{width}", width)
        assert entry["widths"][str(width)]["nDCG@10"] == pytest.approx(own, abs=1e-6)
    assert entry["widths"]["8"]["nDCG@10"] != entry["widths"]["32"]["nDCG@10"]  # the cut changed the ranking

    main(argv)
    again = json.loads(output.read_text())
    assert len(again["runs"]) == 2 and again["collections"]["toy"]["tiny"]["measured_in"] == 0  # kept
    assert "| tiny |" in output.with_suffix(".md").read_text() and output.with_suffix(".png").stat().st_size


def test_a_rotated_models_widths_score_as_the_model_rotate_makes(tmp_path: Path, tiny_st_model: Path):
    write_collection(tmp_path / "shared" / "toy")
    output = tmp_path / "results" / "matryoshka.json"
    main(["--models", f"tiny={tiny_st_model}", "--collections", "toy", "--shared", str(tmp_path / "shared"),
          "--dims", "8", "--rotate", "--work", str(tmp_path / "work"), "--output", str(output)])  # fmt: skip
    entry = json.loads(output.read_text())["collections"]["toy"]["tiny rotated"]
    assert entry["rotated"] is True
    rotated = tmp_path / "rotated"
    arguments = ["rotate", tiny_st_model, tmp_path / "work" / "tiny" / "toy" / "embeddings", "-o", rotated]
    result = CliRunner().invoke(app, [str(a) for a in arguments], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    own = benchmark_ndcg(rotated, tmp_path / "shared" / "toy", tmp_path / "bench-8", 8)
    assert entry["widths"]["8"]["nDCG@10"] == pytest.approx(own, abs=1e-6)
    plain = json.loads(output.read_text())["collections"]["toy"]["tiny"]
    assert entry["widths"]["32"]["nDCG@10"] == pytest.approx(plain["widths"]["32"]["nDCG@10"], abs=1e-6)
    assert entry["widths"]["8"]["nDCG@10"] != plain["widths"]["8"]["nDCG@10"]  # the rotation changed the cut
