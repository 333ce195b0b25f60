"""SciFact fine-tuning from all-MiniLM-L6-v2: zero-shot, round 1 and two-round, with wall-clock.

Runs the recipes (each skips what an earlier run already finished) and collects their test nDCG@10
and step timings. Round 1 is the `round1-evaluate` step of the two-round recipe, which is the same
computation as `recipes/scifact-round1.yaml`. Run from the repository root:

    .venv/bin/python -m benchmarks.scifact_finetune
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.recipes.runner import run_recipe

PUBLISHED = {
    "zero-shot": "0.645 (MTEB)",
    "two-round": "goal 0.70; Tevatron's BERT-base fine-tune: 0.747",
}


def collect(out: Path) -> dict:
    timings = json.loads((out / "timings.json").read_text())
    return {"metrics": json.loads((out / "metrics.json").read_text()), "step_seconds": timings,
            "total_seconds": round(sum(timings.values()), 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument(
        "--output", type=Path, default=WORK / "scifact_finetune.json"
    )
    args = parser.parse_args()
    results = {}
    for name in ("zero-shot", "two-round"):
        out = args.runs / f"scifact-{name}"
        run_recipe(Path(f"recipes/scifact-{name}.yaml"), out)
        command = f"densekit run recipes/scifact-{name}.yaml --out {out}"
        results[name] = {"recipe": f"recipes/scifact-{name}.yaml", "command": command, **collect(out)}
    two_round = args.runs / "scifact-two-round"
    round1_steps = (
        "bm25-negatives",
        "round1",
        "round1-encode",
        "round1-index",
        "round1-search",
        "round1-evaluate",
    )
    results["round1"] = {
        "recipe": "recipes/scifact-round1.yaml (measured as the round-1 steps of the two-round recipe)",
        "metrics": json.loads((two_round / "round1-test.json").read_text()),
        "total_seconds": round(sum(results["two-round"]["step_seconds"][s] for s in round1_steps), 1),
    }
    output = {
        "benchmark": "scifact_finetune",
        "data": "SciFact: train on qrels/train.tsv (809 queries), evaluate on qrels/test.tsv (300 queries)",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "published": PUBLISHED,
        "results": {k: results[k] for k in ("zero-shot", "round1", "two-round")},
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    for name, row in output["results"].items():
        print(f"{name:10s} nDCG@10 {row['metrics']['nDCG@10']:.4f}  {row['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
