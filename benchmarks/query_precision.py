"""Query encoding at float32 and bf16 autocast, as `densekit serve --precision` encodes them.

Encodes the first N test queries of a collection with densekit's `embed_texts` (all-MiniLM-L6-v2,
query max length 64) one at a time and in batches of 32, float32 and bf16 alternating per round, and
reports queries per second (median over rounds) and the bf16/float32 ratio for each batch size. bf16
pays only on a CPU with bf16 instructions (AVX512-BF16 or AMX) or a GPU. Run from the repository root:

    .venv/bin/python -m benchmarks.query_precision --data ../shared/data/scifact --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data import Dataset
from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PRECISIONS = ("float32", "bf16")


def main() -> None:
    """Time each batch size and precision in alternating rounds and write the results file."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--queries", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--output", type=Path, default=WORK / "query_precision.json"
    )
    args = parser.parse_args()

    texts = list(Dataset.open(args.data).queries("test").values())[: args.queries]
    encoder = DenseEncoder.load(MODEL).eval()
    reference = embed_texts(encoder, texts, "query", 32, "float32")
    least_cosine = float(np.min(np.sum(embed_texts(encoder, texts, "query", 32, "bf16") * reference, axis=1)))
    rates: dict[str, dict[str, list[float]]] = {str(b): {p: [] for p in PRECISIONS} for b in args.batch_sizes}
    for _ in range(args.rounds):
        for batch_size in args.batch_sizes:
            for precision in PRECISIONS:
                start = time.perf_counter()
                embed_texts(encoder, texts, "query", batch_size, precision)
                rates[str(batch_size)][precision].append(len(texts) / (time.perf_counter() - start))
    summary = {
        batch: {
            **{f"{p}_queries_per_s": round(statistics.median(r[p]), 1) for p in PRECISIONS},
            "bf16_over_float32": round(statistics.median(r["bf16"]) / statistics.median(r["float32"]), 2),
        }
        for batch, r in rates.items()
    }
    result = {
        "benchmark": "query_precision",
        "command": " ".join(["python -m benchmarks.query_precision", *sys.argv[1:]]),
        "model": MODEL,
        "queries": len(texts),
        "rounds": args.rounds,
        "least_cosine_bf16_to_float32": round(least_cosine, 5),
        "by_batch_size": summary,
        "queries_per_s": rates,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"least_cosine": result["least_cosine_bf16_to_float32"], **summary}))


if __name__ == "__main__":
    main()
