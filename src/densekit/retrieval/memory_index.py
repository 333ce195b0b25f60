"""Exact dense retrieval held in memory: a corpus encoded into an index that is never saved.

For work inside a run (evaluation during training, mining) where writing embedding and index
folders would only be thrown away; `densekit.evaluation.encoder_evaluation` scores its runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from densekit.data.records import Document
from densekit.device import Precision
from densekit.encoding.embed import embed_texts
from densekit.encoding.passages import MaxPSettings, PassageSplitter
from densekit.index import FaissIndex, SearchIndex
from densekit.models.encoder import DenseEncoder
from densekit.progress import progress_bar


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
    return FaissIndex.from_vectors(vectors, [d.id for d in units], maxp=maxp)
