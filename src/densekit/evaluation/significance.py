"""Per-query nDCG@10 of TREC runs, and a paired randomisation test between two of them (used by the
benchmarks to compare runs query by query)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.evaluation import evaluate_per_query


def per_query_ndcg(qrels, run: Path) -> dict[str, float]:
    """nDCG@10 of each query of a TREC run."""
    ranked = read_run(run, Diagnostics())
    return {query: value for query, _, value in evaluate_per_query(qrels, ranked, ["nDCG@10"])}


def paired_test(control: dict[str, float], arm: dict[str, float], flips: int = 100_000) -> dict:
    """Per-query nDCG@10 of `arm` against `control` over the control's queries (a query missing from
    `arm` counts as 0): the mean difference, the queries better and worse, and the two-sided p of a
    paired randomisation test over `flips` sign flips.

    Written here because ir_measures has no significance test, and a 15-line sign-flip test is not
    worth a scipy dependency."""
    diffs = np.array([arm.get(q, 0.0) - control[q] for q in sorted(control)])
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(flips, len(diffs)))
    p = float((np.abs((signs * diffs).mean(axis=1)) >= abs(diffs.mean())).mean())
    return {
        "queries": len(diffs), "mean_difference": round(float(diffs.mean()), 4),
        "better": int((diffs > 0).sum()), "worse": int((diffs < 0).sum()), "p_two_sided": round(p, 3),
    }  # fmt: skip
