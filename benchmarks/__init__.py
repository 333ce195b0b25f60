"""Benchmark scripts, each run from the repository root as `python -m benchmarks.NAME`."""

import argparse
from pathlib import Path

# Where a benchmark works and writes its figures unless told otherwise: a folder under the current
# directory, never the results committed in benchmarks/results (name one of those with --output or
# --results to update it).
WORK = Path("runs/benchmarks")


def rounds_parser(doc: str, output_name: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times a model on a collection's queries in alternating rounds:
    --model, --data, --batch, --rounds and --output (WORK/`output_name` by default)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=WORK / output_name)
    return parser
