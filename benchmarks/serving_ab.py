"""Two checkouts' search services side by side in one run: the same model, index and queries, bursts of
`/search` requests sent to each in turn, so that whatever else the machine does falls on both alike.

Each checkout's `densekit serve` runs in its own process with that checkout's `src/` first on its
`PYTHONPATH` (the densekit it imports is checked to be that one); both stay up for the whole run, the
one not under load idle. Each round sends `--requests` single-query requests at `--concurrency` in
flight to one service and then the other, the order swapped every round (ABBA...), after a warm-up burst
each; every burst is a row as `benchmarks/serving.py` measures it (queries/s, p50/p99, the service's CPU
a query, errors, lost). The summary gives each side's median queries/s and CPU a query over the rounds,
and B's as a ratio to A's. Run from the repository root:

    python -m benchmarks.serving_ab --a /work/wt-before --b . --index runs/scifact-index \\
        --data ../shared/data/scifact --rounds 6 --output benchmarks/results/serving_architecture_ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info
from benchmarks.serving import TOKEN, Server, _free_port, _hits_answered, _started, load
from densekit.data.dataset import Dataset
from densekit.io.atomic import write_text_atomic


def densekit_of(checkout: Path) -> Path:
    """The densekit package a Python started with `checkout`'s src first on its path imports."""
    probe = "import densekit, pathlib; print(pathlib.Path(densekit.__file__).resolve().parent)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(checkout / "src")})  # fmt: skip
    return Path(found.stdout.strip())


def start_checkout(name: str, checkout: Path, args: argparse.Namespace, folder: Path) -> Server:
    """`densekit serve` of `checkout`, once its /health answers."""
    expected = (checkout / "src" / "densekit").resolve()
    if densekit_of(checkout) != expected:
        raise SystemExit(f"{checkout}: its src/ does not hold the densekit Python imports from it")
    port = _free_port()
    command = [sys.executable, "-m", "densekit", "serve", args.model, str(args.index), "--corpus",
               str(args.data), "--port", str(port), "--api-key-file", str(folder / "key"),
               "--device", "cpu"]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    return _started(name, command, port, folder / f"{name}.log", environment, "densekit:query")


def summary(rows: list[dict]) -> dict:
    """Medians over one side's rounds, and whether every request was answered."""
    cpu = [r["server_cpu_ms_per_query"] for r in rows]
    return {
        "queries_per_s_median": round(statistics.median(r["queries_per_s"] for r in rows), 2),
        "server_cpu_ms_per_query_median": round(statistics.median(cpu), 3),
        "queries_per_s": [r["queries_per_s"] for r in rows],
        "server_cpu_ms_per_query": [r["server_cpu_ms_per_query"] for r in rows],
        "errors": sum(r["errors"] for r in rows),
        "lost": sum(r["lost"] for r in rows),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and write the results file."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", type=Path, required=True, help="the checkout before (its root)")
    parser.add_argument("--b", type=Path, required=True, help="the checkout after (its root)")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=1200, help="queries in each burst")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6, help="bursts to each side")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--output", type=Path, default=WORK / "serving_ab" / "serving_ab.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1:
        raise SystemExit("--rounds, --requests and --concurrency are at least 1")
    texts = list(Dataset.open(args.data).split_queries("test")[0].values())
    queries = (texts * (args.requests // len(texts) + 1))[: args.requests]
    bodies = [json.dumps({"query": text, "k": args.k}).encode() for text in queries]
    answered = _hits_answered(args.k)
    rows: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "key").write_text(TOKEN + "\n")
        servers = {side: start_checkout(side, getattr(args, side), args, folder) for side in ("a", "b")}
        try:
            for server in servers.values():
                asyncio.run(load(server.url, "/search", bodies[:64], 4, answered))  # warm up
            for round_number in range(args.rounds):
                for side in ("a", "b") if round_number % 2 == 0 else ("b", "a"):
                    server = servers[side]
                    row = asyncio.run(load(server.url, "/search", bodies, args.concurrency, answered,
                                           server.process.pid))  # fmt: skip
                    rows[side].append(row)
                    print(f"round {round_number + 1} {side}: {row['queries_per_s']} queries/s, "
                          f"{row['server_cpu_ms_per_query']} ms CPU a query", flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    sides = {side: summary(side_rows) for side, side_rows in rows.items()}
    given = argv if argv is not None else sys.argv[1:]
    medians = {key: (sides["a"][f"{key}_median"], sides["b"][f"{key}_median"])
               for key in ("queries_per_s", "server_cpu_ms_per_query")}  # fmt: skip
    # a burst too short for the clock's ticks can count no CPU at all: no ratio then
    ratio = {key: round(b / a, 3) if a else None for key, (a, b) in medians.items()}
    result = {
        "command": " ".join(["python -m benchmarks.serving_ab", *given]),
        "machine": machine_info(),
        "a": str(args.a.resolve()), "b": str(args.b.resolve()),
        "model": args.model, "index": str(args.index), "data": str(args.data),
        "requests": args.requests, "concurrency": args.concurrency, "rounds": args.rounds,
        "summary": sides,
        "b_vs_a": ratio,
        "rows": rows,
    }  # fmt: skip
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    print(json.dumps({"summary": sides, "b_vs_a": result["b_vs_a"]}, indent=2))
    print(f"written to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
