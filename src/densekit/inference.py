"""Inference in batches ordered by length: the loop that every model encoding or scoring texts runs
(`densekit.encoding.embed`, the cross-encoder's scores)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from densekit.device import Precision, autocast


def infer_in_batches(
    model: torch.nn.Module,
    lengths: Sequence[int],
    batch_size: int,
    device: torch.device,
    precision: Precision,
    step: Callable[[np.ndarray], None],
    pass_cost: int | None,
) -> None:
    """Call `step(rows)` for the rows of items of `lengths` (token counts), at most `batch_size` at a
    time, the longest first (equal lengths in their order), so that each batch is padded only to its own
    longest item and memory peaks at the start. With `pass_cost` (what one more forward pass costs in
    tokens: `densekit.models.padding.pass_cost` decides it), a batch is cut short where the padding its
    remaining rows would take costs more than another pass (`length_batches`); with None, batches hold
    `batch_size` rows.

    Every call runs without autograd, under `precision`'s autocast on `device`, with `model` in
    inference mode: a model that was training is put back after, and one already in inference mode is
    never written, so threads may share it.
    """
    order = np.argsort([-length for length in lengths], kind="stable")
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.inference_mode(), autocast(device, precision):
            sorted_lengths = np.asarray(lengths, dtype=np.int64)[order]
            for start, end in length_batches(sorted_lengths, batch_size, pass_cost):
                step(order[start:end])
    finally:
        if was_training:
            model.train()


def length_batches(sorted_lengths: np.ndarray, most: int, per_pass: int | None) -> list[tuple[int, int]]:
    """The (start, end) of each batch of rows whose token counts `sorted_lengths` run longest first: at
    most `most` rows a batch, cut so that the padded tokens (each batch's rows times its first row's
    length) plus `per_pass` tokens for each batch are fewest; `None`, batches of `most` rows. Of splits
    that cost the same, the one whose earlier batches are fullest, as batches of `most` rows are: where
    cutting gains nothing, a model that computes its padding is batched as one that does not, so a
    module that adds nothing gives the base's vectors bit for bit (a CPU's matrix products sum a row
    differently in a batch of another shape).

    By hand: padding-aware cuts of a sorted list are a small dynamic programme that neither transformers
    nor sentence-transformers offers (they batch a fixed number of texts). One numpy step a row."""
    n = len(sorted_lengths)
    if per_pass is None:
        return [(start, min(start + most, n)) for start in range(0, n, most)]
    widths = sorted_lengths.astype(np.float64)
    cost = np.zeros(n + 1)  # cost[end]: the least cost of batching rows [0, end)
    cut = np.zeros(n + 1, dtype=np.int64)  # where the last batch of that best split starts
    # cost[start] - start * widths[start]: a batch [start, end) then costs this + end * widths[start]
    offset = np.zeros(n)
    for end in range(1, n + 1):
        low = max(0, end - most)
        totals = offset[low:end] + end * widths[low:end]
        best = len(totals) - 1 - int(np.argmin(totals[::-1]))  # the last of equals: fullest earlier batches
        cost[end], cut[end] = totals[best] + per_pass, low + best
        if end < n:
            offset[end] = cost[end] - end * widths[end]
    bounds = []
    end = n
    while end > 0:
        bounds.append((int(cut[end]), end))
        end = int(cut[end])
    return bounds[::-1]
