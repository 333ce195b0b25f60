"""Top-k hits of a batch of queries, as row labels into a shared table of document ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from densekit.data.records import Run
from densekit.errors import InputError


@dataclass(frozen=True)
class Hits:
    """Scores and row labels (-1 for an empty slot) of shape (queries, k), and the id of every row.

    Searching stays in arrays; ids are looked up only when a run is made, so a search costs what the
    underlying index's costs.
    """

    scores: np.ndarray
    labels: np.ndarray
    ids: np.ndarray

    def doc_ids(self) -> np.ndarray:
        """Document ids of shape (queries, k), None for empty slots."""
        found = self.ids[np.where(self.labels < 0, 0, self.labels)]
        found[self.labels < 0] = None
        return found

    def to_run(self, query_ids: Sequence[str], k: int, skip_self: bool = True) -> Run:
        """Each query's documents best first, at most `k`, without empty slots.

        With `skip_self`, a document whose id equals the query's is left out, as BEIR does (some
        collections hold queries that are also documents); search k+1 deep to still get k.
        """
        if len(query_ids) != len(self.labels):
            raise InputError(f"{len(query_ids)} query ids for {len(self.labels)} rows of hits")
        run: Run = {}
        for row, query_id in enumerate(query_ids):
            valid = self.labels[row] >= 0
            ranked = dict(
                zip(self.ids[self.labels[row][valid]].tolist(), self.scores[row][valid].tolist(), strict=True)
            )
            if skip_self:
                ranked.pop(query_id, None)
            while len(ranked) > k:
                ranked.popitem()  # the last inserted is the lowest scored
            run[query_id] = ranked
        return run
