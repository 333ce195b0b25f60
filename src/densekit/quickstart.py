"""The quickstart: BM25 and zero-shot all-MiniLM-L6-v2 on SciFact's test split, beside published figures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from densekit.data.dataset import Dataset
from densekit.data.trec import write_run
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.device import resolve_device
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation import evaluate
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.io.atomic import write_text_atomic
from densekit.models import DenseEncoder
from densekit.retrieval.bm25 import BM25Index
from densekit.retrieval.dense import dense_search

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SPLIT = "test"


@dataclass(frozen=True)
class Published:
    """A figure from the literature to set beside ours."""

    ndcg_at_10: float
    source: str


PUBLISHED = {
    "BM25": Published(0.679, "pyserini reproduction matrix, Lucene flat"),
    "all-MiniLM-L6-v2": Published(0.645, "MTEB"),
}


def default_data_dir() -> Path:
    """`../shared/data/scifact` beside the working folder or beside the project checkout."""
    checkout = Path(__file__).resolve().parents[2]
    candidates = [Path.cwd().parent / "shared/data/scifact", checkout.parent / "shared/data/scifact"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "SciFact not found at " + " or ".join(str(c) for c in candidates) + "; pass --data DIR"
    )


def run_quickstart(
    data_dir: Path, output: Path, batch_size: int = 64, device: str = "auto", show_progress: bool = True
) -> dict[str, dict[str, float]]:
    """Run both systems on the test split; write runs and `metrics.json` under `output`.

    The corpus embeddings are kept, so a second run (or one that was killed) does not encode again.
    """
    output = Path(output)
    dataset = Dataset.open(data_dir)
    queries, qrels = dataset.split_queries(SPLIT)
    metrics: dict[str, dict[str, float]] = {}

    bm25_run = BM25Index(dataset.iter_corpus(), show_progress=show_progress).search(queries, k=1000)
    write_run(output / "bm25.trec", bm25_run, tag="bm25")
    metrics["BM25"] = evaluate(qrels, bm25_run)

    encoder = DenseEncoder.load(MODEL).to(resolve_device(device))
    encode_corpus(encoder, dataset, output / "embeddings", batch_size=batch_size, show_progress=show_progress)
    build_index(
        EmbeddingStore.open(output / "embeddings"),
        IndexSpec(type="flat"),
        output / "index",
        show_progress=show_progress,
    )
    dense_run = dense_search(
        encoder,
        SearchIndex.load(output / "index"),
        queries,
        k=1000,
        batch_size=batch_size,
        show_progress=show_progress,
    )
    write_run(output / "all-MiniLM-L6-v2.trec", dense_run, tag="all-MiniLM-L6-v2")
    metrics["all-MiniLM-L6-v2"] = evaluate(qrels, dense_run)

    write_text_atomic(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return metrics
