"""Benchmark scripts, each run from the repository root as `python -m benchmarks.NAME`."""

from pathlib import Path

# Where a benchmark works and writes its figures unless told otherwise: a folder under the current
# directory, never the results committed in benchmarks/results (name one of those with --output or
# --results to update it).
WORK = Path("runs/benchmarks")
