"""Dense retrieval: encode queries, search the index."""

from __future__ import annotations

import logging

from densekit.data.records import Run
from densekit.encoding.device import Precision
from densekit.encoding.embed import embed_texts
from densekit.index.faiss_index import SearchIndex
from densekit.models.encoder import DenseEncoder
from densekit.progress import progress_bar

log = logging.getLogger("densekit")


def check_compatible(encoder: DenseEncoder, index: SearchIndex) -> None:
    """Fail when the encoder cannot search the index; warn when it is not the one that built it."""
    if encoder.dimension != index.dimension:
        raise ValueError(
            f"the encoder makes {encoder.dimension}-dimensional vectors; {index.folder} holds "
            f"{index.dimension}-dimensional ones"
        )
    built_with = index.meta.get("embeddings", {})
    if built_with.get("encoder_config", {}).get("normalize") not in (None, encoder.config.normalize):
        log.warning(
            "the index was built from %snormalised embeddings; the queries are %snormalised",
            "" if built_with["encoder_config"]["normalize"] else "un",
            "" if encoder.config.normalize else "un",
        )
    if built_with.get("model") not in (None, encoder.source):
        log.warning(
            "the index was built with %s, the queries use %s", built_with.get("model"), encoder.source
        )


def dense_search(
    encoder: DenseEncoder,
    index: SearchIndex,
    queries: dict[str, str],
    k: int = 1000,
    batch_size: int = 64,
    precision: Precision = "float32",
    skip_self: bool = True,
    show_progress: bool = True,
) -> Run:
    """The top `k` documents of `index` for each query."""
    check_compatible(encoder, index)
    query_ids = list(queries)
    with progress_bar("encoding queries", len(query_ids), show_progress) as advance:
        vectors = embed_texts(
            encoder, [queries[q] for q in query_ids], "query", batch_size, precision, advance
        )
    return index.search_run(vectors, query_ids, k, skip_self)
