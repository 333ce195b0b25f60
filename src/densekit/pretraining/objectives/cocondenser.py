"""coCondenser (Gao & Callan, 2022): Condenser plus a corpus-level contrast between spans.

A batch holds two random spans of each of its documents (rows 2k and 2k + 1); each span's late CLS
must pick its sibling among the 2n - 1 other spans, gathered from every process. Loss = Condenser's
+ contrastive_weight x contrastive. With `grad_cache`, the contrast over a large batch is computed
chunk by chunk (see `densekit.training.grad_cache`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from densekit.device import autocast
from densekit.errors import InputError
from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.base import register_objective
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.masking import sample_span_pair
from densekit.pretraining.objectives.condenser import CondenserTask
from densekit.pretraining.settings import PretrainSettings
from densekit.training import distributed
from densekit.training.config import Section
from densekit.training.grad_cache import cached_backward, split_inputs

log = logging.getLogger("densekit")


class CoCondenserSection(Section):
    """coCondenser's corpus-level span contrast."""

    span_min: int = Field(32, ge=4, description="fewest tokens in a span (special tokens excluded)")
    span_max: int = Field(128, ge=4)
    temperature: float = Field(1.0, gt=0)
    contrastive_weight: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> CoCondenserSection:
        if self.span_min > self.span_max:
            raise ValueError("span_min is larger than span_max")
        return self


def span_contrastive_loss(cls: torch.Tensor, temperature: float) -> torch.Tensor:
    """coCondenser's corpus-level loss: each span's CLS must pick its sibling (rows 2k and 2k+1).

    Spans are gathered from every process, so every process computes the same, global loss.
    """
    gathered = distributed.gather_with_grad(cls)
    if gathered.dtype in (torch.float16, torch.bfloat16):
        gathered = gathered.float()
    scores = gathered @ gathered.T / temperature
    scores = scores.masked_fill(torch.eye(len(scores), dtype=torch.bool, device=scores.device), float("-inf"))
    siblings = torch.arange(len(scores), device=scores.device) ^ 1
    return F.cross_entropy(scores, siblings)


def warn_if_spans_overlap(corpus: TokenizedCorpus, span_min: int, span_max: int) -> None:
    """Warn when the median document is so short that its two spans, on average longer than half
    of it, nearly always overlap: the contrast then matches shared tokens and is learnt without shaping
    the embedding space (measured on Vaswani, benchmarks/README.md)."""
    median = int(np.median([len(ids) for ids in corpus.token_ids]))
    if (span_min + min(span_max, median)) / 2 > median / 2:
        log.warning(
            "cocondenser: the median document has %d tokens and spans of %d-%d tokens cover more than "
            "half of it, so its two spans nearly always overlap; choose span_min and span_max so that "
            "a span is well under half a document (about a query's length)",
            median, span_min, span_max,
        )  # fmt: skip


@register_objective
class CoCondenserTask(CondenserTask):
    """Condenser's losses over two spans of each document, plus their contrast. It takes Condenser's
    settings (`condenser:`) as well as its own; its spans come from anywhere in a whole document, and
    `grad_cache` computes its contrast chunk by chunk."""

    name = "cocondenser"
    settings = CoCondenserSection
    whole_documents = True
    takes_grad_cache = True

    @classmethod
    def check(cls, config: PretrainSettings) -> None:
        """Refuse spans that, with their two special tokens, do not fit a sequence."""
        if config.cocondenser.span_max + 2 > config.model.max_length:
            raise InputError("cocondenser.span_max + 2 special tokens exceed model.max_length")

    def __init__(self, mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainSettings):
        super().__init__(mlm, corpus, config)
        warn_if_spans_overlap(corpus, config.cocondenser.span_min, config.cocondenser.span_max)

    def pieces(
        self, tokens: np.ndarray, words: np.ndarray, rng: np.random.Generator
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Two random spans of the document, each as its own sequence."""
        settings = self.config.cocondenser
        return [
            self.sequences.wrap(tokens[start:end], words[start:end])
            for start, end in sample_span_pair(len(tokens), settings.span_min, settings.span_max, rng)
        ]

    def losses(self, batch: dict[str, torch.Tensor], masked: float) -> dict[str, torch.Tensor]:
        """Condenser's two MLM losses and the span contrast."""
        parts, cls = self.condenser_losses(batch, masked)
        parts["contrastive"] = span_contrastive_loss(cls, self.config.cocondenser.temperature)
        return parts

    def loss_weights(self, for_gradient: bool) -> dict[str, float]:
        """Condenser's weights and the contrast's. For the gradient, the contrast over the gathered
        batch is weighted for the average of gradients (`distributed.gathered_loss_weight`); the MLM
        losses are each process's own and are averaged as they are."""
        world = distributed.gathered_loss_weight() if for_gradient else 1
        return {
            **super().loss_weights(for_gradient),
            "contrastive": self.config.cocondenser.contrastive_weight * world,
        }

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, float]:
        """As for every objective, or chunk by chunk with gradient caching."""
        if not self.config.grad_cache.enabled:
            return super().forward_backward(batch, scale)
        return self._cached(*self.on_device(batch), scale)

    def _cached(self, batch: dict[str, torch.Tensor], masked: float, scale: float) -> dict[str, float]:
        condenser, device, precision = self.module, self.device, self.config.optim.precision
        weight, temperature = self.config.cocondenser.contrastive_weight, self.config.cocondenser.temperature
        late_weight = self.config.condenser.late_mlm_weight
        head_total = torch.zeros((), dtype=torch.float64, device=device)
        late_total = torch.zeros((), dtype=torch.float64, device=device)

        def encode(chunk: dict[str, torch.Tensor], with_chunk_loss: bool):
            with autocast(device, precision):
                if not with_chunk_loss:
                    return condenser.late_cls(chunk["input_ids"], chunk["attention_mask"]), None
                head_sum, late_sum, cls = condenser(
                    chunk["input_ids"], chunk["attention_mask"], chunk["labels"]
                )
            head_total.add_(head_sum.detach())
            late_total.add_(late_sum.detach())
            return cls, scale * (head_sum + late_weight * late_sum) / masked

        global_weight = scale * weight * distributed.gathered_loss_weight()
        contrastive, _ = cached_backward(
            [(encode, split_inputs(batch, self.config.grad_cache.chunk_size))],
            lambda cls: global_weight * span_contrastive_loss(cls, temperature),
            device,
        )
        parts = {
            "mlm_head": head_total / masked,
            "mlm_late": late_total / masked,
            "contrastive": contrastive / global_weight if global_weight else contrastive,
        }
        return self.report(parts)
