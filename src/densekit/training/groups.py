"""Which positive and which negatives each example trains with in each epoch.

Per example, a seeded permutation of its negatives is fixed once; epoch e takes the window of n-1
starting at e·(n-1), wrapping around, so successive epochs rotate through all of them (as Tevatron
does). The positive rotates through the example's positives the same way. Everything depends only
on (seed, example, epoch), so a resumed run sees exactly the groups an uninterrupted one would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np

from densekit.data.examples import TrainingExample

log = logging.getLogger("densekit")

Shortfall = Literal["error", "repeat", "random"]


class NegativeShortfallError(ValueError):
    """An example has fewer negatives than a group needs, and no policy to make up for it was chosen."""


class GroupSampler:
    """Picks one positive and `group_size - 1` negatives per example and epoch.

    When an example has fewer negatives than needed, `shortfall` decides, and the choice is logged
    with the number of examples it touched: `error` (the default) refuses; `repeat` cycles the
    example's own negatives; `random` fills with documents drawn from `corpus_ids`.
    """

    def __init__(
        self,
        examples: Sequence[TrainingExample],
        group_size: int,
        seed: int,
        shortfall: Shortfall = "error",
        corpus_ids: Sequence[str] | None = None,
    ):
        if group_size < 1:
            raise ValueError(f"group size must be at least 1 (the positive), got {group_size}")
        self.examples = examples
        self.group_size = group_size
        self.seed = seed
        self.shortfall = shortfall
        self.corpus_ids = corpus_ids
        needed = group_size - 1
        short = [i for i, ex in enumerate(examples) if len(ex.negatives) < needed]
        if short and needed:
            first = examples[short[0]]
            described = (
                f"{len(short)} of {len(examples)} training examples have fewer than {needed} negatives "
                f"(group size {group_size}), e.g. query {first.query_id!r} with {len(first.negatives)}"
            )
            if shortfall == "error":
                raise NegativeShortfallError(
                    described + "; mine more negatives, lower the group size, or set data.shortfall to "
                    "'repeat' (cycle each example's own) or 'random' (fill from the corpus)"
                )
            if shortfall == "random" and not corpus_ids:
                raise ValueError("shortfall 'random' needs the corpus ids to draw from")
            if shortfall == "repeat" and any(not examples[i].negatives for i in short):
                raise NegativeShortfallError(described + "; some have none, so 'repeat' has nothing to cycle")
            log.warning("%s: filling them by %r", described, shortfall)

    def group(self, index: int, epoch: int) -> tuple[str, list[str]]:
        """The positive and negatives of example `index` in `epoch`."""
        example = self.examples[index]
        rng = np.random.default_rng([self.seed, index])
        positive = example.positives[(int(rng.integers(1 << 30)) + epoch) % len(example.positives)]
        needed = self.group_size - 1
        if needed == 0:
            return positive, []
        negatives = [example.negatives[i] for i in rng.permutation(len(example.negatives))]
        if len(negatives) >= needed:
            start = (epoch * needed) % len(negatives)
            return positive, [negatives[(start + j) % len(negatives)] for j in range(needed)]
        if self.shortfall == "repeat":
            return positive, [negatives[j % len(negatives)] for j in range(needed)]
        fill_rng = np.random.default_rng([self.seed, index, epoch])
        excluded = set(example.positives) | set(negatives)
        fill: list[str] = []
        while len(fill) < needed - len(negatives):
            candidate = self.corpus_ids[int(fill_rng.integers(len(self.corpus_ids)))]
            if candidate not in excluded:
                fill.append(candidate)
        return positive, negatives + fill
