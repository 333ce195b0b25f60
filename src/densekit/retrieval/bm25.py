"""BM25 with bm25s over title + text.

The scoring is Lucene's BM25 (bm25s's default `method="lucene"`), with pyserini's BEIR parameters
(k1=0.9, b=0.4). The text processing is bm25s's, not Lucene's: bm25s's tokenizer (lower-cased,
words of two or more letters or digits by its regular expression `(?u)\\b\\w\\w+\\b`), its English
stop-word list, and the Snowball English stemmer from PyStemmer, where pyserini uses Lucene's
StandardAnalyzer, its stop words and the Porter stemmer. The figures agree closely, not exactly
(SciFact nDCG@10: 0.676 here, 0.679 in pyserini's reproduction matrix). Past the documents that
match a query, bm25s fills its `k` results with non-matching ones at score 0, where Lucene returns
fewer; densekit keeps that fill (mined negatives and the published figures here were made with it).
"""

from __future__ import annotations

import array
import contextlib
import gc
import itertools
import logging
from collections.abc import Iterable, Iterator

import bm25s
import numpy as np
import Stemmer
from pydantic import BaseModel, ConfigDict, Field

from densekit.data.dataset import Dataset
from densekit.data.hits import Hits
from densekit.data.records import Document, Run
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

_CHUNK = 1024  # queries retrieved between two advances of the progress bar
_INDEX_CHUNK = 8192  # documents tokenized at a time (bm25s stems each call's distinct words once)


class BM25Config(BaseModel):
    """BM25 parameters; the defaults are pyserini's BEIR settings."""

    model_config = ConfigDict(extra="forbid")

    k1: float = Field(0.9, ge=0, description="term-frequency saturation")
    b: float = Field(0.4, ge=0, le=1, description="length normalisation, 0 (none) to 1 (full)")
    stemmer: str | None = "english"
    stopwords: str | None = "en"


