"""The positive-rank diagnostic against hand-counted ranks and chances."""

import pytest

from benchmarks.positive_ranks import chance_positive_above, positive_ranks, summary


def test_ranks_follow_scores_and_a_missing_positive_ranks_below_the_run():
    qrels = {"q": {"a": 1, "d": 2, "z": 1, "n": 0}, "unjudged": {"a": 0}}
    run = {"q": {"b": 0.9, "a": 1.0, "c": 0.8, "d": 0.7, "e": 0.1}}
    assert positive_ranks(qrels, run) == {"q": [1, 4, 6]}


def test_the_chance_that_a_positive_outranks_a_negative_of_the_range():
    ranks = {"q": [1, 4], "r": [5]}
    # q: candidates 2, 3, 5 -> rank 1 beats all three, rank 4 beats one: (1 + 1/3) / 2; r: 2, 3, 4 -> 0
    assert chance_positive_above(ranks, 2, 5) == pytest.approx(((1 + 1 / 3) / 2 + 0) / 2)
    assert summary(ranks, [(2, 5)])["share_within"]["2"] == pytest.approx(1 / 3)
