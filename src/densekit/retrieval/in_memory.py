"""Exact dense retrieval held in memory: encode a corpus, search it, score the run.

For work inside a run (evaluation during training, mining) where writing embedding and index
folders would only be thrown away.
"""

from __future__ import annotations

from collections.abc import Iterable

from densekit.data.records import Document, Qrels
from densekit.encoding.device import Precision
from densekit.encoding.embed import embed_texts
from densekit.encoding.passages import MaxPSettings, PassageSplitter
from densekit.evaluation import evaluate
from densekit.index import SearchIndex
from densekit.models.encoder import DenseEncoder
from densekit.progress import progress_bar
from densekit.retrieval.retriever import Retriever


def index_corpus(
    encoder: DenseEncoder,
    documents: Iterable[Document],
    batch_size: int = 64,
    precision: Precision = "float32",
    show_progress: bool = True,
    maxp: MaxPSettings | None = None,
) -> SearchIndex:
    """A flat in-memory index of `documents` (or, with `maxp`, of their passages) encoded by `encoder`."""
    units = list(PassageSplitter(encoder, maxp).split_all(documents) if maxp is not None else documents)
    with progress_bar("encoding corpus", len(units), show_progress) as advance:
        vectors = embed_texts(
            encoder, [d.full_text for d in units], "passage", batch_size, precision, advance
        )
    return SearchIndex.from_vectors(vectors, [d.id for d in units], maxp=maxp)


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
