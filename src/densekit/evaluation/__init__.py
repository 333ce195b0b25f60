"""Evaluation of runs against relevance judgements with ir_measures."""

from densekit.evaluation.measures import (
    DEFAULT_MEASURES,
    PER_QUERY_KIND,
    SCORES_KIND,
    evaluate,
    evaluate_per_query,
    parse_measures,
)

__all__ = [
    "DEFAULT_MEASURES",
    "PER_QUERY_KIND",
    "SCORES_KIND",
    "evaluate",
    "evaluate_per_query",
    "parse_measures",
]
