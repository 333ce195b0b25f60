"""Encoding throughput: densekit's `encode` against sentence-transformers' `encode`, same run.

Both encode the same SciFact passages (title + text) with the same all-MiniLM-L6-v2 folder, the same
max length (256), batch size and precision, in alternating rounds; the ratio is densekit's median
passages per second over sentence-transformers'. Run from the repository root:

    .venv/bin/python -m benchmarks.encode_throughput --data ../shared/data/scifact --docs 500
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import EmbeddingStore
from densekit.models import DenseEncoder, resolve_model_path


def subset_collection(source: Path, docs: int, folder: Path) -> Path:
    """A BEIR folder holding the first `docs` documents of `source`'s corpus."""
    folder.mkdir(parents=True, exist_ok=True)
    with (source / "corpus.jsonl").open(encoding="utf-8") as src, (folder / "corpus.jsonl").open("w") as dst:
        for _, line in zip(range(docs), src, strict=False):
            dst.write(line)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--docs", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--output", type=Path, default=WORK / "encode_throughput.json"
    )
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    path = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Dataset.open(subset_collection(args.data, args.docs, Path(tmp) / "data"))
        texts = [doc.full_text for doc in dataset.iter_corpus()]
        encoder = DenseEncoder.load(path, passage_max_length=args.max_length)
        peer = SentenceTransformer(path, device="cpu")
        peer.max_seq_length = args.max_length

        def run_densekit(round_index: int) -> tuple[float, np.ndarray]:
            out = Path(tmp) / f"emb-{round_index}"
            start = time.perf_counter()
            encode_corpus(encoder, dataset, out, batch_size=args.batch_size, show_progress=False)
            elapsed = time.perf_counter() - start
            return elapsed, np.asarray(EmbeddingStore.open(out).vectors())

        def run_peer() -> tuple[float, np.ndarray]:
            start = time.perf_counter()
            vectors = peer.encode(
                texts, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False
            )
            return time.perf_counter() - start, vectors

        encode_corpus(encoder, Dataset.open(subset_collection(args.data, 64, Path(tmp) / "warm")),
                      Path(tmp) / "warm-emb", show_progress=False)  # fmt: skip
        peer.encode(texts[:64], batch_size=args.batch_size)

        ours, theirs = [], []
        for round_index in range(args.rounds):
            # alternate who goes first, so drift in the machine's speed falls on both alike
            if round_index % 2:
                seconds_peer, peer_vectors = run_peer()
                seconds_ours, our_vectors = run_densekit(round_index)
            else:
                seconds_ours, our_vectors = run_densekit(round_index)
                seconds_peer, peer_vectors = run_peer()
            ours.append(len(texts) / seconds_ours)
            theirs.append(len(texts) / seconds_peer)
            print(f"round {round_index}: densekit {ours[-1]:.1f}/s, sentence-transformers {theirs[-1]:.1f}/s")

    result = {
        "benchmark": "encode_throughput",
        "model": args.model,
        "passages": len(texts),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "precision": "float32",
        "densekit_passages_per_s": [round(x, 2) for x in ours],
        "sentence_transformers_passages_per_s": [round(x, 2) for x in theirs],
        "ratio_of_medians": round(statistics.median(ours) / statistics.median(theirs), 3),
        "median_of_paired_ratios": round(
            statistics.median(o / t for o, t in zip(ours, theirs, strict=True)), 3
        ),
        "max_abs_difference": float(np.max(np.abs(our_vectors - peer_vectors))),
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("ratio_of_medians", "median_of_paired_ratios", "max_abs_difference")}
        )
    )


if __name__ == "__main__":
    main()
