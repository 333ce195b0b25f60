"""The module-kinds benchmark runs a kind's two-round recipe and reads its figures from the run (a
check of the benchmark script, kept with it: the package's tests never import benchmarks/)."""

import json
from pathlib import Path

import pytest

from benchmarks.module_kinds import measure_kind, measured_rows, run_log, to_markdown


def test_a_module_and_the_full_fine_tune_are_measured_from_their_runs(
    beir_dir: Path, tiny_model: Path, tmp_path: Path
):
    overrides = [f"model.path={tiny_model}", "train.batch_size=1", "train.epochs=1"]
    lora = measure_kind("lora", 5e-4, beir_dir, tmp_path / "runs", overrides)
    full = measure_kind("full", 2e-5, beir_dir, tmp_path / "runs", overrides)
    for row, kind in ((lora, "lora"), (full, "full")):
        out = tmp_path / "runs" / f"{kind}-lr{row['learning_rate']:g}"
        assert row["round2_ndcg@10"] == json.loads((out / "test.json").read_text())["nDCG@10"]
        assert row["round1_ndcg@10"] == json.loads((out / "round1-test.json").read_text())["nDCG@10"]
        assert row["peak_memory_gib"] > 0.1 and row["seconds_per_step_round1"] > 0
    assert (tmp_path / "runs" / "lora-lr0.0005" / "round2" / "model" / "densekit-module.json").is_file()
    assert lora["trainable"] > 0 and lora["trainable_percent"] < 100 and full["trainable"] is None
    assert lora["model_on_disk_mib"] < full["model_on_disk_mib"]
    table = to_markdown([full, lora]).splitlines()
    assert len(table) == 4 and table[2].startswith("| full | 2e-05 |") and table[3].startswith("| lora |")
    assert table[2].endswith("| 1.00 |") and to_markdown([lora]).splitlines()[2].endswith("| — |")

    log = tmp_path / "runs" / "lora-lr0.0005" / "round1" / "train_log.jsonl"
    before = log.stat().st_mtime_ns
    again = measure_kind("lora", 5e-4, beir_dir, tmp_path / "runs", overrides)
    assert log.stat().st_mtime_ns == before and again["round2_ndcg@10"] == lora["round2_ndcg@10"]


def test_rows_of_another_collection_or_settings_are_not_taken_as_measured(tmp_path: Path):
    output = tmp_path / "module_kinds.json"
    rows = [{"kind": "lora", "learning_rate": 5e-4}]
    output.write_text(json.dumps({"data": "/d/scifact", "overrides": ["train.epochs=1"], "rows": rows}))
    assert measured_rows(output, Path("/d/scifact"), ["train.epochs=1"]) == rows
    assert measured_rows(tmp_path / "absent.json", Path("/d/scifact"), []) == []
    with pytest.raises(SystemExit, match=r"measured on /d/scifact .* not /d/nfcorpus"):
        measured_rows(output, Path("/d/nfcorpus"), ["train.epochs=1"])
    with pytest.raises(SystemExit, match="give another --output"):
        measured_rows(output, Path("/d/scifact"), [])


def test_each_learning_rate_of_a_kind_has_its_own_log():
    runs = Path("runs")
    logs = {run_log(runs / f"lora-lr{rate:g}") for rate in (5e-4, 1e-3, 2e-5)}
    assert logs == {runs / "lora-lr0.0005.log", runs / "lora-lr0.001.log", runs / "lora-lr2e-05.log"}
