"""densekit's index build and search against raw faiss, in one process, on the scale benchmark's vectors.

`benchmarks/scale.py` times each stage as a command, import and model loading included. This one takes
those out: for flat and IVF-PQ it times `build_index` (which also checks every part, computes checksums,
copies the ids and writes atomically) against raw faiss reading the same `.npy` whole, training on the
same number of sampled vectors and adding them all; then `SearchIndex.search` (and that turned into a
run) against `faiss.Index.search` on the same loaded index with the same parameters, at k = 10 and
1,000, in rounds whose order rotates. Speed is given as densekit's over the peer's (1.0: as fast). Run
from the repository root after `benchmarks/scale.py` at that size:

    nice -n 10 .venv/bin/python -m benchmarks.scale_ratios --size 1000000 --work /work/runs/scale
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

from benchmarks.machine import machine_info
from benchmarks.search_qps import compare_speed
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.index.faiss_index import INDEX_FILE

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path, default=Path("/work/runs/scale"))
    parser.add_argument(
        "--build-rounds", type=int, nargs=2, default=[3, 1], help="flat, ivfpq; 0: OUTPUT's kept"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--kinds", nargs="+", choices=("flat", "ivfpq"), default=["flat", "ivfpq"],
        help="measure only these indexes; the others' entries in OUTPUT are kept, marked `earlier_run`",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "scale_ratios.json")
    args = parser.parse_args()
    out = args.work / str(args.size) / "out"
    store = EmbeddingStore.open(out / "emb")
    queries = np.load(out / "queries.npy")
    query_ids = [f"q{i}" for i in range(len(queries))]
    results = {"passages": len(store), "queries": len(queries), "machine": machine_info(), "indexes": {}}
    if set(args.kinds) != {"flat", "ivfpq"} and args.output.is_file():
        earlier = json.loads(args.output.read_text())
        results["indexes"] = {k: {**v, "earlier_run": True} for k, v in earlier["indexes"].items()}
    for kind, build_rounds in zip(("flat", "ivfpq"), args.build_rounds, strict=True):
        if kind not in args.kinds:
            continue
        folder = out / f"index-{kind}"  # built by the scale run: its parameters are the automatic ones
        ours = SearchIndex.load(folder)
        with tempfile.TemporaryDirectory(dir=out) as scratch:
            row = {"spec": ours.spec.model_dump()}
            if build_rounds:
                row["build"] = compare_builds(store, ours.spec, build_rounds, Path(scratch))
            elif kind in results["indexes"]:  # not built again: the earlier run's figures
                row["build"] = results["indexes"][kind]["build"] | {"earlier_run": True}
        raw = faiss.read_index(str(folder / INDEX_FILE))
        if kind == "ivfpq":
            faiss.ParameterSpace().set_index_parameter(raw, "nprobe", ours.spec.nprobe)
        for k in (10, 1000):
            row[f"search k={k}"] = compare_speed(raw, ours, queries, query_ids, k, args.rounds, 1)
        results["indexes"][kind] = row
        print(kind, json.dumps(row), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
