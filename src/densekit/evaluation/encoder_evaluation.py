"""Evaluating an encoder held in memory: encode a corpus, search it exactly, score the run.

For evaluation inside a run (during training, in a benchmark script), where writing embedding and index
folders would only be thrown away.
"""

from __future__ import annotations

from collections.abc import Iterable

from densekit.data.records import Document, Qrels
from densekit.device import Precision
from densekit.evaluation.measures import evaluate
from densekit.models.encoder import DenseEncoder
from densekit.retrieval.memory_index import index_corpus
from densekit.retrieval.retriever import Retriever


def evaluate_encoder(
    encoder: DenseEncoder,
    documents: Iterable[Document],
    queries: dict[str, str],
    qrels: Qrels,
    measures: Iterable[str],
    batch_size: int = 64,
    precision: Precision = "float32",
    show_progress: bool = False,
) -> dict[str, float]:
    """Encode, search exactly and evaluate, all in memory."""
    index = index_corpus(encoder, documents, batch_size, precision, show_progress)
    run = Retriever(encoder, index).search_run(queries, 1000, batch_size, precision)
    return evaluate(qrels, run, measures)
