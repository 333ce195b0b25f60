"""Training examples made from a corpus alone, for collections without relevance labels.

Each pseudo-query comes from one document, which is its one positive:

- `span`: a random crop of `min_words` to `max_words` consecutive words of the document's text (the
  cropping of coCondenser and Contriever; words without a letter or digit are left out); a document of
  no more than `min_words` words gives none.
- `title`: the document's title (documents without one give none);
- `lead`: the first sentence of the text, when the text holds more than that sentence;
- `keywords`: `min_words` to `max_words` distinct words of the text, drawn without replacement with
  chances in proportion to tf-idf and put in the order they first occur (PROP's representative words,
  Ma et al. 2021): a keyword query, for collections whose users search that way. Words are lower-cased
  runs of two or more letters and digits starting with a letter, English stop words left out (the list
  BM25 uses); a word in every document has no weight. A document of no more than `min_words` such
  words gives none.

A document whose pseudo-query would be its whole passage (a title equal to the text, a one-sentence
text) gives none. The examples are the training format (`densekit.data.examples`), without negatives:
`densekit mine --examples` adds them. Everything depends only on (seed, document position), so the same
corpus and settings give the same file. The examples are written as they are drawn, never held, and a
document gives at most `MAX_PER_DOCUMENT` queries.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from bm25s.stopwords import STOPWORDS_EN
from pydantic import BaseModel, ConfigDict, Field, model_validator

from densekit.data.dataset import Dataset
from densekit.data.examples import EXAMPLES_KIND, TrainingExample, write_examples
from densekit.data.records import Document
from densekit.errors import InputError
from densekit.io.outputs import check_file_output, write_output_text
from densekit.limits import MAX_PER_DOCUMENT

PseudoQueryMethod = Literal["span", "title", "lead", "keywords"]
REPORT_KIND = "pseudo-query report"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")
_KEYWORD = re.compile(r"[^\W\d_]\w+")
_STOP_WORDS = frozenset(STOPWORDS_EN)
_PER_DOCUMENT = ("span", "keywords")


class PseudoQuerySettings(BaseModel):
    """How pseudo-queries are drawn from a corpus."""

    model_config = ConfigDict(extra="forbid")

    method: PseudoQueryMethod = "span"
    per_document: int = Field(
        1, ge=1, le=MAX_PER_DOCUMENT,
        description="span and keywords: queries per document (title and lead give one)",
    )  # fmt: skip
    min_words: int = Field(8, ge=1, description="span and keywords: the shortest query, in words")
    max_words: int = Field(24, ge=1, description="span and keywords: the longest query, in words")
    max_documents: int | None = Field(
        None, ge=1, description="draw from this many documents, chosen at random (default: every one)"
    )
    seed: int = 0
    domain: str | None = Field(None, min_length=1, description="written into every example (routing)")

    @model_validator(mode="after")
    def _crop_range(self) -> PseudoQuerySettings:
        if self.min_words > self.max_words:
            raise ValueError(f"{self.method} length {self.min_words}-{self.max_words} words is empty")
        if self.method not in _PER_DOCUMENT and self.per_document != 1:
            raise ValueError(
                f"method {self.method!r} gives one query per document; per_document is for span and keywords"
            )
        return self


@dataclass
class PseudoQueryReport:
    """What the documents gave: queries written, and each reason a document gave none."""

    documents: int = 0
    queries: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        """Count one document that gave no query, for `reason`."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _words(text: str) -> list[str]:
    return text.split()


def _span_words(text: str) -> list[str]:
    """The words a span is cropped from: those holding a letter or digit (a run of lone dots or dashes,
    common in abstracts' tables, would otherwise make a query with no term)."""
    return [word for word in text.split() if any(ch.isalnum() for ch in word)]


def _span_queries(document: Document, rng: np.random.Generator, settings: PseudoQuerySettings) -> list[str]:
    words = _span_words(document.text or document.title)
    if len(words) <= settings.min_words:  # the shortest crop would be the whole text
        return []
    queries = []
    for _ in range(settings.per_document):
        # never the whole text: a crop as long as it would be its passage, not a query for it
        length = int(rng.integers(settings.min_words, min(settings.max_words, len(words) - 1) + 1))
        start = int(rng.integers(0, len(words) - length + 1))
        queries.append(" ".join(words[start : start + length]))
    return queries


def keywords_of(text: str) -> list[str]:
    """The words a keyword query is drawn from, in text order (repeats kept): lower-cased, starting
    with a letter, not a stop word."""
    return [word for word in _KEYWORD.findall(text.lower()) if word not in _STOP_WORDS]


@dataclass
class WordStatistics:
    """How many documents of a corpus hold each keyword, for the tf-idf weights of `keywords`."""

    documents: int
    document_frequency: Counter

    @classmethod
    def of(cls, documents: Iterable[Document]) -> WordStatistics:
        """Count over `documents` (streamed once)."""
        frequency: Counter = Counter()
        count = 0
        for document in documents:
            frequency.update(set(keywords_of(document.text or document.title)))
            count += 1
        return cls(count, frequency)

    def idf(self, word: str) -> float:
        """log(N / df): 0 for a word in every document."""
        return math.log(self.documents / self.document_frequency[word])


