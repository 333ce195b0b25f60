"""Paired significance tests between runs, query by query, and Holm's correction across several."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from densekit.data.records import Qrels, Run
from densekit.errors import SettingError
from densekit.evaluation.measures import evaluate_per_query
from densekit.limits import DEFAULT_TRIALS, MAX_TRIALS

# The sign flips drawn at once are at most this many values (8 bytes each, 32 MiB); scipy draws them
# all at once otherwise, trials x queries values. In batches, the p-value is the same.
_BATCH_VALUES = 1 << 22


def per_query(qrels: Qrels, run: Run, measure: str) -> dict[str, float]:
    """`measure` for every judged query of `qrels`; a judged query the run does not answer is 0, so the
    mean of these values is the aggregate `evaluate` reports."""
    values = {query: value for query, _, value in evaluate_per_query(qrels, run, [measure])}
    return {query: values.get(query, 0.0) for query in qrels}


@dataclass(frozen=True)
class PairedTest:
    """`arm` against `control` over the same queries."""

    queries: int
    mean_difference: float
    better: int
    worse: int
    p_t_test: float
    p_randomisation: float


def paired_test(
    control: dict[str, float], arm: dict[str, float], trials: int = DEFAULT_TRIALS, seed: int = 0
) -> PairedTest:
    """The paired t-test and the paired randomisation (sign-flip) test of `arm` against `control` over
    the control's queries (a query missing from `arm` counts as 0), both two-sided. The randomisation
    test is exact when `trials` reaches the 2^n sign patterns of n queries; `trials` is 1 to
    `MAX_TRIALS`."""
    if not 1 <= trials <= MAX_TRIALS:
        raise SettingError(f"trials {trials}: from 1 to {MAX_TRIALS}")
    diffs = np.array([arm.get(q, 0.0) - control[q] for q in sorted(control)], dtype=np.float64)
    return PairedTest(
        queries=len(diffs),
        mean_difference=float(diffs.mean()) if len(diffs) else 0.0,
        better=int((diffs > 0).sum()),
        worse=int((diffs < 0).sum()),
        p_t_test=_t_test(diffs),
        p_randomisation=_randomisation_test(diffs, trials, seed),
    )


def _t_test(diffs: np.ndarray) -> float:
    if len(diffs) < 2 or np.ptp(diffs) == 0:  # no spread: the t statistic is 0/0 or infinite
        return 1.0 if len(diffs) == 0 or diffs[0] == 0 else 0.0
    return float(stats.ttest_1samp(diffs, 0.0).pvalue)


def _randomisation_test(diffs: np.ndarray, trials: int, seed: int) -> float:
    if not np.any(diffs):
        return 1.0
    result = stats.permutation_test(
        (diffs,),
        np.mean,
        permutation_type="samples",  # one sample: each query's difference keeps or flips its sign
        n_resamples=trials,
        batch=max(1, _BATCH_VALUES // len(diffs)),
        vectorized=True,
        axis=-1,
        alternative="two-sided",
        rng=np.random.default_rng(seed),
    )
    return float(result.pvalue)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of p-values for testing several hypotheses at once, in the given
    order. Written here: scipy has only Benjamini-Hochberg, and statsmodels is too large a dependency
    for five lines."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
