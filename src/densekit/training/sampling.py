"""Which examples make up each batch: a seeded shuffle per epoch, cut into global batches in order.

Under several processes, each takes its contiguous slice of the global batch. Everything depends only
on (seed, epoch, step), so a resumed run and a run on another number of processes see the same
global batches.
"""

from __future__ import annotations

import numpy as np

from densekit.training import distributed


def global_batch_rows(example_count: int, batch_size: int, epoch: int, step: int, seed: int) -> np.ndarray:
    """Example indices of global batch `step` in `epoch`."""
    order = np.random.default_rng([seed, epoch]).permutation(example_count)
    return order[step * batch_size : (step + 1) * batch_size]


def local_batch_rows(example_count: int, batch_size: int, epoch: int, step: int, seed: int) -> np.ndarray:
    """This process's slice of global batch `step` in `epoch`."""
    world = distributed.world_size()
    if batch_size % world:
        raise ValueError(f"batch size {batch_size} is not divisible by the {world} processes")
    local = batch_size // world
    rows = global_batch_rows(example_count, batch_size, epoch, step, seed)
    start = distributed.rank() * local
    return rows[start : start + local]
