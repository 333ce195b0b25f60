"""BM25 with bm25s: title + text, English stemming and stop words, Lucene's scoring."""

from __future__ import annotations

from collections.abc import Iterable

import bm25s
import numpy as np
import Stemmer
from pydantic import BaseModel, ConfigDict

from densekit.data.records import Document, Run
from densekit.retrieval.hits import Hits


class BM25Config(BaseModel):
    """BM25 parameters; the defaults are pyserini's BEIR settings."""

    model_config = ConfigDict(extra="forbid")

    k1: float = 0.9
    b: float = 0.4
    stemmer: str | None = "english"
    stopwords: str | None = "en"


class BM25Index:
    """An in-memory bm25s index over a corpus."""

    def __init__(
        self, documents: Iterable[Document], config: BM25Config = BM25Config(), show_progress: bool = True
    ):
        self.config = config
        self.stemmer = Stemmer.Stemmer(config.stemmer) if config.stemmer else None
        self.show_progress = show_progress
        texts, ids = [], []
        for doc in documents:
            ids.append(doc.id)
            texts.append(doc.full_text)
        self.ids = np.asarray(ids, dtype=object)
        self.retriever = bm25s.BM25(k1=config.k1, b=config.b)
        self.retriever.index(self._tokenize(texts), show_progress=show_progress)

    def _tokenize(self, texts: list[str]) -> bm25s.tokenization.Tokenized:
        return bm25s.tokenize(
            texts, stopwords=self.config.stopwords, stemmer=self.stemmer, show_progress=self.show_progress
        )

    def scores_of(self, query: str, doc_ids: list[str]) -> list[float]:
        """BM25 scores of the given documents for one query."""
        if not hasattr(self, "_rows"):
            self._rows = {doc_id: row for row, doc_id in enumerate(self.ids)}
        tokens = bm25s.tokenize([query], stopwords=self.config.stopwords, stemmer=self.stemmer,
                                return_ids=False, show_progress=False)[0]  # fmt: skip
        scores = self.retriever.get_scores(tokens)
        return [float(scores[self._rows[doc_id]]) for doc_id in doc_ids]

    def search(self, queries: dict[str, str], k: int = 1000, skip_self: bool = True) -> Run:
        """The top `k` documents for each query."""
        query_ids = list(queries)
        if not query_ids:
            return {}
        depth = min(k + 1 if skip_self else k, len(self.ids))
        tokens = self._tokenize([queries[q] for q in query_ids])
        rows, scores = self.retriever.retrieve(tokens, k=depth, show_progress=self.show_progress)
        return Hits(scores, rows.astype(np.int64), self.ids).to_run(query_ids, k, skip_self)
