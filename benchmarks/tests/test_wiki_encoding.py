"""wiki_encoding's `quality` part on a small stand-in for wiki1m: its float32 row is what searching the
slice's own encoding gives, scored as `wiki_quality` scores its zero-shot run (two code paths), and a
second run reuses the embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tests.wiki_fixtures import one_thread, wiki_like  # noqa: F401 (fixture)
from benchmarks.wiki_encoding import main
from benchmarks.wiki_quality import ZERO_SHOT
from benchmarks.wiki_quality import main as quality_main


def test_float32_row_is_the_slice_searched_exactly_and_a_second_run_reuses_its_encoding(
    tmp_path: Path, tiny_st_model: Path
):
    _, part, embeddings = wiki_like(tmp_path, tiny_st_model)
    output = tmp_path / "quality.json"
    argv = ["quality", "--data", str(part), "--paths", "torch float32", "--model", str(tiny_st_model),
            "--max-length", "48", "--work", str(tmp_path / "enc"), "--output", str(output)]  # fmt: skip
    main(argv)
    row = json.loads(output.read_text())["torch float32"]
    assert row["passages"] == 700 and row["nDCG@10_minus_float32"] == 0

    reference = tmp_path / "reference.json"
    quality_main(["--sizes", f"small={part}", "--embeddings", str(embeddings), "--model",
                  str(tiny_st_model), "--work", str(tmp_path / "work"), "--output", str(reference),
                  "--trials", "100"])  # fmt: skip
    expected = json.loads(reference.read_text())["sizes"]["small"][ZERO_SHOT]["metrics"]
    assert row["metrics"] == pytest.approx(expected, abs=1e-6)

    stored = tmp_path / "enc" / "torch-float32" / "embeddings" / "part-00000-of-00001.npy"
    written = stored.stat().st_mtime_ns
    main(argv)
    assert stored.stat().st_mtime_ns == written  # the slice's encoding kept, not made again
    again = json.loads(output.read_text())["torch float32"]
    assert again["metrics"] == row["metrics"]
    assert again["encoding_reused"] and "encode_s" not in again and "encode_s" in row  # no stale time


def test_quality_refuses_openvino_paths_saying_how_to_measure_them(tmp_path: Path, tiny_st_model: Path):
    _, part, _ = wiki_like(tmp_path, tiny_st_model)
    with pytest.raises(SystemExit, match=r"python -m benchmarks\.wiki_quality --embeddings FOLDER"):
        main(["quality", "--data", str(part), "--paths", "openvino int8", "--model", str(tiny_st_model),
              "--work", str(tmp_path / "enc"), "--output", str(tmp_path / "quality.json")])  # fmt: skip
    assert not (tmp_path / "quality.json").exists()
