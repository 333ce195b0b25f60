"""`densekit mine`: training examples (a split's judgements, or an examples file such as pseudo-queries)
with negatives from a retriever."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import numpy as np

from densekit.data.dataset import Dataset
from densekit.data.examples import (
    EXAMPLES_KIND,
    TrainingExample,
    check_example_ids,
    examples_from_qrels,
    read_examples,
    write_examples,
)
from densekit.data.records import Run
from densekit.encoding.embed import embed_texts
from densekit.errors import InputError
from densekit.index import SearchIndex
from densekit.io.lock import holding
from densekit.io.outputs import check_file_output, command_identity, write_output_text
from densekit.mining.filters import MiningSettings, choose_negatives
from densekit.models.encoder import DenseEncoder
from densekit.progress import progress_bar
from densekit.retrieval.bm25 import BM25Index
from densekit.retrieval.dense import check_compatible
from densekit.retrieval.memory_index import index_corpus

log = logging.getLogger("densekit")

Source = Literal["bm25", "dense", "none"]
REPORT_KIND = "mining report"


def report_path(output: Path) -> Path:
    """Where the mining report of a training file goes."""
    return Path(f"{output}.report.json")


def write_report(
    output: Path, report: dict, inputs: list, identity: dict | None = None, overwrite: bool = False
) -> None:
    """Write the mining report beside the training file, recording `identity` (what made both)."""
    write_output_text(report_path(output), REPORT_KIND, json.dumps(report, indent=2) + "\n", identity, inputs,
                      overwrite)  # fmt: skip


def bm25_candidates(
    index: BM25Index, examples: list[TrainingExample], depth: int
) -> tuple[Run, dict[str, dict[str, float]]]:
    """BM25's top `depth` for each example's query, and the BM25 scores of its positives."""
    ranked = index.search({e.query_id: e.query for e in examples}, k=depth)
    positive_scores = {
        e.query_id: dict(zip(e.positives, index.scores_of(e.query, e.positives), strict=True))
        for e in examples
    }
    return ranked, positive_scores


def dense_ranking(
    encoder: DenseEncoder,
    index: SearchIndex,
    examples: list[TrainingExample],
    depth: int,
    batch_size: int = 64,
    show_progress: bool = True,
) -> tuple[Run, np.ndarray]:
    """The index's top `depth` for each example's query, and the queries' vectors."""
    check_compatible(encoder, index)
    with progress_bar("encoding queries", len(examples), show_progress) as advance:
        query_vectors = embed_texts(
            encoder, [e.query for e in examples], "query", batch_size, advance=advance
        )
    return index.search_run(query_vectors, [e.query_id for e in examples], depth), query_vectors


def dense_positive_scores(
    encoder: DenseEncoder,
    index: SearchIndex,
    examples: list[TrainingExample],
    query_vectors: np.ndarray,
    texts: Mapping[str, str],
    batch_size: int = 64,
) -> dict[str, dict[str, float]]:
    """The exact score under `encoder` of each example's positives (their `texts` encoded unless the
    index holds their vectors)."""
    positives = sorted({p for e in examples for p in e.positives})
    # a flat index holds the very vectors `encoder` makes of them (check_compatible): no encoding again
    positive_vectors = index.stored_vectors(positives)
    if positive_vectors is None:
        positive_vectors = embed_texts(encoder, [texts[p] for p in positives], "passage", batch_size)
    row = {doc_id: i for i, doc_id in enumerate(positives)}
    positive_scores = {}
    for i, example in enumerate(examples):
        scores = positive_vectors[[row[p] for p in example.positives]] @ query_vectors[i]
        positive_scores[example.query_id] = dict(
            zip(example.positives, np.asarray(scores).tolist(), strict=True)
        )
    return positive_scores


def dense_candidates(
    encoder: DenseEncoder,
    index: SearchIndex,
    texts: Mapping[str, str],
    examples: list[TrainingExample],
    depth: int,
    batch_size: int = 64,
    show_progress: bool = True,
) -> tuple[Run, dict[str, dict[str, float]]]:
    """The index's top `depth` for each query, and the exact scores of its positives under `encoder`."""
    ranked, query_vectors = dense_ranking(encoder, index, examples, depth, batch_size, show_progress)
    return ranked, dense_positive_scores(encoder, index, examples, query_vectors, texts, batch_size)


