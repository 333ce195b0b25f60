"""Pre-training as a trainer task: batches of masked sequences (or span pairs) and each method's loss."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from densekit.encoding.device import autocast
from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.condenser import Condenser
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.masking import IGNORE, decoder_visibility, sample_span_pair, whole_word_mask
from densekit.pretraining.retromae import RetroMAE
from densekit.training import distributed
from densekit.training.grad_cache import cached_backward, split_inputs
from densekit.training.sampling import local_batch_rows

log = logging.getLogger("densekit")


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


class PretrainTask:
    """Batches and losses of one pre-training method, for the shared trainer."""

    def __init__(self, mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainConfig):
        self.mlm = mlm
        self.corpus = corpus
        self.config = config
        tokenizer = mlm.tokenizer
        self.cls_id, self.sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        self.mask_id, self.pad_id = tokenizer.mask_token_id, tokenizer.pad_token_id or 0
        if None in (self.cls_id, self.sep_id, self.mask_id):
            raise ValueError(f"{mlm.source}: the tokenizer needs [CLS], [SEP] and [MASK] tokens")
        self.vocab_size = len(tokenizer)
        method = config.method
        if method in ("condenser", "cocondenser"):
            self.module: torch.nn.Module = Condenser(mlm, config.condenser)
        elif method == "retromae":
            self.module = RetroMAE(mlm, config.retromae)
        else:
            self.module = mlm
        if method == "cocondenser":
            warn_if_spans_overlap(corpus, config.cocondenser.span_min, config.cocondenser.span_max)
        if len(corpus) < config.optim.batch_size:
            raise ValueError(f"{len(corpus)} documents are fewer than one batch of {config.optim.batch_size}")

    def steps_per_epoch(self) -> int:
        """Global batches per epoch."""
        return len(self.corpus) // self.config.optim.batch_size

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.module.parameters()).device

    def _sequence(self, tokens: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        limit = self.config.model.max_length - 2
        ids = np.concatenate([[self.cls_id], tokens[:limit], [self.sep_id]])
        word_ids = np.concatenate([[-1], words[:limit], [-1]])
        return ids, word_ids

    def _masked(self, ids: np.ndarray, words: np.ndarray, ratio: float, rng: np.random.Generator):
        return whole_word_mask(ids, words, ratio, rng, self.mask_id, self.vocab_size)

    def _pad(self, rows: list[np.ndarray], value: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        out = np.full((len(rows), width), value, dtype=np.int64)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return torch.from_numpy(out)

    def batch(self, epoch: int, step: int) -> dict[str, torch.Tensor]:
        """This process's part of global batch `step` of `epoch`; masks depend only on (seed, epoch, doc)."""
        config = self.config
        inputs, labels, originals, decoder_inputs, decoder_labels, lengths = [], [], [], [], [], []
        visibility = []
        for doc in local_batch_rows(len(self.corpus), config.optim.batch_size, epoch, step, config.seed):
            rng = np.random.default_rng([config.seed, epoch, int(doc)])
            tokens, words = self.corpus.token_ids[doc], self.corpus.word_ids[doc]
            if config.method == "cocondenser":
                pieces = [
                    self._sequence(tokens[start:end], words[start:end])
                    for start, end in sample_span_pair(
                        len(tokens), config.cocondenser.span_min, config.cocondenser.span_max, rng
                    )
                ]
            else:
                pieces = [self._sequence(tokens, words)]
            for ids, word_ids in pieces:
                masked, masked_labels = self._masked(ids, word_ids, config.masking.ratio, rng)
                inputs.append(masked)
                labels.append(masked_labels)
                originals.append(ids)
                lengths.append(len(ids))
                if config.method == "retromae":
                    if config.retromae.decoding == "basic":
                        dec_in, dec_labels = self._masked(
                            ids, word_ids, config.retromae.decoder_mask_ratio, rng
                        )
                    else:
                        dec_in, dec_labels = ids, np.where(np.arange(len(ids)) == 0, IGNORE, ids)
                    decoder_inputs.append(dec_in)
                    decoder_labels.append(dec_labels)
                    visibility.append(rng)
        batch = {
            "input_ids": self._pad(inputs, self.pad_id),
            "labels": self._pad(labels, IGNORE),
            "attention_mask": self._pad([np.ones(n, dtype=np.int64) for n in lengths], 0),
        }
        if config.method == "retromae":
            width = batch["input_ids"].shape[1]
            batch["decoder_input_ids"] = self._pad(decoder_inputs, self.pad_id)
            batch["decoder_labels"] = self._pad(decoder_labels, IGNORE)
            batch["decoder_visible"] = torch.from_numpy(
                np.stack(
                    [
                        decoder_visibility(n, width, config.retromae.visible_ratio, rng)
                        for n, rng in zip(lengths, visibility, strict=True)
                    ]
                )
            )
        return batch

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, float]:
        """Compute the method's loss times `scale`, back-propagate it, and return its parts."""
        device, precision = self.device, self.config.optim.precision
        batch = {k: v.to(device) for k, v in batch.items()}
        masked = max(1, int((batch["labels"] != IGNORE).sum()))
        method = self.config.method
        if method == "cocondenser" and self.config.grad_cache.enabled:
            return self._cached_cocondenser(batch, masked, scale)
        with autocast(device, precision):
            if method == "mlm":
                states = self.mlm.backbone(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                )
                parts = {"mlm": self.mlm.mlm_loss_sum(states.last_hidden_state, batch["labels"]) / masked}
            elif method == "retromae":
                encoder_sum, decoder_sum = self.module(batch)
                decoded = max(1, int((batch["decoder_labels"] != IGNORE).sum()))
                parts = {"mlm_encoder": encoder_sum / masked, "decoder": decoder_sum / decoded}
            else:
                head_sum, late_sum, cls = self.module(
                    batch["input_ids"], batch["attention_mask"], batch["labels"]
                )
                parts = {"mlm_head": head_sum / masked, "mlm_late": late_sum / masked}
                if method == "cocondenser":
                    parts["contrastive"] = span_contrastive_loss(cls, self.config.cocondenser.temperature)
        (self._combine(parts, for_gradient=True) * scale).backward()
        return self._report(parts)

    def _combine(self, parts: dict[str, torch.Tensor], for_gradient: bool = False) -> torch.Tensor:
        """The weighted sum of the losses. For the gradient, the global contrastive loss is multiplied by
        the number of processes, which the averaging of gradients over processes divides back out; the
        MLM losses are each process's own and are averaged as they are."""
        weights = {
            "mlm_late": self.config.condenser.late_mlm_weight,
            "contrastive": self.config.cocondenser.contrastive_weight
            * (distributed.world_size() if for_gradient else 1),
        }
        return sum(weights.get(name, 1.0) * value for name, value in parts.items())

    def _report(self, parts: dict[str, torch.Tensor]) -> dict[str, float]:
        return {
            "loss": float(self._combine(parts).detach()),
            **{f"loss_{k}": float(v.detach()) for k, v in parts.items()},
        }

    def _cached_cocondenser(
        self, batch: dict[str, torch.Tensor], masked: int, scale: float
    ) -> dict[str, float]:
        condenser: Condenser = self.module  # type: ignore[assignment]
        device, precision = self.device, self.config.optim.precision
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

        contrastive, _ = cached_backward(
            [(encode, split_inputs(batch, self.config.grad_cache.chunk_size))],
            lambda cls: scale * weight * distributed.world_size() * span_contrastive_loss(cls, temperature),
            device,
        )
        global_weight = scale * weight * distributed.world_size()
        parts = {
            "mlm_head": head_total / masked,
            "mlm_late": late_total / masked,
            "contrastive": contrastive / global_weight if global_weight else contrastive,
        }
        return self._report(parts)

    def export(self, path: Path) -> None:
        """Save the backbone alone as a densekit encoder (CLS pooling)."""
        self.mlm.export(path, self.config.model.max_length)
