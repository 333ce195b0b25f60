"""Reranking a run's top documents with a cross-encoder."""

from __future__ import annotations

from collections.abc import Iterable

from densekit.data.records import Document, Run
from densekit.device import Precision
from densekit.errors import InputError
from densekit.models.cross_encoder import CrossEncoder
from densekit.progress import progress_bar


def ranked(documents: dict[str, float]) -> list[str]:
    """A query's documents best first; equal scores keep the run's order."""
    return sorted(documents, key=lambda doc: -documents[doc])


def merge_reranked(order: list[str], new_scores: list[float]) -> dict[str, float]:
    """`order` (a run's ranking) with its first `len(new_scores)` documents reordered by `new_scores`
    (equal scores keep the run's order) and given them; the rest follow in the run's order, scored
    below the lowest new score so that the ranking survives writing."""
    depth = len(new_scores)
    top = sorted(range(depth), key=lambda i: (-new_scores[i], i))
    merged = {order[i]: float(new_scores[i]) for i in top}
    floor = min(new_scores, default=0.0)
    for offset, doc in enumerate(order[depth:], start=1):
        merged[doc] = floor - offset
    return merged


def rerank_run(
    cross_encoder: CrossEncoder,
    run: Run,
    queries: dict[str, str],
    documents: Iterable[Document],
    depth: int = 100,
    batch_size: int = 32,
    show_progress: bool = True,
    precision: Precision = "float32",
) -> Run:
    """The run with each query's top `depth` documents reordered by the cross-encoder's scores (and
    scored by them); the documents below keep their order. Every pair of the run is scored in one
    length-ordered pass, at `precision`. A query of the run that `queries` lacks, or a document the
    corpus lacks, is an error."""
    if depth < 1:
        raise InputError(f"depth {depth}: rerank at least the first document")
    missing_queries = [q for q in run if q not in queries]
    if missing_queries:
        raise InputError(
            f"{len(missing_queries)} queries of the run are not in the split, e.g. {missing_queries[0]!r}"
        )
    orders = {query: ranked(scores) for query, scores in run.items()}
    wanted = {doc for order in orders.values() for doc in order[:depth]}
    texts = {d.id: d.full_text for d in documents if d.id in wanted}
    unknown = wanted - texts.keys()
    if unknown:
        raise InputError(
            f"{len(unknown)} documents of the run are not in the corpus, e.g. {sorted(unknown)[0]!r}"
        )
    pairs = [(queries[q], texts[doc]) for q, order in orders.items() for doc in order[:depth]]
    with progress_bar("reranking", len(pairs), show_progress) as advance:
        scores = cross_encoder.score(pairs, batch_size, advance, precision).tolist()
    reranked: Run = {}
    start = 0
    for query, order in orders.items():
        count = min(depth, len(order))
        reranked[query] = merge_reranked(order, scores[start : start + count])
        start += count
    return reranked
