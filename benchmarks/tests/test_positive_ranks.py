"""The positive-rank diagnostic against hand-counted ranks and chances."""

import math

import pytest

from benchmarks.positive_ranks import QueryRanks, chance_positive_above, positive_ranks, summary


def test_ranks_follow_scores_and_a_missing_positive_ranks_below_the_run():
    qrels = {"q": {"a": 1, "d": 2, "z": 1, "n": 0}, "unjudged": {"a": 0}}
    run = {"q": {"b": 0.9, "a": 1.0, "c": 0.8, "d": 0.7, "e": 0.1}}
    assert positive_ranks(qrels, run) == {"q": QueryRanks([1, 4, 6], 5)}


def test_a_query_the_run_lacks_is_counted_not_ranked_first():
    qrels = {"q": {"a": 1}, "absent": {"a": 1}}
    result = summary(qrels, {"q": {"b": 2.0, "a": 1.0}}, [])
    assert (result["queries"], result["judged_queries_missing_from_the_run"]) == (1, 1)
    assert result["rank_percentiles"]["50"] == 2


def test_the_chance_that_a_positive_outranks_a_negative_of_the_range():
    ranks = {"q": QueryRanks([1, 4], 5), "r": QueryRanks([5], 5)}
    # q: candidates 2, 3, 5 -> rank 1 beats all three, rank 4 beats one: (1 + 1/3) / 2; r: 2, 3, 4 -> 0
    assert chance_positive_above(ranks, 2, 5) == pytest.approx(((1 + 1 / 3) / 2 + 0) / 2)
    # ranks past a query's run are no candidates: the same as the range cut at 5
    assert chance_positive_above(ranks, 2, 50) == chance_positive_above(ranks, 2, 5)
    assert math.isnan(chance_positive_above(ranks, 6, 9))
    assert summary({"q": {"x": 1}}, {"q": {"x": 1.0, "y": 0.5}}, [(2, 2)])["share_within"]["2"] == 1.0
