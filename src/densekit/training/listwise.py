"""Training a cross-encoder: a listwise softmax over each query's group of passages.

A step's batch holds B queries, each with a group of n passages (its positive first, then n-1 hard
negatives, picked per epoch as in contrastive training). Every (query, passage) pair is scored by the
cross-encoder; the loss of a query is the cross-entropy of its positive under the softmax over its
group's n scores (Gao et al.'s localized contrastive estimation), averaged over the batch.

A query's loss needs only its own group, so the batch can be scored in chunks of queries, each chunk's
loss back-propagated on its own: the gradient is the whole batch's, for the memory of one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from densekit.data.examples import TrainingExample
from densekit.device import autocast
from densekit.models.cross_encoder import CrossEncoder
from densekit.training.config import CrossEncoderTrainConfig
from densekit.training.grouped_task import GroupedExamplesTask
from densekit.training.sampling import (
    local_batch_rows,
)


@dataclass
class ListwiseBatch:
    """This process's share of a step: each query's pairs, unpadded, laid out group by group."""

    pairs: list[dict[str, list[int]]]
    group_size: int

    @property
    def size(self) -> int:
        """Queries in the batch."""
        return len(self.pairs) // self.group_size


def listwise_loss(scores: torch.Tensor) -> torch.Tensor:
    """Mean over queries of the cross-entropy of the positive (column 0) under the softmax over the
    query's group; `scores` is (queries x group size)."""
    scores = scores.float()
    return F.cross_entropy(scores, torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device))


class CrossEncoderTask(GroupedExamplesTask):
    """What the trainer needs to train a cross-encoder: batches, forward and backward, export."""

    def __init__(
        self,
        cross_encoder: CrossEncoder,
        examples: list[TrainingExample],
        texts: dict[str, str],
        config: CrossEncoderTrainConfig,
    ):
        self.module = cross_encoder
        super().__init__(examples, texts, config)

    def _pairs(self, index: int, epoch: int) -> list[dict[str, list[int]]]:
        example = self.examples[index]
        documents = self.sampler.group(index, epoch).documents  # one positive (the config's check)
        return self.module.tokenize([example.query] * len(documents), [self.texts[d] for d in documents])

    def batch(self, epoch: int, step: int) -> ListwiseBatch:
        """This process's part of global batch `step` of `epoch`."""
        rows = local_batch_rows(
            len(self.examples), self.config.optim.batch_size, epoch, step, self.config.seed,
            self.grouping(epoch),
        )  # fmt: skip
        pairs = [pair for index in rows for pair in self._pairs(int(index), epoch)]
        return ListwiseBatch(pairs, self.config.data.group_size)

    def group_lengths(self, epoch: int) -> np.ndarray:
        """Each example's length in `epoch`: the token count of the longest pair of its group, which is
        what its rows are padded to."""
        return np.array(
            [max(len(p["input_ids"]) for p in self._pairs(i, epoch)) for i in range(len(self.examples))]
        )

    def forward_backward(self, batch: ListwiseBatch, scale: float = 1.0) -> dict[str, float]:
        """Back-propagate `scale` times the batch's mean loss, chunk by chunk; returns the unscaled loss."""
        queries, group = batch.size, batch.group_size
        chunk = self.config.chunk_size or queries
        device = self.module.device
        total = 0.0
        for start in range(0, queries, chunk):
            stop = min(queries, start + chunk)
            inputs = self.module.tokenizer.pad(batch.pairs[start * group : stop * group], return_tensors="pt")
            with autocast(device, self.config.optim.precision):
                scores = self.module(**{k: v.to(device) for k, v in inputs.items()})
            loss = listwise_loss(scores.view(stop - start, group))
            share = (stop - start) / queries
            (loss * share * scale).backward()
            total += float(loss.detach()) * share
        return {"loss": total}

    def export(self, path: Path) -> None:
        """Save the trained cross-encoder as a folder sentence-transformers' CrossEncoder loads."""
        self.module.save(path)
