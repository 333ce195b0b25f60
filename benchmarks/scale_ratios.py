"""densekit's index build and search against raw faiss, in one process, on the scale benchmark's vectors.

`benchmarks/scale.py` times each stage as a command, import and model loading included. This one takes
those out: for flat and IVF-PQ it times `build_index` (which also checks every part, computes checksums,
copies the ids and writes atomically) against raw faiss reading the same `.npy` whole, training on the
same number of sampled vectors and adding them all; then `SearchIndex.search` (and that turned into a
run) against `faiss.Index.search` on the same loaded index with the same parameters, at k = 10 and
1,000, in rounds whose order rotates. For BM25 it times `BM25Index.of_dataset` (the corpus streamed
from its file and checked) and its search into a run against bm25s reading the same texts whole,
indexing them and retrieving with the same settings. Speed is given as densekit's over the peer's
(1.0: as fast). Run from the repository root after `benchmarks/scale.py` at that size:

    nice -n 10 .venv/bin/python -m benchmarks.scale_ratios --size 1000000
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import bm25s
import faiss
import numpy as np
import Stemmer

from benchmarks import WORK
from benchmarks.machine import machine_info
from benchmarks.search_qps import compare_speed
from densekit.data import Dataset
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.index.backends.faiss_index import INDEX_FILE
from densekit.retrieval.bm25 import BM25Config, BM25Index

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("flat", "ivfpq", "bm25")


def raw_faiss_build(vectors_file: Path, spec: IndexSpec, sample_rows: int, output: Path) -> None:
    """What a user of faiss alone writes: read the vectors, train on a sample, add them all, write."""
    vectors = np.load(vectors_file)
    if spec.type == "flat":
        index = faiss.IndexFlatIP(vectors.shape[1])
    else:
        quantizer = faiss.IndexFlatIP(vectors.shape[1])
        index = faiss.IndexIVFPQ(
            quantizer, vectors.shape[1], spec.nlist, spec.pq_m, spec.pq_bits, faiss.METRIC_INNER_PRODUCT
        )
        index.do_polysemous_training = False
        sample = np.random.default_rng(0).choice(
            len(vectors), size=min(len(vectors), sample_rows), replace=False
        )
        index.train(vectors[np.sort(sample)])
    index.add(vectors)
    faiss.write_index(index, str(output))


def compare_builds(store: EmbeddingStore, spec: IndexSpec, rounds: int, scratch: Path) -> dict:
    """Seconds of densekit's build and raw faiss's, alternating, and their paired ratio."""
    (part,) = store.parts
    seconds: dict[str, list[float]] = {"faiss": [], "densekit": []}
    for number in range(rounds):
        for name in ("faiss", "densekit") if number % 2 == 0 else ("densekit", "faiss"):
            start = time.perf_counter()
            if name == "faiss":
                raw_faiss_build(part.stem.with_suffix(".npy"), spec, 256 * 1024, scratch / "raw.faiss")
            else:
                build_index(store, spec, scratch / f"densekit-{number}", show_progress=False)
            seconds[name].append(time.perf_counter() - start)
    ratio = statistics.median(f / d for f, d in zip(seconds["faiss"], seconds["densekit"], strict=True))
    return {
        "seconds": {k: [round(s, 2) for s in v] for k, v in seconds.items()},
        "speed_ratio": round(ratio, 3),
    }


def raw_bm25s(corpus_file: Path, queries: list[str], k: int) -> tuple[float, float]:
    """What a user of bm25s alone writes, densekit's settings: read the texts, tokenize and index them;
    then tokenize the queries and retrieve. Seconds of each."""
    start = time.perf_counter()
    texts = []
    with corpus_file.open(encoding="utf-8") as handle:
        for line in handle:
            document = json.loads(line)
            texts.append(f"{document.get('title', '')} {document['text']}".strip())
    config = BM25Config()
    stemmer = Stemmer.Stemmer(config.stemmer)
    retriever = bm25s.BM25(k1=config.k1, b=config.b)
    tokens = bm25s.tokenize(texts, stopwords=config.stopwords, stemmer=stemmer, show_progress=False)
    retriever.index(tokens, show_progress=False)
    built = time.perf_counter()
    tokens = bm25s.tokenize(queries, stopwords=config.stopwords, stemmer=stemmer, show_progress=False)
    retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
    return built - start, time.perf_counter() - built


def densekit_bm25(dataset: Dataset, queries: dict[str, str], k: int) -> tuple[float, float]:
    """densekit's BM25: the corpus streamed from its file and checked, indexed; the queries searched
    into a run. Seconds of each."""
    start = time.perf_counter()
    index = BM25Index.of_dataset(dataset, show_progress=False)
    built = time.perf_counter()
    index.search(queries, k)
    return built - start, time.perf_counter() - built


def compare_bm25(data: Path, rounds: int, k: int = 1000) -> dict:
    """BM25 index build and search, densekit's and bm25s's, alternating; their paired ratios."""
    dataset = Dataset.open(data)
    queries, _ = dataset.split_queries("test")
    seconds: dict[str, dict[str, list[float]]] = {"bm25s": {"build": [], "search": []}}
    seconds["densekit"] = {"build": [], "search": []}
    for number in range(rounds):
        for name in ("bm25s", "densekit") if number % 2 == 0 else ("densekit", "bm25s"):
            if name == "bm25s":
                build, search = raw_bm25s(data / "corpus.jsonl", list(queries.values()), k)
            else:
                build, search = densekit_bm25(dataset, queries, k)
            seconds[name]["build"].append(build)
            seconds[name]["search"].append(search)
            print(f"bm25 round {number}: {name} build {build:.1f} s, search {search:.1f} s", flush=True)
    ours, peer = seconds["densekit"], seconds["bm25s"]
    ratios = {
        phase: round(statistics.median(p / d for p, d in zip(peer[phase], ours[phase], strict=True)), 3)
        for phase in ("build", "search")
    }
    totals = [(pb + ps) / (db + ds) for pb, ps, db, ds in zip(*peer.values(), *ours.values(), strict=True)]
    return {
        "queries": len(queries),
        "k": k,
        "seconds": {
            name: {ph: [round(x, 2) for x in v] for ph, v in phases.items()}
            for name, phases in seconds.items()
        },
        "speed_ratio": ratios | {"build and search": round(statistics.median(totals), 3)},
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path, default=WORK / "scale")
    parser.add_argument(
        "--build-rounds", type=int, nargs=2, default=[3, 1], help="flat, ivfpq; 0: OUTPUT's kept"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bm25-rounds", type=int, default=3)
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS),
        help="measure only these indexes; the others' entries in OUTPUT are kept, marked `earlier_run` "
        "with the machine they ran on",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=WORK / "scale" / "scale_ratios.json")
    args = parser.parse_args()
    out = args.work / str(args.size) / "out"
    store = EmbeddingStore.open(out / "emb")
    queries = np.load(out / "queries.npy")
    query_ids = [f"q{i}" for i in range(len(queries))]
    results = {"passages": len(store), "queries": len(queries), "machine": machine_info(), "indexes": {}}
    earlier = json.loads(args.output.read_text()) if args.output.is_file() else {"indexes": {}}
    keeps = set(args.kinds) != set(KINDS) or 0 in args.build_rounds
    if keeps and earlier.get("passages", len(store)) != len(store):
        parser.error(f"{args.output} holds figures for {earlier['passages']} passages, not {len(store)}")
    for kind, build_rounds in zip(("flat", "ivfpq"), args.build_rounds, strict=True):
        if kind in args.kinds and not build_rounds and "build" not in earlier["indexes"].get(kind, {}):
            parser.error(f"--build-rounds 0 keeps {kind}'s build figures, but {args.output} has none")
    def kept(entry: dict) -> dict:
        """An earlier run's entry, marked as such with the machine it ran on (`machine` is this run's)."""
        return entry | {"earlier_run": True, "machine": entry.get("machine", earlier.get("machine"))}

    if set(args.kinds) != set(KINDS):
        results["indexes"] = {k: kept(v) for k, v in earlier["indexes"].items()}
        if "bm25" in earlier:
            results["bm25"] = kept(earlier["bm25"])
    for kind, build_rounds in zip(("flat", "ivfpq"), args.build_rounds, strict=True):
        if kind not in args.kinds:
            continue
        folder = out / f"index-{kind}"  # built by the scale run: its parameters are the automatic ones
        ours = SearchIndex.load(folder)
        with tempfile.TemporaryDirectory(dir=out) as scratch:
            row = {"spec": ours.spec.model_dump()}
            if build_rounds:
                row["build"] = compare_builds(store, ours.spec, build_rounds, Path(scratch))
            else:  # not built again: the earlier run's figures
                row["build"] = kept(earlier["indexes"][kind]["build"])
        raw = faiss.read_index(str(folder / INDEX_FILE))
        if kind == "ivfpq":
            faiss.ParameterSpace().set_index_parameter(raw, "nprobe", ours.spec.nprobe)
        for k in (10, 1000):
            row[f"search k={k}"] = compare_speed(raw, ours, queries, query_ids, k, args.rounds, 1)
        results["indexes"][kind] = row
        print(kind, json.dumps(row), flush=True)
    if "bm25" in args.kinds:
        results["bm25"] = compare_bm25(args.work / str(args.size) / "data", args.bm25_rounds)
        print("bm25", json.dumps(results["bm25"]), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
