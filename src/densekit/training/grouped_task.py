"""What the contrastive and listwise tasks share: examples whose groups change per epoch, and how a
step's batch is drawn from them (at random, by domain, or by length)."""

from __future__ import annotations

import numpy as np

from densekit.data.examples import TrainingExample
from densekit.errors import InputError
from densekit.training.config import CrossEncoderTrainConfig, TrainConfig
from densekit.training.groups import GroupSampler
from densekit.training.sampling import DomainBatching, LengthGrouping, batches_per_epoch, domain_batching


class GroupedExamplesTask:
    """The base of the tasks that train on groups of passages (positives, then hard negatives): the
    examples, each epoch's groups, and the batching the config asks for. A subclass says how long an
    example's group is (`group_lengths`), since that is what its batches are padded to."""

    def __init__(
        self,
        examples: list[TrainingExample],
        texts: dict[str, str],
        config: TrainConfig | CrossEncoderTrainConfig,
    ):
        batch = config.optim.batch_size
        if len(examples) < batch:
            raise InputError(f"{len(examples)} training examples are fewer than one batch of {batch}")
        self.texts = texts
        self.config = config
        self._use_examples(examples)

    def _use_examples(self, examples: list[TrainingExample]) -> None:
        """Train on `examples` from now on: their groups, domains and lengths are worked out anew."""
        self.examples = examples
        data, seed = self.config.data, self.config.seed
        self.sampler = GroupSampler(
            examples, data.group_size, seed, data.shortfall, list(self.texts), positives=data.positives
        )
        self._grouping: tuple[int, LengthGrouping] | None = None
        self._domains = (
            domain_batching([e.domain for e in examples], data.train) if data.batches == "by_domain" else None
        )

    def steps_per_epoch(self) -> int:
        """Global batches per epoch."""
        return batches_per_epoch(len(self.examples), self.config.optim.batch_size, self.grouping(0))

    def grouping(self, epoch: int) -> LengthGrouping | DomainBatching | None:
        """How `epoch`'s batches are grouped: by domain, by length, or not at all."""
        return self._domains if self._domains is not None else self.length_grouping(epoch)

    def length_grouping(self, epoch: int) -> LengthGrouping | None:
        """With `data.length_grouping`, the buckets of `epoch` by each example's `group_lengths`."""
        bucket_batches = self.config.data.length_grouping
        if bucket_batches is None:
            return None
        if self._grouping is None or self._grouping[0] != epoch:
            self._grouping = (epoch, LengthGrouping(self.group_lengths(epoch), bucket_batches))
        return self._grouping[1]

    def group_lengths(self, epoch: int) -> np.ndarray:
        """Each example's length in `epoch`: the tokens its group's rows are padded to."""
        raise NotImplementedError
