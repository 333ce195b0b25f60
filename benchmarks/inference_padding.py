"""What padding costs query encoding on a CPU, and what packing and cut batches save (issue 53).

A search service gathers the queries that arrive together, sorts them by length and encodes them; it
cannot sort queries that have not arrived, so its batches hold more padding than an offline encoding
of every query at once. SciFact's test queries are encoded in groups as they arrive (32 and 64 at a
time, in file order) and all at once, each group sorted by length, five ways:

- `sentence-transformers`: the peer, `SentenceTransformer.encode(group, batch_size=32)`;
- `padded, batches of 32`: transformers' forward pass over sorted batches of 32 (densekit before);
- `padded, cut batches`: the same, cut where padding costs more than another pass
  (`densekit.inference.length_batches`; densekit's way for models it cannot pack);
- `packed`: densekit's `embed_texts`, which for a plain BERT on a CPU computes only the real tokens
  (`densekit.models.packed`), in batches of 32;

each timed in alternating rounds (the order rotated each round), the median reported as queries/s and
CPU ms a query (the process's, its compute threads included), and as a ratio to sentence-transformers.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.inference_padding --data ../shared/data/scifact

(`OMP_WAIT_POLICY=PASSIVE` as `densekit serve` runs: idle compute threads sleep rather than spin.)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks import rounds_parser
from benchmarks.machine import machine_info
from densekit.data.dataset import Dataset
from densekit.encoding.embed import embed_texts
from densekit.inference import length_batches
from densekit.io.atomic import write_text_atomic
from densekit.models import DenseEncoder
from densekit.models.hub import resolve_model_path
from densekit.models.padding import CPU_PASS_TOKENS
from densekit.models.pooling import pool


def _padded(encoder: DenseEncoder, per_pass: int | None, batch: int) -> Callable[[list[str]], None]:
    """Encode a group with transformers' forward pass over padded batches (fixed, or cut)."""
    backbone = encoder.backbone("query")

    def run(texts: list[str]) -> None:
        token_ids = encoder.tokenize(texts, "query")
        order = np.argsort([-len(ids) for ids in token_ids], kind="stable")
        lengths = np.asarray([len(token_ids[i]) for i in order])
        with torch.inference_mode():
            for start, end in length_batches(lengths, batch, per_pass):
                inputs = encoder.pad([token_ids[i] for i in order[start:end]])
                hidden = backbone(**inputs).last_hidden_state
                torch.nn.functional.normalize(pool(hidden, inputs["attention_mask"], "mean"), dim=-1)

    return run


def main() -> None:
    """Measure every way on every grouping and write the results."""
    args = rounds_parser(__doc__, "inference_padding.json").parse_args()
    from sentence_transformers import SentenceTransformer

    path = resolve_model_path(args.model)
    encoder = DenseEncoder.load(path)
    encoder.eval()
    peer = SentenceTransformer(path, device="cpu")
    queries, _ = Dataset.open(args.data).split_queries("test")
    texts = list(queries.values())
    ways: dict[str, Callable[[list[str]], None]] = {
        "sentence-transformers": lambda group: peer.encode(group, batch_size=args.batch),
        f"padded, batches of {args.batch}": _padded(encoder, None, args.batch),
        "padded, cut batches": _padded(encoder, CPU_PASS_TOKENS, args.batch),
        "packed": lambda group: embed_texts(encoder, group, "query", args.batch),
    }
    results: dict[str, dict] = {}
    for size in (32, 64, len(texts)):
        groups = [texts[i : i + size] for i in range(0, len(texts), size)]
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        names = list(ways)
        for way in ways.values():
            way(groups[0])  # warm up
        for round_number in range(args.rounds):
            for name in names[round_number % len(names) :] + names[: round_number % len(names)]:
                cpu, wall = time.process_time(), time.perf_counter()
                for group in groups:
                    ways[name](group)
                timings[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        label = "all at once" if size == len(texts) else f"groups of {size} as they arrive"
        rows = {}
        for name, measured in timings.items():
            wall = statistics.median(w for w, _ in measured)
            cpu = statistics.median(c for _, c in measured)
            rows[name] = {"queries_per_s": round(len(texts) / wall, 1),
                          "cpu_ms_per_query": round(1000 * cpu / len(texts), 2)}  # fmt: skip
        peer_row = rows["sentence-transformers"]
        for row in rows.values():
            row["queries_per_s_vs_peer"] = round(row["queries_per_s"] / peer_row["queries_per_s"], 2)
            row["cpu_vs_peer"] = round(row["cpu_ms_per_query"] / peer_row["cpu_ms_per_query"], 2)
        results[label] = rows
        print(label, json.dumps(rows, indent=1), flush=True)
    result = {
        "command": "python -m benchmarks.inference_padding " + " ".join(sys.argv[1:]),
        "machine": machine_info(), "model": args.model, "data": str(args.data), "queries": len(texts),
        "batch": args.batch, "rounds": args.rounds, "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "results": results,
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