@holding("output")
def mine(
    dataset: Dataset,
    split: str,
    output: Path,
    source: Source,
    settings: MiningSettings,
    encoder: DenseEncoder | None = None,
    index_dir: Path | None = None,
    min_relevance: int = 1,
    batch_size: int = 64,
    show_progress: bool = True,
    domain: str | None = None,
    examples_file: Path | None = None,
    overwrite: bool = False,
) -> dict:
    """Write examples for `split` (or for the queries and positives of `examples_file`, whose negatives
    are replaced) to `output` atomically, with a report beside it; returns the report. Every example
    carries `domain` when given. Files mined with other settings or inputs are replaced only with
    `overwrite`.

    A saved index (`index_dir`) must have been built by `encoder` from this collection's corpus.
    """
    inputs = [dataset.root, *(p for p in (index_dir, examples_file) if p is not None)]
    if encoder is not None:
        inputs.append(encoder.source)
    chosen = {
        "split": None if examples_file is not None else split,
        "source": source,
        "mining": settings.model_dump(mode="json"),
        "min_relevance": min_relevance,
        "domain": domain,
    }
    identity = command_identity("mine", chosen, inputs)
    check_file_output(output, EXAMPLES_KIND, inputs, identity, overwrite)
    check_file_output(report_path(output), REPORT_KIND, inputs, identity, overwrite)
    if examples_file is not None:
        examples = _examples_to_mine(dataset, examples_file, domain)
    else:
        queries, qrels = dataset.split_queries(split)
        examples = examples_from_qrels(queries, qrels, min_relevance, domain)
    if source == "none":
        write_examples(output, examples, inputs, identity, overwrite)
        report = {"source": "none", "queries": len(examples), "negatives_written": 0}
        write_report(output, report, inputs, identity, overwrite)
        return report
    depth = settings.last_rank
    without_terms: list[str] = []
    # The corpus is streamed, never held: BM25 indexes it as it goes by, and only the texts the filters
    # compare (positives and the candidates in the rank range) are kept, read in one more pass.
    if source == "bm25":
        bm25 = BM25Index.of_dataset(dataset, show_progress=show_progress)
        ranked, positive_scores = bm25_candidates(bm25, examples, depth)
        without_terms = bm25.queries_without_terms
        texts = texts_of(dataset, compared_ids(examples, ranked, settings))
    elif source == "dense":
        if encoder is None:
            raise InputError("dense mining needs a model")
        if index_dir is not None:
            index = SearchIndex.load(index_dir)
            check_compatible(encoder, index, dataset)
        else:
            index = index_corpus(encoder, dataset.iter_corpus(), batch_size, show_progress=show_progress)
        ranked, query_vectors = dense_ranking(encoder, index, examples, depth, batch_size, show_progress)
        texts = texts_of(dataset, compared_ids(examples, ranked, settings))
        positive_scores = dense_positive_scores(encoder, index, examples, query_vectors, texts, batch_size)
    else:
        raise InputError(f"unknown source {source!r}: expected bm25, dense or none")
    mined, tally = choose_negatives(examples, ranked, positive_scores, texts, settings)
    tally.without_terms = without_terms
    write_examples(output, mined, inputs, identity, overwrite)
    report = tally.as_dict(settings, source)
    write_report(output, report, inputs, identity, overwrite)
    return report


def compared_ids(examples: list[TrainingExample], ranked: Run, settings: MiningSettings) -> set[str]:
    """The documents whose texts mining reads: every positive and each candidate in the rank range."""
    ids = {p for e in examples for p in e.positives}
    for example in examples:
        ids.update(list(ranked.get(example.query_id, {}))[settings.first_rank - 1 : settings.last_rank])
    return ids


def texts_of(dataset: Dataset, ids: set[str]) -> dict[str, str]:
    """The full texts of the documents `ids`, read in one pass over the corpus."""
    return {doc.id: doc.full_text for doc in dataset.iter_corpus() if doc.id in ids}


def _examples_to_mine(dataset: Dataset, path: Path, domain: str | None) -> list[TrainingExample]:
    """The examples of `path` without their negatives (and of `domain` when given), every positive
    checked against the corpus before any mining."""
    examples = read_examples(path, dataset.diagnostics)
    dataset.diagnostics.raise_if_errors()
    check_example_ids(path, examples, {doc.id for doc in dataset.iter_corpus()}, dataset.diagnostics)
    dataset.diagnostics.raise_if_errors()
    update = {"negatives": [], **({"domain": domain} if domain is not None else {})}
    return [example.model_copy(update=update) for example in examples]
