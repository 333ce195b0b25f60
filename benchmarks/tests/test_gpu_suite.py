"""The GPU suite's smoke run: every part on tiny shapes on the CPU, so that the command a lent GPU machine
runs cannot rot between loans; one part made to fail is recorded while the others still run."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import shared_collection

ROOT = Path(__file__).resolve().parents[2]


def finite_positive(*values: float) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow  # left out of CI for its length (the GPU suite on CPU shapes); `pytest -m slow` runs it
@pytest.mark.timeout(1500)  # about 2 minutes on a quiet 2-core CPU; many more where it is shared
def test_every_part_runs_on_tiny_shapes_and_a_failing_part_leaves_the_rest_running(tmp_path: Path):
    shared = shared_collection("scifact").parent
    wiki = tmp_path / "passages.jsonl.gz"  # the tests never read wiki1m: a stand-in of the same layout
    with gzip.open(wiki, "wt", encoding="utf-8") as handle:
        for i in range(60):
            handle.write(
                json.dumps({"_id": f"p{i}", "title": "", "text": f"passage {i} about cells " * (i % 9 + 1)})
                + "\n"
            )
    output = tmp_path / "gpu_suite.json"
    command = [sys.executable, "-m", "benchmarks.gpu_suite", "--device", "cpu", "--smoke",
               "--data", str(tmp_path / "nothing-prepared"), "--shared", str(shared),
               "--wiki-corpus", str(wiki), "--work", str(tmp_path / "work"), "--output", str(output),
               "--fail-part", "exact_search"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    parts = results["parts"]
    assert list(parts) == ["machine", "cuda_tests", "fine_tune_curve", "train_throughput", "mfu", "encode",
                           "wiki_encode_rate", "exact_search", "grad_cache_memory", "ance"]  # fmt: skip
    failed = parts.pop("exact_search")
    assert not failed["ok"] and failed["error"] == "RuntimeError: failure injected by --fail-part"
    assert "failure injected" in failed["traceback"][-1]
    assert {name: entry.get("error") for name, entry in parts.items() if not entry["ok"]} == {}
    result = {name: entry["result"] for name, entry in parts.items()}
    assert results["smoke"] and results["machine"]["cpu"] and "--smoke" in results["command"]

    assert result["machine"]["attn_implementation"] == "sdpa"
    tests = result["cuda_tests"]
    assert tests["failures"] == tests["errors"] == 0 and tests["passed"] >= 7
    assert tests["skipped"] == 2  # fp16's loss scaling and the GPU's synchronisation: a GPU's alone
    curve = result["fine_tune_curve"]
    assert len(curve["bf16"]["losses"]) == 10 and all(math.isfinite(x) for x in curve["bf16"]["losses"])
    assert curve["within_tolerance"] and len(curve["initial_weights_sha256"]) == 64
    assert curve["reference_source"].startswith("this run, cpu, float32")  # not the GPU run's reference
    for run in result["train_throughput"]["runs"]:
        assert finite_positive(
            run["densekit_queries_per_s"], run["sentence_transformers_queries_per_s"], run["ratio"]
        )
    assert all(finite_positive(r["queries_per_s"], r["of_measured_matmul"]) for r in result["mfu"]["runs"])
    for shape in result["encode"]["shapes"].values():
        assert finite_positive(shape["ratio_to_best_peer"]) and shape["mean_cosine_to_peer"] > 0.99
    assert result["wiki_encode_rate"]["passages"] == 48 and finite_positive(
        result["wiki_encode_rate"]["passages_per_s"]
    )
    memory = result["grad_cache_memory"]
    assert finite_positive(memory["ratio"], *(run["peak_mib"] for run in memory["runs"].values()))
    ance = result["ance"]
    assert finite_positive(ance["queries_per_s_alone"], ance["queries_per_s_with_inferencer"], ance["ratio"])
    goals = results["goals"]
    assert goals["GradCache at batch 512 within 1.3x the peak memory of batch 32"]["value"] == memory["ratio"]
