"""Search speed against raw Faiss on the same index, and what the approximate indexes give up.

For each index type (flat, hnsw, ivfpq) built by `densekit index` from SciFact's all-MiniLM-L6-v2
embeddings, this times densekit's search (`SearchIndex.search`, and that plus turning hits into a run)
against `faiss.Index.search` on the same loaded index with the same parameters, in alternating
rounds, over SciFact's 1,109 queries, all in one call. The flat index is also timed a few queries a call
(1, 16 and 32, as the service's two workers search) on one thread, as a worker searches. It also
reports recall@100 against the flat index, nDCG@10 on the test split, and each index's size. Run from
the repository root:

    .venv/bin/python -m benchmarks.search_qps --data ../shared/data/scifact
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation import evaluate
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.index.backends.faiss_index import INDEX_FILE
from densekit.models import DenseEncoder


def timed(function, repeats: int) -> float:
    """Best seconds of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def compare_speed(
    raw: faiss.Index,
    ours: SearchIndex,
    vectors: np.ndarray,
    query_ids: list[str],
    k: int,
    rounds: int,
    repeats: int,
    batch: int | None = None,
) -> dict:
    """Queries per second of raw Faiss, densekit's search, and densekit's search turned into a run,
    all queries in one call, or `batch` a call."""
    step = batch or len(vectors)
    parts = [
        (vectors[first : first + step], query_ids[first : first + step])
        for first in range(0, len(vectors), step)
    ]
    contenders = {
        "faiss": lambda: [raw.search(part, k) for part, _ in parts],
        "densekit_search": lambda: [ours.search(part, k) for part, _ in parts],
        "densekit_search_and_run": lambda: [ours.search(part, k + 1).to_run(ids, k) for part, ids in parts],
    }
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        # rotate the order each round, so drift in the machine's speed falls on all alike
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            seconds[name].append(timed(contenders[name], repeats))
    qps = {name: len(query_ids) / statistics.median(times) for name, times in seconds.items()}

    def paired(name: str) -> float:
        return statistics.median(f / d for f, d in zip(seconds["faiss"], seconds[name], strict=True))

    return {
        **{f"{name}_qps": round(value, 1) for name, value in qps.items()},
        "ratio_search": round(paired("densekit_search"), 3),
        "ratio_search_and_run": round(paired("densekit_search_and_run"), 3),
    }


def few_a_call(
    raw: faiss.Index, ours: SearchIndex, vectors: np.ndarray, query_ids: list[str], rounds: int, repeats: int
) -> dict:
    """`compare_speed` at k=10 with 1, 16 and 32 queries a call, faiss and torch on one thread each."""
    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    try:
        return {f"batch={batch}": compare_speed(raw, ours, vectors, query_ids, 10, rounds, repeats, batch)
                for batch in (1, 16, 32)}  # fmt: skip
    finally:
        torch.set_num_threads(threads[0])
        faiss.omp_set_num_threads(threads[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--embeddings", type=Path, help="an existing `densekit encode` folder of the corpus")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=WORK / "search_qps.json")
    args = parser.parse_args()

    dataset = Dataset.open(args.data)
    encoder = DenseEncoder.load(args.model)
    all_queries = dataset.queries()
    test_queries, qrels = dataset.split_queries("test")
    query_ids = list(all_queries)
    vectors = embed_texts(encoder, [all_queries[q] for q in query_ids], "query")
    test_ids = list(test_queries)
    test_vectors = vectors[[query_ids.index(q) for q in test_ids]]

    with tempfile.TemporaryDirectory() as tmp:
        embeddings = args.embeddings
        if embeddings is None:
            embeddings = Path(tmp) / "emb"
            encode_corpus(encoder, dataset, embeddings)
        store = EmbeddingStore.open(embeddings)
        results = {}
        flat_top100 = None
        for spec in (IndexSpec(type="flat"), IndexSpec(type="hnsw"), IndexSpec(type="ivfpq")):
            folder = Path(tmp) / spec.type
            build_start = time.perf_counter()
            build_index(store, spec, folder, show_progress=False)
            build_seconds = time.perf_counter() - build_start
            ours = SearchIndex.load(folder)
            raw = faiss.read_index(str(folder / INDEX_FILE))
            ours.set_search_parameters()
            if spec.type == "hnsw":
                faiss.ParameterSpace().set_index_parameter(raw, "efSearch", ours.spec.ef_search)
            elif spec.type == "ivfpq":
                faiss.ParameterSpace().set_index_parameter(raw, "nprobe", ours.spec.nprobe)
            row = {"spec": ours.spec.model_dump(), "build_seconds": round(build_seconds, 2),
                   "index_bytes": (folder / INDEX_FILE).stat().st_size}  # fmt: skip
            row["bytes_per_vector"] = round(row["index_bytes"] / len(store), 1)
            for k in (10, 1000):
                if spec.type == "hnsw":  # as densekit searches: at least k candidates, so k results come back
                    faiss.ParameterSpace().set_index_parameter(raw, "efSearch", max(ours.spec.ef_search, k))
                row[f"k={k}"] = compare_speed(raw, ours, vectors, query_ids, k, args.rounds, args.repeats)
            if spec.type == "flat":
                row["one_thread_k=10"] = few_a_call(raw, ours, vectors, query_ids, args.rounds, args.repeats)
            top100 = ours.search(test_vectors, 100).labels
            if flat_top100 is None:
                flat_top100 = top100
            row["recall@100_vs_flat"] = round(
                float(
                    np.mean([len(set(a) & set(b)) / 100 for a, b in zip(top100, flat_top100, strict=True)])
                ),
                4,
            )
            run = ours.search(test_vectors, 1001).to_run(test_ids, 1000)
            row["nDCG@10"] = round(evaluate(qrels, run, ["nDCG@10"])["nDCG@10"], 4)
            results[spec.type] = row
            print(spec.type, json.dumps(row))

    output = {
        "benchmark": "search_qps",
        "model": args.model,
        "documents": len(store),
        "queries": len(query_ids),
        "indexes": results,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")


if __name__ == "__main__":
    main()
