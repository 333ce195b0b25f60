"""The serving benchmark's own parts: its HTTP/1.1 load generator against the real service (every request
answered, 429s retried until served), the split of a profile's CPU into the service's stages, and the
two-checkout comparison's rounds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import serving_ab
from benchmarks.serving import TOKEN, UNSEEN, _hits_answered, load, stage_breakdown
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Batching, Limits, create_app
from tests.conftest import QUERIES, retriever, served, tiny_model, tiny_st_model  # noqa: F401 (fixtures)
from tests.service_fixtures import in_thread

ROOT = Path(__file__).resolve().parents[2]


def test_the_load_generator_gets_every_query_answered_and_retries_429s(retriever: Retriever):  # noqa: F811
    texts = [q["text"] for q in QUERIES] * 10
    bodies = [json.dumps({"query": text, "k": 2}).encode() for text in texts]
    app = create_app(retriever, TOKEN, Limits(max_queued=2, max_queries=2), Batching(max_wait_ms=0))
    with in_thread(app) as url:
        row = asyncio.run(load(url, "/search", bodies, 8, _hits_answered(2)))
    assert (row["answered"], row["errors"], row["lost"]) == (len(texts), 0, 0)
    assert row["429s"] > 0  # eight clients on a queue of two: refused, then served on a retry
    assert row["load_generator_cpu_s"] >= 0 and row["queries_per_s"] > 0


def test_a_profile_splits_each_threads_cpu_by_the_stages_of_its_samples(tmp_path: Path):
    samples = tmp_path / "raw.txt"
    samples.write_text(
        "thread (11): MainThread;run (asyncio/runners.py:1);handle (h11/_connection.py:2) 3\n"
        "thread (11): MainThread;select (selectors.py:468) 96\n"
        "thread (11): MainThread;run (asyncio/base_events.py:1);_run_once (asyncio/base_events.py:2) 1\n"
        "thread (11): MainThread;serialize_response (fastapi/routing.py:3);validate (pydantic/main.py:4) 2\n"
        "thread (12): densekit-encode_0;_answer (densekit/serving/batcher.py:9);"
        "encode_with (densekit/models/encoder.py:3);forward (torch/nn/modules/module.py:4) 9\n"
        "thread (12): densekit-encode_0;_answer (densekit/serving/batcher.py:9);"
        "search_run (densekit/index/base.py:5) 1\n"
    )
    stages = stage_breakdown(samples, {"11": 0.4, "12": 1.0, "13": 0.5}, queries=100)
    # the main thread's 4 ms: 3 samples of HTTP, 2 of writing a response (pydantic inside FastAPI's
    # serialize_response is the response's building), 1 of the event loop; its idle samples do not count
    assert stages == {"forward": 9.0, UNSEEN: 5.0, "HTTP parsing and validation": 2.0,
                      "response building": 1.33, "index search": 1.0, "event loop": 0.67}  # fmt: skip


def test_two_checkouts_are_served_in_alternating_rounds_and_one_without_its_own_src_is_refused(
    served: tuple[Path, Path, Path], tmp_path: Path, capsys  # noqa: F811
):
    data, index, model = served
    common = ["--model", str(model), "--index", str(index), "--data", str(data), "--requests", "12",
              "--concurrency", "3", "--rounds", "3", "--k", "2"]  # fmt: skip
    with pytest.raises(SystemExit, match="does not hold the densekit"):
        serving_ab.main(["--a", str(tmp_path), "--b", str(ROOT), *common, "--output", str(tmp_path / "x")])
    serving_ab.main(["--a", str(ROOT), "--b", str(ROOT), *common, "--output", str(tmp_path / "ab.json")])
    said = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("round")]
    assert said == ["round 1 a", "round 1 b", "round 2 b", "round 2 a", "round 3 a", "round 3 b"]
    result = json.loads((tmp_path / "ab.json").read_text())
    for side in ("a", "b"):
        assert [row["answered"] for row in result["rows"][side]] == [12, 12, 12]
        assert result["summary"][side]["errors"] == result["summary"][side]["lost"] == 0
    assert result["b_vs_a"]["queries_per_s"] > 0