class BM25Index:
    """An in-memory bm25s index over a corpus.

    A query left with no term of the corpus's vocabulary once tokenized, stemmed and stripped of stop
    words (NFCorpus's `M&M's`) matches nothing: it gets no results, and `queries_without_terms` names
    it after a search.
    """

    def __init__(
        self,
        documents: Iterable[Document],
        config: BM25Config = BM25Config(),
        show_progress: bool = True,
        total: int | None = None,
    ):
        """Index `documents` as they stream by, `_INDEX_CHUNK` at a time; `total` (their number, when
        known) sizes the progress bar."""
        self.config = config
        self.stemmer = Stemmer.Stemmer(config.stemmer) if config.stemmer else None
        self.show_progress = show_progress
        self.queries_without_terms: list[str] = []
        ids: list[str] = []
        vocabulary: dict[str, int] = {}
        # Each document's terms as 4-byte ids into one vocabulary for the whole corpus, where the lists
        # of strings bm25s.tokenize can return take some 60 bytes a term (3.6 GiB at 1M passages).
        token_ids: list[array.array] = []
        with _without_cycle_collection():
            with progress_bar("BM25 indexing", total, show_progress) as advance:
                for chunk in _chunks(documents, _INDEX_CHUNK):
                    ids.extend(doc.id for doc in chunk)
                    token_ids.extend(self._numbered([doc.full_text for doc in chunk], vocabulary))
                    advance(len(chunk))
            self.ids = np.asarray(ids, dtype=object)
            self._row_of: dict[str, int] | None = None
            self.retriever = bm25s.BM25(k1=config.k1, b=config.b)
            # bm25s draws its own tqdm bars when asked; densekit draws its own instead, only when asked
            self.retriever.index((token_ids, vocabulary), show_progress=False)

    @classmethod
    def of_dataset(
        cls, dataset: Dataset, config: BM25Config = BM25Config(), show_progress: bool = True
    ) -> BM25Index:
        """Index `dataset`'s corpus, streamed (its documents counted first when a progress bar is shown)."""
        total = dataset.count_documents() if show_progress else None
        return cls(dataset.iter_corpus(), config, show_progress, total)

    def _numbered(self, texts: list[str], vocabulary: dict[str, int]) -> list[array.array]:
        """Each text's terms as ids into `vocabulary`, which gains the terms first seen here. bm25s
        numbers terms afresh at each call; its numbers are mapped onto the corpus's. Each document's
        ids are an `array.array` of 4-byte ints: bm25s counts them with `Counter` and sets, which get
        an array's items as Python ints at C speed (a numpy array's as numpy scalars, 1.7 times slower)."""
        config = self.config
        numbers, terms = bm25s.tokenize(
            texts, stopwords=config.stopwords, stemmer=self.stemmer, return_ids=True, show_progress=False
        )
        to_corpus = np.empty(len(terms), dtype=np.int32)
        for term, number in terms.items():
            to_corpus[number] = vocabulary.setdefault(term, len(vocabulary))
        lengths = [len(doc) for doc in numbers]
        every = np.fromiter(itertools.chain.from_iterable(numbers), dtype=np.intp, count=sum(lengths))
        ids = array.array("i", to_corpus[every].tobytes())
        ends = itertools.accumulate(lengths)
        return [ids[end - length : end] for end, length in zip(ends, lengths, strict=True)]

    def tokens(self, texts: list[str]) -> list[list[str]]:
        """Each text's terms: tokenized, stop words removed, stemmed."""
        config = self.config
        return bm25s.tokenize(
            texts, stopwords=config.stopwords, stemmer=self.stemmer, return_ids=False, show_progress=False
        )

    def query_terms(self, texts: list[str]) -> list[list[str]]:
        """Each query's terms that occur in the corpus."""
        vocabulary = self.retriever.vocab_dict
        return [[term for term in terms if term in vocabulary] for terms in self.tokens(texts)]

    def scores_of(self, query: str, doc_ids: list[str]) -> list[float]:
        """BM25 scores of the given documents for one query (0 for a query with no term)."""
        terms = self.query_terms([query])[0]
        if not terms:
            return [0.0] * len(doc_ids)
        scores = self.retriever.get_scores(terms)
        if self._row_of is None:  # only mining asks: a search needs no id's row
            self._row_of = {doc_id: row for row, doc_id in enumerate(self.ids)}
        return [float(scores[self._row_of[doc_id]]) for doc_id in doc_ids]

    def search(self, queries: dict[str, str], k: int = 1000, skip_self: bool = True) -> Run:
        """The top `k` documents for each query; a query with no term gets none (see the class)."""
        query_ids = list(queries)
        depth = min(k + 1 if skip_self else k, len(self.ids))
        run: Run = {}
        self.queries_without_terms = []
        with progress_bar("BM25 search", len(query_ids), self.show_progress) as advance:
            for start in range(0, len(query_ids), _CHUNK):
                chunk = query_ids[start : start + _CHUNK]
                terms = self.query_terms([queries[q] for q in chunk])
                empty = [q for q, query_terms in zip(chunk, terms, strict=True) if not query_terms]
                self.queries_without_terms.extend(empty)
                run.update({q: {} for q in empty})
                kept = [(q, t) for q, t in zip(chunk, terms, strict=True) if t]
                if kept:
                    rows, scores = self.retriever.retrieve(
                        [t for _, t in kept], k=depth, show_progress=False, n_threads=1
                    )
                    hits = Hits(scores, rows.astype(np.int64), self.ids)
                    run.update(hits.to_run([q for q, _ in kept], k, skip_self))
                advance(len(chunk))
        if self.queries_without_terms:
            shown = ", ".join(f"{q} ({queries[q]!r})" for q in self.queries_without_terms[:10])
            extra = len(self.queries_without_terms) - 10
            more = f" and {extra} more" if extra > 0 else ""
            log.warning(
                "%d queries have no term of the corpus once tokenized, stemmed and stripped of stop words, "
                "and get no BM25 results: %s%s", len(self.queries_without_terms), shown, more,
            )  # fmt: skip
        return {q: run[q] for q in query_ids}


@contextlib.contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, then restore it as it was: indexing makes millions of
    small objects that form no cycles, and each collection walks them all again (a 1M-passage build
    took 149 s with it, 119 s without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _chunks(documents: Iterable[Document], size: int) -> Iterator[list[Document]]:
    """`documents` in lists of `size` (the last shorter)."""
    chunk = []
    for document in documents:
        chunk.append(document)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
