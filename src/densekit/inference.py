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
) -> None:
    """Call `step(rows)` for the rows of items of `lengths` (token counts), `batch_size` at a time, the
    longest first (equal lengths in their order), so that each batch is padded only to its own longest
    item and memory peaks at the start.

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
            for start in range(0, len(order), batch_size):
                step(order[start : start + batch_size])
    finally:
        if was_training:
            model.train()
