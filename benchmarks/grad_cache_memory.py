"""Peak memory of a training step: GradCache at batch 256 against no caching at batch 32.

Each configuration runs in its own process (peak resident memory is per process), training
all-MiniLM-L6-v2 for a few steps on SciFact triplets with passages of 256 tokens. Run from the
repository root:

    .venv/bin/python -m benchmarks.grad_cache_memory --data ../shared/data/scifact
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info

CONFIGURATIONS = [
    {"name": "batch 32, no caching", "batch_size": 32, "grad_cache": False},
    {"name": "batch 256, GradCache chunks of 32", "batch_size": 256, "grad_cache": True},
]


def child(data: Path, train_file: Path, batch: int, grad_cache: bool, steps: int, output: Path) -> None:
    from densekit.configuration import validate_config
    from densekit.training.config import TrainConfig
    from densekit.training.fine_tuning import run_training

    config = validate_config(
        {
            "model": {
                "path": "sentence-transformers/all-MiniLM-L6-v2",
                "query_max_length": 64,
                "passage_max_length": 256,
            },
            "data": {"path": str(data), "train": str(train_file), "group_size": 2},
            "optim": {"max_steps": steps, "batch_size": batch},
            "grad_cache": {"enabled": grad_cache, "chunk_size": 32},
            "checkpoint": {"every": 10**6},
            "device": "cpu",
        },
        TrainConfig,
        "benchmark",
    )
    state = run_training(config, output, show_progress=False)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_mib": round(peak_kib / 1024, 1), "seconds": round(state["elapsed_s"], 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", nargs=5, metavar=("TRAIN", "BATCH", "CACHE", "STEPS", "OUT"))
    parser.add_argument(
        "--output", type=Path, default=WORK / "grad_cache_memory.json"
    )
    args = parser.parse_args()
    if args.child:
        train, batch, cache, steps, out = args.child
        child(args.data, Path(train), int(batch), cache == "1", int(steps), Path(out))
        return

    from densekit.data import Dataset
    from densekit.mining.filters import MiningSettings
    from densekit.mining.mine import mine

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        train_file = Path(tmp) / "train.jsonl"
        settings = MiningSettings(first_rank=1, last_rank=30, count=4)
        mine(Dataset.open(args.data), "train", train_file, "bm25", settings, show_progress=False)
        for config in CONFIGURATIONS:
            command = [
                sys.executable, "-m", "benchmarks.grad_cache_memory", "--data", str(args.data), "--child",
                str(train_file), str(config["batch_size"]), "1" if config["grad_cache"] else "0",
                str(args.steps),
                str(Path(tmp) / config["name"].replace(" ", "_").replace(",", "")),
            ]  # fmt: skip
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            results.append({**config, **measured})
            print(results[-1])
    ratio = results[1]["peak_rss_mib"] / results[0]["peak_rss_mib"]
    output = {
        "benchmark": "grad_cache_memory",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "steps": args.steps,
        "passage_max_length": 256,
        "group_size": 2,
        "runs": results,
        "peak_ratio_256_cached_over_32_plain": round(ratio, 3),
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")


if __name__ == "__main__":
    main()
