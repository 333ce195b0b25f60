"""Inference batches cut where padding costs more than another forward pass: the cuts are the cheapest
split (against every split of small lists), every row is run once, and the vectors are those of one text
a call."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from densekit.inference import infer_in_batches, length_batches
from densekit.models.padding import pass_cost


def _cost(bounds: list[tuple[int, int]], lengths: np.ndarray, per_pass: int) -> int:
    return sum((end - start) * int(lengths[start]) + per_pass for start, end in bounds)


def _every_split(n: int, most: int):
    """Every split of n rows into consecutive batches of at most `most` rows."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut]
        bounds = list(zip(starts, [*starts[1:], n], strict=True))
        if all(end - start <= most for start, end in bounds):
            yield bounds


@pytest.mark.parametrize("seed", range(30))
def test_the_cuts_are_the_cheapest_split_of_every_split(seed: int):
    rng = np.random.default_rng(seed)
    n, most, per_pass = int(rng.integers(1, 11)), int(rng.integers(1, 6)), int(rng.choice([0, 8, 40, 128]))
    lengths = np.sort(rng.integers(1, 80, size=n))[::-1]
    bounds = length_batches(lengths, most, per_pass)
    assert [start for start, _ in bounds] == [0, *[end for _, end in bounds[:-1]]] and bounds[-1][1] == n
    assert all(0 < end - start <= most for start, end in bounds)
    cheapest = min(_cost(split, lengths, per_pass) for split in _every_split(n, most))
    assert _cost(bounds, lengths, per_pass) == cheapest


def test_without_a_pass_cost_batches_hold_the_batch_size():
    assert length_batches(np.array([9, 7, 7, 3, 1]), 2, None) == [(0, 2), (2, 4), (4, 5)]
    assert length_batches(np.array([], dtype=np.int64), 4, 128) == []


def test_where_cutting_gains_nothing_the_batches_are_those_of_the_batch_size():
    # [8], [7, 6] costs what [8, 7], [6] does: the split without a pass cost is kept, so a padding model
    # and a packing one (the base alone) put each text in a batch of the same shape
    lengths = np.array([8, 7, 6])
    assert length_batches(lengths, 2, 128) == length_batches(lengths, 2, None) == [(0, 2), (2, 3)]


def test_a_long_text_among_short_ones_gets_a_batch_of_its_own_on_a_cpu():
    lengths = [5] * 20 + [300] + [6] * 11
    seen: list[np.ndarray] = []
    cpu = torch.device("cpu")
    infer_in_batches(torch.nn.Linear(1, 1), lengths, 32, cpu, "float32", seen.append, pass_cost(cpu))
    assert [len(rows) for rows in seen] == [1, 31]
    assert sorted(np.concatenate(seen).tolist()) == list(range(32))
    assert seen[0].tolist() == [20]


def test_vectors_from_cut_batches_are_those_of_one_text_a_call(tiny_model):
    from densekit.encoding.embed import embed_texts
    from densekit.models import DenseEncoder

    encoder = DenseEncoder.load(tiny_model)
    texts = ["a short one", "word " * 120, "two words", "a query of several more words than the first"] * 4
    together = embed_texts(encoder, texts, "query", 16)
    apart = np.concatenate([embed_texts(encoder, [text], "query", 1) for text in texts])
    np.testing.assert_allclose(together, apart, atol=1e-5)