def _keyword_queries(
    document: Document, rng: np.random.Generator, settings: PseudoQuerySettings, statistics: WordStatistics
) -> list[str]:
    words = keywords_of(document.text or document.title)
    counts = Counter(words)
    weights = np.array([n * statistics.idf(word) for word, n in counts.items()])
    candidates = [word for word, weight in zip(counts, weights, strict=True) if weight > 0]
    weights = weights[weights > 0]
    # never every weighted word: that would be the document's whole vocabulary, not a query for it
    if len(candidates) <= settings.min_words:
        return []
    first_seen: dict[str, int] = {}
    for position, word in enumerate(words):
        first_seen.setdefault(word, position)
    queries = []
    for _ in range(settings.per_document):
        length = int(rng.integers(settings.min_words, min(settings.max_words, len(candidates) - 1) + 1))
        chosen = rng.choice(len(candidates), length, replace=False, p=weights / weights.sum())
        queries.append(" ".join(sorted((candidates[i] for i in chosen), key=first_seen.__getitem__)))
    return queries


def _one_query(document: Document, method: PseudoQueryMethod) -> tuple[str | None, str]:
    """The title or lead query of `document`, or None and why not."""
    if method == "title":
        title = " ".join(_words(document.title))
        if not title:
            return None, "no title"
        if title == " ".join(_words(document.text)) or not document.text.strip():
            return None, "title is the whole passage"
        return title, ""
    sentences = _SENTENCE_END.split(document.text.strip(), maxsplit=1)
    if not sentences[0]:
        return None, "empty text"
    if len(sentences) < 2:
        return None, "one sentence only"
    return " ".join(_words(sentences[0])), ""


def pseudo_queries(
    documents: Iterable[Document],
    settings: PseudoQuerySettings,
    report: PseudoQueryReport | None = None,
    count: int | None = None,
    statistics: WordStatistics | None = None,
) -> Iterator[TrainingExample]:
    """The pseudo-queries of `documents` as training examples, counted into `report` when given.

    The documents are streamed; drawing `settings.max_documents` of them needs their `count`, and
    `keywords` needs the corpus's word `statistics` (counted here when `documents` is a list).
    """
    report = report if report is not None else PseudoQueryReport()
    if settings.method == "keywords" and statistics is None:
        if not isinstance(documents, list):
            raise InputError("keywords from streamed documents needs the corpus's WordStatistics")
        statistics = WordStatistics.of(documents)
    chosen: set[int] | None = None
    if settings.max_documents is not None:
        if count is None:
            documents = list(documents)
            count = len(documents)
        if settings.max_documents < count:
            rng = np.random.default_rng([settings.seed])
            chosen = {int(i) for i in rng.choice(count, settings.max_documents, replace=False)}
    for position, document in enumerate(documents):
        if chosen is not None and position not in chosen:
            continue
        report.documents += 1
        if settings.method == "span":
            texts = _span_queries(document, np.random.default_rng([settings.seed, position]), settings)
            why = f"fewer than {settings.min_words + 1} words"
        elif settings.method == "keywords":
            rng = np.random.default_rng([settings.seed, position])
            texts = _keyword_queries(document, rng, settings, statistics)  # type: ignore[arg-type]
            why = f"fewer than {settings.min_words + 1} keywords"
        else:
            text, why = _one_query(document, settings.method)
            texts = [text] if text else []
        if not texts:
            report.skip(why)
        for number, text in enumerate(texts):
            report.queries += 1
            yield TrainingExample(
                query_id=f"{document.id}#{settings.method}{number}",
                query=text,
                positives=[document.id],
                domain=settings.domain,
            )


def report_path(output: Path) -> Path:
    """Where the report of a pseudo-query file goes."""
    return Path(f"{output}.report.json")


def write_pseudo_queries(
    dataset: Dataset, settings: PseudoQuerySettings, output: Path, overwrite: bool = False
) -> dict:
    """Write the pseudo-queries of `dataset`'s corpus to `output` atomically, as they are drawn, with a
    report beside it (queries written, documents without one and why); returns the report. Files made
    from other settings or another corpus are replaced only with `overwrite`."""
    inputs = [dataset.root]
    identity = {"pseudo_queries": settings.model_dump(), "corpus": dataset.corpus_digest()}
    check_file_output(output, EXAMPLES_KIND, inputs, identity, overwrite)
    check_file_output(report_path(output), REPORT_KIND, inputs, identity, overwrite)
    report = PseudoQueryReport()
    statistics = WordStatistics.of(dataset.iter_corpus()) if settings.method == "keywords" else None
    # the statistics' pass counted the documents already
    count = statistics.documents if statistics is not None else dataset.count_documents()
    examples = pseudo_queries(dataset.iter_corpus(), settings, report, count, statistics)
    write_examples(output, _some(examples, dataset, settings, report), inputs, identity, overwrite)
    summary = {
        "settings": settings.model_dump(),
        "documents": report.documents,
        "queries": report.queries,
        "documents_without_query": report.skipped,
    }
    write_output_text(
        report_path(output), REPORT_KIND, json.dumps(summary, indent=2) + "\n", identity, inputs, overwrite
    )
    return summary


def _some(
    examples: Iterator[TrainingExample],
    dataset: Dataset,
    settings: PseudoQuerySettings,
    report: PseudoQueryReport,
) -> Iterator[TrainingExample]:
    """`examples` as they come; raises at their end when there was none (inside the atomic write, so
    nothing is written)."""
    yield from examples
    if not report.queries:
        raise InputError(
            f"{dataset.corpus_path}: no document gives a {settings.method!r} pseudo-query "
            f"({', '.join(f'{n} {why}' for why, n in report.skipped.items())})"
        )
