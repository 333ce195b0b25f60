"""Which examples make up each batch: a seeded shuffle per epoch, cut into global batches in order.

With length grouping, the shuffled examples are cut into buckets of `bucket_batches` batches; each
bucket is sorted by length and cut into batches, and the batches of all buckets are shuffled: a batch
holds examples of similar length (little padding) drawn from a random part of the collection, so its
in-batch negatives stay random across the collection. (Hugging Face's LengthGroupedSampler does the
same for one process; it is not used because it draws from torch's global generator and knows nothing
of global batches shared between processes.)

With domain batching, each batch holds examples of one domain: each domain's shuffled examples are cut
into full batches (the rest of a domain waits for a later epoch's shuffle), and the batches of all
domains are shuffled together, so domains take turns in proportion to their size.

Under several processes, each takes its contiguous slice of the global batch. Everything depends only
on (seed, epoch, step) and the lengths, so a resumed run and a run on another number of processes see
the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from densekit.errors import InputError
from densekit.training import distributed


@dataclass(frozen=True)
class LengthGrouping:
    """Each example's length this epoch, and how many batches a bucket of similar lengths spans."""

    lengths: np.ndarray
    bucket_batches: int


@dataclass(frozen=True)
class DomainBatching:
    """Each example's domain: every batch is drawn from one domain."""

    domains: np.ndarray


def epoch_order(
    example_count: int,
    batch_size: int,
    epoch: int,
    seed: int,
    grouping: LengthGrouping | DomainBatching | None = None,
) -> np.ndarray:
    """Example indices of `epoch` in training order; without grouping every example once, with it those
    of the full batches (length grouping: the shortest of the last bucket are left over instead of the
    last ones; domain batching: each domain's last partial batch)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(example_count)
    if grouping is None:
        return order
    if isinstance(grouping, DomainBatching):
        if len(grouping.domains) != example_count:
            raise InputError(f"{len(grouping.domains)} domains for {example_count} examples")
        batches = []
        for domain in sorted(set(grouping.domains.tolist())):
            members = order[grouping.domains[order] == domain]
            full = (len(members) // batch_size) * batch_size
            batches.extend(members[:full].reshape(-1, batch_size))
        if not batches:
            return order[:0]
        stacked = np.stack(batches)
        return stacked[rng.permutation(len(stacked))].reshape(-1)
    if len(grouping.lengths) != example_count:
        raise InputError(f"{len(grouping.lengths)} lengths for {example_count} examples")
    span = batch_size * grouping.bucket_batches
    buckets = [order[start : start + span] for start in range(0, example_count, span)]
    grouped = np.concatenate([b[np.argsort(-grouping.lengths[b], kind="stable")] for b in buckets])
    batches = grouped[: (example_count // batch_size) * batch_size].reshape(-1, batch_size)
    return batches[rng.permutation(len(batches))].reshape(-1)


def global_batch_rows(
    example_count: int,
    batch_size: int,
    epoch: int,
    step: int,
    seed: int,
    grouping: LengthGrouping | DomainBatching | None = None,
) -> np.ndarray:
    """Example indices of global batch `step` in `epoch`."""
    order = epoch_order(example_count, batch_size, epoch, seed, grouping)
    return order[step * batch_size : (step + 1) * batch_size]


def local_batch_rows(
    example_count: int,
    batch_size: int,
    epoch: int,
    step: int,
    seed: int,
    grouping: LengthGrouping | DomainBatching | None = None,
) -> np.ndarray:
    """This process's slice of global batch `step` in `epoch`."""
    world = distributed.world_size()
    if batch_size % world:
        raise InputError(f"batch size {batch_size} is not divisible by the {world} processes")
    local = batch_size // world
    rows = global_batch_rows(example_count, batch_size, epoch, step, seed, grouping)
    start = distributed.rank() * local
    return rows[start : start + local]


def domain_batching(domains: list[str | None], source: str) -> DomainBatching:
    """Domain batching over examples' domains; an example without one is an error naming its line of
    `source`."""
    missing = [line for line, domain in enumerate(domains, start=1) if domain is None]
    if missing:
        raise InputError(
            f"{source}:{missing[0]}: no domain; data.batches by_domain needs one on every example "
            f"({len(missing)} lack it; `densekit mine --domain` writes it)"
        )
    return DomainBatching(np.array(domains))


def batches_per_epoch(
    example_count: int, batch_size: int, grouping: LengthGrouping | DomainBatching | None
) -> int:
    """Full global batches in an epoch."""
    if isinstance(grouping, DomainBatching):
        _, sizes = np.unique(grouping.domains, return_counts=True)
        return int(sum(size // batch_size for size in sizes))
    return example_count // batch_size
