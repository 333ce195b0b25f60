"""What every pre-training objective shares: its batches of masked documents and its loss plumbing, and
the registry of objectives (`TASKS`), as module kinds and routing strategies have theirs.

Each objective is one file of `densekit.pretraining.objectives`: a subclass, registered with
`@register_objective`, that says which sequences a document gives, what else a row holds, and which
losses the batch has; this base makes it the trainer's `TrainingTask` (module, steps_per_epoch, batch,
forward_backward, export). What the run and the config need to know of an objective are class
attributes here (`name`, `settings`, `whole_documents`, `takes_grad_cache`) and `check`, never a test
of its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from densekit.device import autocast
from densekit.errors import InputError
from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.masking import IGNORE
from densekit.pretraining.sequences import SequenceMaker, pad
from densekit.pretraining.settings import PretrainSettings
from densekit.registry import Registry
from densekit.training import distributed
from densekit.training.config import Section
from densekit.training.sampling import local_batch_rows

Row = dict[str, Any]


def labelled_count(labels: torch.Tensor) -> float:
    """The mean over processes of their labelled positions (1 where there are none).

    Each process divides its summed token losses by it: the trainer's average over processes, of the
    losses and of their gradients, is then the whole batch's mean per token, as on one process, even
    where the processes' parts hold different numbers of labelled tokens.
    """
    count = distributed.all_reduce_mean(int((labels != IGNORE).sum()))
    return count if count > 0 else 1


class PretrainTask(ABC):
    """One pre-training objective as a trainer task; subclasses give `losses` (and may change the rest).

    A subclass sets `name` (the `method` a config names it by), `settings` (the class of its section of
    the config, named after it; None when it has none), `whole_documents` (whether it reads documents
    whole, not cut to the sequence length before its `pieces` are taken) and `takes_grad_cache` (whether
    `grad_cache` applies to it), and may refuse a config in `check`. Its `__init__` takes the
    backbone, the corpus and the config; register it with `@register_objective`.
    """

    name: ClassVar[str]
    settings: ClassVar[type[Section] | None] = None
    whole_documents: ClassVar[bool] = False
    takes_grad_cache: ClassVar[bool] = False

    def __init__(
        self,
        mlm: MaskedLanguageModel,
        corpus: TokenizedCorpus,
        config: PretrainSettings,
        module: torch.nn.Module,
    ):
        self.mlm = mlm
        self.corpus = corpus
        self.config = config
        self.module = module
        self.sequences = SequenceMaker.for_tokenizer(mlm.tokenizer, config.model.max_length, mlm.source)
        if len(corpus) < config.optim.batch_size:
            raise InputError(f"{len(corpus)} documents are fewer than one batch of {config.optim.batch_size}")

    @classmethod
    def check(cls, config: PretrainSettings) -> None:
        """Refuse a config this objective cannot run (`ValueError`, one line), as the config is read."""
        return None

    def steps_per_epoch(self) -> int:
        """Global batches per epoch."""
        return len(self.corpus) // self.config.optim.batch_size

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.module.parameters()).device

    def documents(
        self, epoch: int, step: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.random.Generator]]:
        """Tokens, word indices and own random generator of each document in this process's batch part.

        The generator depends only on (seed, epoch, document), so masks do not depend on the processes.
        """
        config = self.config
        for doc in local_batch_rows(len(self.corpus), config.optim.batch_size, epoch, step, config.seed):
            rng = np.random.default_rng([config.seed, epoch, int(doc)])
            yield self.corpus.token_ids[doc], self.corpus.word_ids[doc], rng

    def pieces(
        self, tokens: np.ndarray, words: np.ndarray, rng: np.random.Generator
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The sequences (ids, word indices) one document gives: by default the document itself."""
        return [self.sequences.wrap(tokens, words)]

    def row(self, ids: np.ndarray, word_ids: np.ndarray, rng: np.random.Generator) -> Row:
        """One sequence of the batch: its masked input, its labels and its length."""
        inputs, labels = self.sequences.mask(ids, word_ids, self.config.masking.ratio, rng)
        return {"input_ids": inputs, "labels": labels, "length": len(ids)}

    def collate(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        """The rows as padded tensors."""
        return {
            "input_ids": pad([r["input_ids"] for r in rows], self.sequences.pad_id),
            "labels": pad([r["labels"] for r in rows], IGNORE),
            "attention_mask": pad([np.ones(r["length"], dtype=np.int64) for r in rows], 0),
        }

    def batch(self, epoch: int, step: int) -> dict[str, torch.Tensor]:
        """This process's part of global batch `step` of `epoch`; masks depend only on (seed, epoch, doc)."""
        rows = [
            self.row(ids, word_ids, rng)
            for tokens, words, rng in self.documents(epoch, step)
            for ids, word_ids in self.pieces(tokens, words, rng)
        ]
        return self.collate(rows)

    @abstractmethod
    def losses(self, batch: dict[str, torch.Tensor], masked: float) -> dict[str, torch.Tensor]:
        """The objective's losses, by name; `masked` counts the encoder's labelled positions."""

    def loss_weights(self, for_gradient: bool) -> dict[str, float]:
        """Weights of the losses that are not 1."""
        return {}

    def combine(self, parts: dict[str, torch.Tensor], for_gradient: bool = False) -> torch.Tensor:
        """The weighted sum of the losses (`for_gradient`: weighted as back-propagated)."""
        weights = self.loss_weights(for_gradient)
        return sum(weights.get(name, 1.0) * value for name, value in parts.items())

    def report(self, parts: dict[str, torch.Tensor]) -> dict[str, float]:
        """The total loss and each part, as numbers for the log."""
        return {
            "loss": float(self.combine(parts).detach()),
            **{f"loss_{k}": float(v.detach()) for k, v in parts.items()},
        }

    def on_device(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        """The batch moved to the weights' device, and the count its MLM sums are divided by
        (`labelled_count` of its encoder labels)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return batch, labelled_count(batch["labels"])

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, float]:
        """Compute the objective's loss times `scale`, back-propagate it, and return its parts."""
        batch, masked = self.on_device(batch)
        with autocast(self.device, self.config.optim.precision):
            parts = self.losses(batch, masked)
        (self.combine(parts, for_gradient=True) * scale).backward()
        return self.report(parts)

    def export(self, path: Path) -> None:
        """Save the backbone alone as a densekit encoder (CLS pooling)."""
        self.mlm.export(path, self.config.model.max_length)


TASKS: Registry[type[PretrainTask]] = Registry("pre-training method", lambda cls: cls.name)
# `@register_objective` registers an objective under its `name`; `TASKS.named` finds it, an unknown name
# an error that lists the known ones
register_objective = TASKS.register
