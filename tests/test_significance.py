"""The paired randomisation test the benchmarks use to compare two runs query by query."""

from densekit.evaluation.significance import paired_test


def test_identical_runs_differ_by_nothing():
    scores = {f"q{i}": i / 10 for i in range(10)}
    result = paired_test(scores, dict(scores), flips=2_000)
    assert result == {"queries": 10, "mean_difference": 0.0, "better": 0, "worse": 0, "p_two_sided": 1.0}


def test_a_consistent_gain_is_significant_and_its_p_matches_the_exact_one():
    control = {f"q{i}": 0.5 for i in range(10)}
    arm = {q: 0.6 for q in control}
    result = paired_test(control, arm)
    assert (result["better"], result["worse"], result["mean_difference"]) == (10, 0, 0.1)
    # of the 2**10 sign patterns only all-plus and all-minus reach a mean of 0.1 in size (a one-sided
    # test would give half that)
    assert abs(result["p_two_sided"] - 2 / 2**10) < 0.0005


def test_a_query_missing_from_the_arm_counts_as_zero():
    control = {"a": 0.4, "b": 0.2}
    result = paired_test(control, {"a": 0.4}, flips=1_000)
    assert (result["queries"], result["worse"], result["mean_difference"]) == (2, 1, -0.1)
    assert result["p_two_sided"] == 1.0  # one non-zero difference: every flip is as large
