"""Whole-folder checks, reporting every problem found in one pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from densekit.data.collection_files import check_intact
from densekit.data.dataset import Dataset
from densekit.data.trec import check_judged_ids
from densekit.diagnostics import DataError, Diagnostics, Problem, _TooManyErrors

T = TypeVar("T")


@dataclass
class ValidationReport:
    """What `validate_dataset` found, and counts of what it read."""

    problems: list[Problem]
    documents: int
    queries: int
    judgements: dict[str, int]

    @property
    def ok(self) -> bool:
        """True when no error (warnings allowed) was found."""
        return not any(p.severity == "error" for p in self.problems)


def validate_dataset(root: Path, splits: list[str] | None = None) -> ValidationReport:
    """Read every file of the collection at `root` and report all problems.

    `splits` names the judgement splits to check (all present ones by default); a named split that is
    missing is an error.
    """
    diagnostics = Diagnostics(collect=True)
    try:
        dataset = Dataset.open(root, diagnostics)
    except DataError as err:
        return ValidationReport(err.problems, 0, 0, {})
    # a damaged compressed file's lines are not what was written: its damage is the one problem told
    for path in dataset.fingerprint_files():
        _guarded(diagnostics, lambda path=path: check_intact(path))
    if diagnostics.problems:
        return ValidationReport(diagnostics.problems, 0, 0, {})

    doc_ids = _guarded(diagnostics, lambda: {doc.id for doc in dataset.iter_corpus()}) or set()
    chosen = splits or dataset.splits()
    if not chosen:
        diagnostics.error(dataset.root, None, "no relevance judgements (qrels) found")
    judged: dict[str, int] = {}
    query_count = 0
    for split in chosen:
        queries = _guarded(diagnostics, lambda split=split: dataset.queries(split)) or {}
        judgements = _guarded(diagnostics, lambda split=split: dataset.judgements(split)) or []
        query_count = max(query_count, len(queries))
        judged[split] = len(judgements)
        qrels_path = dataset.qrels_path(split)
        for known, field, source in (
            (queries, "query_id", dataset.queries_path(split)),
            (doc_ids, "doc_id", dataset.corpus_path),
        ):
            if known:
                check_judged_ids(qrels_path, judgements, known, field, source, diagnostics)
    return ValidationReport(list(dict.fromkeys(diagnostics.problems)), len(doc_ids), query_count, judged)


def _guarded(diagnostics: Diagnostics, step: Callable[[], T]) -> T | None:
    """Run one reading step; the errors that end it become recorded problems and it returns None."""
    try:
        return step()
    except DataError as err:
        diagnostics.problems.extend(err.problems)
    except _TooManyErrors:
        pass
    return None
