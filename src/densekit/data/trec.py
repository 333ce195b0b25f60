"""Relevance judgements (BEIR's three-column TSV or TREC's four-column form) and TREC run files."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

from densekit.data.lines import iter_lines
from densekit.data.records import Qrels, Run, id_problem
from densekit.diagnostics import Diagnostics
from densekit.errors import InputError
from densekit.io.outputs import output_file

_BEIR_HEADER = ["query-id", "corpus-id", "score"]
_QRELS_LAYOUTS = {3: "query-id corpus-id score (BEIR)", 4: "query-id iteration doc-id relevance (TREC)"}


class Judgement(NamedTuple):
    """One line of a qrels file."""

    line: int
    query_id: str
    doc_id: str
    relevance: int


def read_qrels(path: Path, diagnostics: Diagnostics) -> Qrels:
    """Read judgements into `{query id: {doc id: relevance}}`."""
    return to_qrels(read_judgements(path, diagnostics))


def to_qrels(judgements: list[Judgement]) -> Qrels:
    """Judgements as `{query id: {doc id: relevance}}`."""
    qrels: Qrels = {}
    for judgement in judgements:
        qrels.setdefault(judgement.query_id, {})[judgement.doc_id] = judgement.relevance
    return qrels


def read_judgements(path: Path, diagnostics: Diagnostics) -> list[Judgement]:
    """Read the judgements of a qrels file with their line numbers.

    The layout is set by the first judgement line: three columns as in BEIR (an optional header line
    `query-id corpus-id score` first) or four as in TREC; every line must then have that layout.
    """
    path = Path(path)
    judgements: list[Judgement] = []
    first_line: dict[tuple[str, str], int] = {}
    width = None
    for lineno, line in iter_lines(path):
        columns = line.split()
        if not columns:
            diagnostics.error(path, lineno, "blank line")
            continue
        if lineno == 1 and [c.lower() for c in columns] == _BEIR_HEADER:
            continue
        if width is None:
            if len(columns) not in _QRELS_LAYOUTS:
                diagnostics.error(
                    path,
                    lineno,
                    f"expected 3 columns ({_QRELS_LAYOUTS[3]}) or 4 ({_QRELS_LAYOUTS[4]}), "
                    f"found {len(columns)}",
                )
                continue
            width = len(columns)
        if len(columns) != width:
            diagnostics.error(
                path,
                lineno,
                f"expected {width} columns ({_QRELS_LAYOUTS[width]}) as on the first line, "
                f"found {len(columns)}",
            )
            continue
        query_id, doc_id, raw_score = columns[0], columns[-2], columns[-1]
        try:
            score = int(raw_score)
        except ValueError:
            diagnostics.error(path, lineno, f"relevance {raw_score!r} is not an integer")
            continue
        key = (query_id, doc_id)
        if key in first_line:
            diagnostics.error(
                path,
                lineno,
                f"duplicate judgement for query {query_id!r} and document {doc_id!r} "
                f"(first on line {first_line[key]})",
            )
            continue
        first_line[key] = lineno
        judgements.append(Judgement(lineno, query_id, doc_id, score))
    if width is None and not diagnostics.errors:
        diagnostics.error(path, None, "no judgements: the file holds only a header")
    return judgements


def check_judged_ids(
    path: Path,
    judgements: list[Judgement],
    known: set[str] | dict,
    field: Literal["query_id", "doc_id"],
    source: Path,
    diagnostics: Diagnostics,
) -> None:
    """Report, as one error at the first offending line, every judged id that `source` lacks."""
    first_seen: dict[str, int] = {}
    for judgement in judgements:
        value = getattr(judgement, field)
        if value not in known and value not in first_seen:
            first_seen[value] = judgement.line
    if not first_seen:
        return
    noun = "query" if field == "query_id" else "document"
    listed = [f"{value!r} (line {line})" for value, line in first_seen.items()]
    more = f" and {len(listed) - 20} more" if len(listed) > 20 else ""
    diagnostics.error(
        path,
        next(iter(first_seen.values())),
        f"{len(first_seen)} unknown {noun} ids, not in {source.name}: {', '.join(listed[:20])}{more}",
    )


def read_run(path: Path, diagnostics: Diagnostics) -> Run:
    """Read a TREC run (`query-id Q0 doc-id rank score tag`) into `{query id: {doc id: score}}`; a score
    must be a finite number (not `nan` or `inf`)."""
    path = Path(path)
    run: Run = {}
    for lineno, line in iter_lines(path):
        columns = line.split()
        if not columns:
            diagnostics.error(path, lineno, "blank line")
            continue
        if len(columns) != 6:
            diagnostics.error(
                path, lineno, f"expected 6 columns (query-id Q0 doc-id rank score tag), found {len(columns)}"
            )
            continue
        query_id, _, doc_id, raw_rank, raw_score, _ = columns
        try:
            int(raw_rank)
        except ValueError:
            diagnostics.error(path, lineno, f"rank {raw_rank!r} is not an integer")
            continue
        try:
            score = float(raw_score)
        except ValueError:
            diagnostics.error(path, lineno, f"score {raw_score!r} is not a number")
            continue
        if not math.isfinite(score):
            diagnostics.error(
                path, lineno, f"score {raw_score!r} is not a finite number: it cannot be ranked"
            )
            continue
        ranked = run.setdefault(query_id, {})
        if doc_id in ranked:
            diagnostics.error(path, lineno, f"document {doc_id!r} appears twice for query {query_id!r}")
            continue
        ranked[doc_id] = score
    return run


RUN_KIND = "run"


def write_run(
    path: Path,
    run: Run,
    tag: str = "densekit",
    inputs: Iterable[Path | str] = (),
    identity: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Write a run atomically in TREC's format, best first (ties keep their order), ranks from 1, as a
    file output (see `densekit.io.outputs`: never over an input or a file densekit did not write, nor
    over one made from another `identity` without `overwrite`), recording `identity` (what made it)
    when given. A score that is NaN or infinite is an error: `read_run` could not rank it."""
    with output_file(path, RUN_KIND, identity, inputs=inputs, overwrite=overwrite) as handle:
        for query_id, ranked in run.items():
            _check_id(query_id)
            ordered = sorted(ranked.items(), key=lambda pair: -pair[1])
            for rank, (doc_id, score) in enumerate(ordered, start=1):
                if not math.isfinite(score):
                    raise InputError(f"query {query_id!r}, document {doc_id!r}: score {score} is not finite")
                handle.write(f"{query_id} Q0 {doc_id} {rank} {score:.9g} {tag}\n")


def _check_id(value: str) -> None:
    problem = id_problem(value)
    if problem is not None:
        raise InputError(problem)
