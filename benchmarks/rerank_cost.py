"""Online cost of a query: dense search against reranking its top documents with a cross-encoder.

For each of the first --queries test queries of DATA, one at a time as a service would see them:
dense search (encode the query with MODEL, search INDEX for the top --depth) and reranking those
documents (scoring --depth pairs with CROSS_ENCODER in batches of --batch-size), each timed with a
wall clock; sentence-transformers' `CrossEncoder.predict` on the same pairs (float32, its default) is
the peer. With --precision bf16 densekit encodes the query and scores the pairs under bf16 autocast.
Reports per query the medians and the ratio reranking / dense search (ANCE reports about 100x on
GPUs). The cost of a cross-encoder depends on its size and the pairs' lengths, not on its training.

    python -m benchmarks.rerank_cost --model sentence-transformers/all-MiniLM-L6-v2 \\
        --index runs/bench-minilm/scifact/index --cross-encoder runs/ce-scifact/model \\
        --data ../shared/data/scifact --queries 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data.dataset import Dataset
from densekit.io.atomic import write_text_atomic
from densekit.models.cross_encoder import CrossEncoder
from densekit.retrieval.retriever import Retriever


def main() -> None:
    """Time each query's dense search and the reranking of its top documents; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--index", type=Path, required=True, help="an index built with --model")
    parser.add_argument("--cross-encoder", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", choices=["float32", "bf16"], default="float32")
    parser.add_argument("--output", type=Path, default=WORK / "rerank_cost.json")
    args = parser.parse_args()
    from sentence_transformers import CrossEncoder as STCrossEncoder

    dataset = Dataset.open(args.data)
    queries, _ = dataset.split_queries(args.split)
    chosen = list(queries.items())[: args.warmup + args.queries]
    texts = {doc.id: doc.full_text for doc in dataset.iter_corpus()}
    retriever = Retriever.open(args.model, args.index, device="cpu")
    cross_encoder = CrossEncoder.load(args.cross_encoder, args.max_length).eval()
    peer = STCrossEncoder(args.cross_encoder, device="cpu", max_length=args.max_length)

    rows = []
    for number, (query_id, query) in enumerate(chosen):
        start = time.perf_counter()
        hits = retriever.hits(retriever.encode_queries([query], precision=args.precision), args.depth)[0]
        dense = time.perf_counter() - start
        pairs = [(query, texts[hit.id]) for hit in hits]
        start = time.perf_counter()
        ours = cross_encoder.score(pairs, args.batch_size, precision=args.precision)
        rerank = time.perf_counter() - start
        start = time.perf_counter()
        theirs = peer.predict(pairs, batch_size=args.batch_size, activation_fn=torch.nn.Identity())
        rerank_peer = time.perf_counter() - start
        if number < args.warmup:
            continue
        rows.append({"query": query_id, "dense_s": dense, "rerank_s": rerank, "rerank_peer_s": rerank_peer,
                     "max_score_difference": float(abs(ours - theirs).max())})  # fmt: skip
        print(f"{query_id}: dense {dense * 1000:.1f} ms, rerank {rerank:.2f} s, peer {rerank_peer:.2f} s")

    dense_median = statistics.median(r["dense_s"] for r in rows)
    rerank_median = statistics.median(r["rerank_s"] for r in rows)
    peer_median = statistics.median(r["rerank_peer_s"] for r in rows)
    summary = {
        "dense_search_median_ms": dense_median * 1000,
        "rerank_median_s": rerank_median,
        "rerank_peer_median_s": peer_median,
        "rerank_over_dense": rerank_median / dense_median,
        "densekit_rerank_speed_over_peer": peer_median / rerank_median,
        "max_score_difference_to_peer": max(r["max_score_difference"] for r in rows),
    }
    print(json.dumps(summary, indent=2))
    result = {
        "command": "python -m benchmarks.rerank_cost "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "queries": rows,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
