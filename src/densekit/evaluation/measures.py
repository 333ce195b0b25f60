"""Measures by their ir_measures names, aggregated or per query."""

from __future__ import annotations

from collections.abc import Iterable

import ir_measures
from ir_measures import Measure

from densekit.data.records import Qrels, Run
from densekit.errors import SettingError

DEFAULT_MEASURES = ("nDCG@10", "RR@10", "R@100", "R@1000", "AP")
SCORES_KIND = "scores"  # the aggregates as JSON, keyed by measure name
PER_QUERY_KIND = "per-query scores"


def parse_measures(names: Iterable[str]) -> list[Measure]:
    """ir_measures measures from their names (`nDCG@10`, `P(rel=2)@5`, ...), failing on an unknown one."""
    measures = []
    for name in names:
        try:
            measures.append(ir_measures.parse_measure(name))
        except (ValueError, NameError, SyntaxError, TypeError) as err:
            raise SettingError(f"unknown measure {name!r}: {err}") from None
    return measures


def evaluate(qrels: Qrels, run: Run, measures: Iterable[str] = DEFAULT_MEASURES) -> dict[str, float]:
    """Mean of each measure over the judged queries, keyed by name: a judged query absent from `run`
    counts as 0, and a query of `run` without judgements is left out."""
    parsed = parse_measures(measures)
    values = ir_measures.calc_aggregate(parsed, qrels, run)
    return {str(m): float(values[m]) for m in parsed}


def evaluate_per_query(
    qrels: Qrels, run: Run, measures: Iterable[str] = DEFAULT_MEASURES
) -> list[tuple[str, str, float]]:
    """`(query id, measure name, value)` for every query and measure."""
    parsed = parse_measures(measures)
    return [(m.query_id, str(m.measure), float(m.value)) for m in ir_measures.iter_calc(parsed, qrels, run)]
