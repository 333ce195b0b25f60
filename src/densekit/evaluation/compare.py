"""Comparing runs on the same judgements: per-measure means, paired tests against the first run with
Holm's correction across the others, and a plot of the per-query differences."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from densekit.data.records import Qrels, Run
from densekit.errors import InputError
from densekit.evaluation.significance import DEFAULT_TRIALS, PairedTest, holm, paired_test, per_query
from densekit.plots import pyplot, save_png


@dataclass(frozen=True)
class ArmResult:
    """One run against the first, on one measure."""

    name: str
    mean: float
    test: PairedTest
    p_t_test_holm: float
    p_randomisation_holm: float


@dataclass
class MeasureComparison:
    """Every run on one measure: the first run is the control the others are tested against."""

    measure: str
    control: str
    control_mean: float
    arms: list[ArmResult]
    per_query: dict[str, dict[str, float]] = field(repr=False)

    def to_json(self) -> dict:
        """The comparison without its per-query values."""
        return {
            "measure": self.measure,
            "control": {"name": self.control, "mean": self.control_mean},
            "runs": [
                {"name": arm.name, "mean": arm.mean, **asdict(arm.test),
                 "p_t_test_holm": arm.p_t_test_holm, "p_randomisation_holm": arm.p_randomisation_holm}
                for arm in self.arms
            ],
        }  # fmt: skip


def compare_runs(
    qrels: Qrels,
    runs: dict[str, Run],
    measures: list[str],
    trials: int = DEFAULT_TRIALS,
    seed: int = 0,
) -> list[MeasureComparison]:
    """Each run after the first against the first, for each measure, over every judged query."""
    if len(runs) < 2:
        raise InputError("compare needs at least two runs")
    names = list(runs)
    comparisons = []
    for measure in measures:
        values = {name: per_query(qrels, run, measure) for name, run in runs.items()}
        control = values[names[0]]
        tests = [paired_test(control, values[name], trials, seed) for name in names[1:]]
        t_holm = holm([t.p_t_test for t in tests])
        random_holm = holm([t.p_randomisation for t in tests])
        arms = [
            ArmResult(name, _mean(values[name]), test, t_holm[i], random_holm[i])
            for i, (name, test) in enumerate(zip(names[1:], tests, strict=True))
        ]
        comparisons.append(MeasureComparison(measure, names[0], _mean(control), arms, values))
    return comparisons


def _mean(values: dict[str, float]) -> float:
    return float(np.mean(list(values.values()))) if values else 0.0


def plot_differences(
    comparisons: list[MeasureComparison], output: Path, record: bool = False, identity: dict | None = None
) -> Path:
    """Per measure (rows) and run against the first (columns), each query's difference as a bar,
    sorted: wins above zero in green, losses below in red; `record` and `identity`: see `save_png`."""
    plt = pyplot()

    rows, columns = len(comparisons), len(comparisons[0].arms)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 2.8 * rows), squeeze=False, sharey="row")
    for row, comparison in enumerate(comparisons):
        control = comparison.per_query[comparison.control]
        for column, arm in enumerate(comparison.arms):
            arm_values = comparison.per_query[arm.name]
            diffs = np.sort([arm_values[q] - control[q] for q in control])[::-1]
            axis = axes[row][column]
            colours = ["tab:green" if d > 0 else "tab:red" for d in diffs]
            axis.bar(np.arange(len(diffs)), diffs, width=1.0, color=colours)
            axis.axhline(0, color="black", linewidth=0.6)
            axis.set_title(
                f"{arm.name} against {comparison.control}\n"
                f"{comparison.measure}: {arm.test.mean_difference:+.4f}, {arm.test.better} better / "
                f"{arm.test.worse} worse, p={arm.p_randomisation_holm:.3g} (Holm)",
                fontsize=9,
            )
            axis.set_xlabel("queries, sorted by difference")
            axis.set_xlim(-0.5, len(diffs) - 0.5)
    return save_png(figure, output, record, identity)
