"""Which positives and which negatives each example trains with in each epoch.

A group is `positives` of the example's positives, then `group_size - positives` of its negatives.
Per example, a seeded permutation of its negatives is fixed once; epoch e takes the window of
n = group_size - positives starting at e·n, wrapping around, so successive epochs rotate through all
of them (as Tevatron does). The positives rotate the same way: a window of `positives` starting at
e·positives of a seeded order (with one positive per group, the example's own order from a seeded
start, as before several were possible), so an example with fewer positives than slots repeats
them. Everything depends only on (seed, example, epoch), so a resumed run sees exactly the groups an
uninterrupted one would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from densekit.data.examples import TrainingExample
from densekit.errors import DensekitError, InputError

log = logging.getLogger("densekit")

Shortfall = Literal["error", "repeat", "random"]


class NegativeShortfallError(DensekitError, ValueError):
    """An example has fewer negatives than a group needs, and no policy to make up for it was chosen."""


class Group(NamedTuple):
    """One example's documents in one epoch: its positives (repeated when it has fewer than the
    group's positive slots), then its negatives."""

    positives: list[str]
    negatives: list[str]

    @property
    def documents(self) -> list[str]:
        """The group's documents as a batch lays them out: positives first, then negatives."""
        return [*self.positives, *self.negatives]


class GroupSampler:
    """Picks `positives` positives and `group_size - positives` negatives per example and epoch.

    When an example has fewer negatives than needed, `shortfall` decides, and the choice is logged
    with the number of examples it touched: `error` (the default) refuses; `repeat` cycles the
    example's own negatives; `random` fills with documents drawn from `corpus_ids`. An example with
    fewer positives than `positives` always cycles its own (the loss counts a repeat once).
    """

    def __init__(
        self,
        examples: Sequence[TrainingExample],
        group_size: int,
        seed: int,
        shortfall: Shortfall = "error",
        corpus_ids: Sequence[str] | None = None,
        positives: int = 1,
    ):
        if positives < 1:
            raise InputError(f"positives per group must be at least 1, got {positives}")
        if group_size < positives:
            raise InputError(f"group size {group_size} is smaller than its {positives} positives")
        self.examples = examples
        self.group_size = group_size
        self.positives = positives
        self.seed = seed
        self.shortfall = shortfall
        self.corpus_ids = corpus_ids
        few = sum(len(ex.positives) < positives for ex in examples)
        if few:
            log.info(
                "%d of %d training examples have fewer than %d positives: their groups repeat them",
                few, len(examples), positives,
            )  # fmt: skip
        needed = group_size - positives
        short = [i for i, ex in enumerate(examples) if len(ex.negatives) < needed]
        if short and needed:
            first = examples[short[0]]
            slots = f"group size {group_size}" + (f", {positives} positives" if positives > 1 else "")
            described = (
                f"{len(short)} of {len(examples)} training examples have fewer than {needed} negatives "
                f"({slots}), e.g. query {first.query_id!r} with {len(first.negatives)}"
            )
            if shortfall == "error":
                raise NegativeShortfallError(
                    described + "; mine more negatives, lower the group size, or set data.shortfall to "
                    "'repeat' (cycle each example's own) or 'random' (fill from the corpus)"
                )
            if shortfall == "random" and not corpus_ids:
                raise InputError("shortfall 'random' needs the corpus ids to draw from")
            if shortfall == "repeat" and any(not examples[i].negatives for i in short):
                raise NegativeShortfallError(described + "; some have none, so 'repeat' has nothing to cycle")
            log.warning("%s: filling them by %r", described, shortfall)

    def group(self, index: int, epoch: int) -> Group:
        """The positives and negatives of example `index` in `epoch`."""
        example = self.examples[index]
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(1 << 30))
        negatives = [example.negatives[i] for i in rng.permutation(len(example.negatives))]
        count = len(example.positives)
        # one positive per group keeps the example's own order (what every run before several
        # positives drew); several take a seeded order, so that a group's positives vary in kind
        order = rng.permutation(count) if self.positives > 1 else range(count)
        first = start + epoch * self.positives
        positives = [example.positives[order[(first + j) % count]] for j in range(self.positives)]
        needed = self.group_size - self.positives
        if needed == 0:
            return Group(positives, [])
        if len(negatives) >= needed:
            offset = (epoch * needed) % len(negatives)
            return Group(positives, [negatives[(offset + j) % len(negatives)] for j in range(needed)])
        if self.shortfall == "repeat":
            return Group(positives, [negatives[j % len(negatives)] for j in range(needed)])
        fill_rng = np.random.default_rng([self.seed, index, epoch])
        excluded = set(example.positives) | set(negatives)
        fill: list[str] = []
        while len(fill) < needed - len(negatives):
            candidate = self.corpus_ids[int(fill_rng.integers(len(self.corpus_ids)))]
            if candidate not in excluded:
                fill.append(candidate)
        return Group(positives, negatives + fill)
