"""ANCE's diagnostic of training negatives: how many of them the model itself ranks in its dense top k
(ANCE: about 15% of BM25 negatives, against 63% rising to 100% of its own), and how far below the
positive the model scores them. Negatives the model already pushes far down teach it little."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from densekit.data.examples import TrainingExample, read_examples
from densekit.diagnostics import DataError, Diagnostics, Problem
from densekit.encoding.embed import embed_texts
from densekit.index.base import SearchIndex
from densekit.models.encoder import DenseEncoder
from densekit.plots import pyplot, save_png
from densekit.progress import progress_bar
from densekit.retrieval.dense import check_compatible


@dataclass(frozen=True)
class NegativesReport:
    """One examples file against one model's index."""

    name: str
    examples: int
    negatives: int
    depth: int
    in_top_k: int
    share_in_top_k: float
    mean_margin: float

    def to_json(self) -> dict:
        """The report as JSON."""
        return asdict(self)


def diagnose_negatives(
    examples_file: Path,
    encoder: DenseEncoder,
    index: SearchIndex,
    depth: int = 200,
    batch_size: int = 64,
    show_progress: bool = False,
) -> NegativesReport:
    """For every negative of `examples_file`: whether it is in the dense top `depth` of its query, and
    the model's score of the query's best positive minus the negative's score (both from the index's
    vectors; a MaxP document scores its best passage). The share counts every negative once; the
    margin is their mean."""
    check_compatible(encoder, index)
    examples = read_examples(examples_file, Diagnostics())
    rows = _rows_of_documents(index)
    _check_known(examples, rows, examples_file, index.folder)
    with progress_bar("encoding queries", len(examples), show_progress) as advance:
        queries = embed_texts(encoder, [e.query for e in examples], "query", batch_size, "float32", advance)
    keys = [str(i) for i in range(len(examples))]  # an example's query id may repeat in a file
    top = index.search_run(queries, keys, depth, skip_self=False)
    stored = _stored_vectors(index)
    negatives = in_top = 0
    margins: list[float] = []
    for key, example, query in zip(keys, examples, queries, strict=True):
        if not example.negatives:
            continue
        positive = max(_score(stored, rows[doc], query) for doc in example.positives)
        for doc in example.negatives:
            negatives += 1
            in_top += doc in top[key]
            margins.append(positive - _score(stored, rows[doc], query))
    return NegativesReport(
        name=str(examples_file),
        examples=len(examples),
        negatives=negatives,
        depth=depth,
        in_top_k=in_top,
        share_in_top_k=in_top / negatives if negatives else 0.0,
        mean_margin=float(np.mean(margins)) if margins else 0.0,
    )


def _rows_of_documents(index: SearchIndex) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {}
    for row, doc in enumerate(index.ids):
        rows.setdefault(str(doc), []).append(row)
    return rows


def _check_known(examples: list[TrainingExample], rows: dict, source: Path, index_folder: Path) -> None:
    problems = []
    for line, example in enumerate(examples, start=1):
        unknown = [d for d in (*example.positives, *example.negatives) if d not in rows]
        if unknown:
            problems.append(
                Problem(source, line, f"document {unknown[0]!r} is not in the index {index_folder}")
            )
    if problems:
        raise DataError(problems)


def _stored_vectors(index: SearchIndex) -> faiss.Index:
    """The index, able to give back its vectors by row (an IVF index needs its direct map for that;
    a PQ index gives its compressed approximation)."""
    try:
        ivf = faiss.extract_index_ivf(index.index)
    except RuntimeError:
        return index.index
    ivf.make_direct_map()
    return index.index


def _score(stored: faiss.Index, rows: list[int], query: np.ndarray) -> float:
    vectors = stored.reconstruct_batch(np.asarray(rows, dtype=np.int64))
    return float((vectors @ query).max())


def plot_negatives(
    reports: list[NegativesReport], output: Path, record: bool = False, identity: dict | None = None
) -> Path:
    """The share in the dense top k and the mean margin, one point per examples file, in order;
    `record` and `identity`: see `save_png`."""
    plt = pyplot()

    figure, (share_axis, margin_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    x = np.arange(len(reports))
    share_axis.plot(x, [100 * r.share_in_top_k for r in reports], marker="o")
    share_axis.set_ylabel(f"% in the dense top {reports[0].depth}")
    share_axis.set_ylim(0, 100)
    margin_axis.plot(x, [r.mean_margin for r in reports], marker="o", color="tab:orange")
    margin_axis.set_ylabel("mean margin, positive minus negative")
    labels = [_plot_label(r.name) for r in reports]
    for axis in (share_axis, margin_axis):
        axis.set_xticks(x, labels, rotation=25, ha="right", fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle("training negatives against the model's own dense ranking", fontsize=10)
    return save_png(figure, output, record, identity)


def _plot_label(name: str) -> str:
    """An examples file's name as a tick label: without `.jsonl`, an ANCE version by its folder
    (`version-000001`), one line per folder."""
    return name.removesuffix(".jsonl").removesuffix("/examples").replace("/", "/\n")
