"""A cross-encoder: query and passage read together in one sequence, one scalar score.

It is a Hugging Face sequence-classification model with one label: built from any encoder folder (a new
head, initialised at random, is then trained) or loaded from a cross-encoder folder (sentence-transformers'
`CrossEncoder` saves this form). Saved as safetensors with its tokenizer, so sentence-transformers'
`CrossEncoder(path)` loads it and gives the same scores (its `predict` applies a sigmoid unless told
`activation_fn=torch.nn.Identity()`; the ranking is the same).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from densekit.device import Precision
from densekit.diagnostics import DataError, Problem
from densekit.errors import InputError
from densekit.inference import infer_in_batches
from densekit.io.artefact import artefact_dir
from densekit.io.model_card import write_model_card
from densekit.models import padding
from densekit.models.card import cross_encoder_card
from densekit.models.checkpoint_files import (
    check_artefact_kind,
    check_vocabulary,
    load_pretrained,
    load_tokenizer,
)
from densekit.models.fingerprint import weights_fingerprint
from densekit.models.hub import resolve_model_path

log = logging.getLogger("densekit")

KIND = "cross-encoder"
_WANTED = "a cross-encoder folder"
_HINTS = {
    "module": "a module adapts a dense encoder (give it to encode or search); rerank and score take a "
    "cross-encoder, which densekit train-cross-encoder makes",
    "route": "a route chooses among dense modules (give it to search); rerank and score take a "
    "cross-encoder, which densekit train-cross-encoder makes",
}


class CrossEncoder(torch.nn.Module):
    """Scores (query, passage) pairs; `max_length` tokens for the pair (the passage is cut first)."""

    def __init__(self, model: PreTrainedModel, tokenizer, max_length: int = 512, source: str = ""):
        super().__init__()
        if model.config.num_labels != 1:
            raise InputError(
                f"{source}: a cross-encoder gives one score; this model has {model.config.num_labels} labels"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.source = source

    @classmethod
    def load(
        cls,
        path: str | Path,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        require_head: bool = False,
    ) -> CrossEncoder:
        """A cross-encoder from a folder (or hub id): a sequence-classification model with one label,
        or an encoder, which gets a new one-label head, initialised at random (logged), to be trained.
        With `require_head` (scoring: rerank, score) a folder without a trained head is refused: its
        scores would change from one load to the next."""
        folder = resolve_model_path(str(path))
        check_artefact_kind(folder, _WANTED, _HINTS)
        model, report = load_pretrained(
            AutoModelForSequenceClassification, folder, trust_remote_code, num_labels=1
        )
        if report.missing:
            if require_head:
                raise DataError([Problem(Path(folder), None, (
                    f"no trained cross-encoder head (the checkpoint lacks {', '.join(report.missing[:3])}): "
                    "an encoder would get a random head, whose scores change from run to run; give a "
                    "cross-encoder folder (densekit train-cross-encoder makes one)"
                ))])  # fmt: skip
            log.info("%s: new, untrained weights %s", path, ", ".join(report.missing))
        tokenizer = load_tokenizer(folder, trust_remote_code)
        check_vocabulary(tokenizer, model, folder)
        limit = max_length or min(512, int(getattr(model.config, "max_position_embeddings", 512)))
        return cls(model, tokenizer, limit, str(path))

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor
    ) -> torch.Tensor:
        """One score per row."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits[:, 0]

    def tokenize(self, queries: list[str], passages: list[str]) -> list[dict[str, list[int]]]:
        """Each pair as the model reads it, unpadded, the passage cut first to fit."""
        encoded = self.tokenizer(queries, passages, truncation="longest_first", max_length=self.max_length)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
        return [{k: encoded[k][i] for k in keys} for i in range(len(queries))]

    def score(
        self,
        pairs: list[tuple[str, str]],
        batch_size: int = 32,
        advance: Callable[[int], None] | None = None,
        precision: Precision = "float32",
    ) -> np.ndarray:
        """Scores of the pairs in their order; batches are drawn longest first, each padded to its own
        longest pair. `precision` bf16 or fp16 scores under mixed precision (fp16 on a GPU only)."""
        scores = np.empty(len(pairs), dtype=np.float32)
        if not pairs:
            return scores
        encoded = self.tokenize([q for q, _ in pairs], [p for _, p in pairs])

        def step(rows: np.ndarray) -> None:
            batch = self.tokenizer.pad([encoded[i] for i in rows], return_tensors="pt")
            batch = {k: v.to(self.device) for k, v in batch.items()}
            scores[rows] = self(**batch).float().cpu().numpy()
            if advance is not None:
                advance(len(rows))

        lengths = [len(e["input_ids"]) for e in encoded]
        infer_in_batches(
            self, lengths, batch_size, self.device, precision, step, padding.pass_cost(self.device)
        )
        return scores

    def fingerprint(self) -> str:
        """A digest of the weights and the tokenizer."""
        return weights_fingerprint([self.model], self.tokenizer)

    def save(self, path: str | Path) -> None:
        """Save as a Hugging Face folder (safetensors) that sentence-transformers' CrossEncoder loads."""
        identity = {"weights": self.fingerprint(), "max_length": self.max_length}
        with artefact_dir(path, KIND, identity, {"source": self.source}) as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
        write_model_card(path, cross_encoder_card(Path(path), self.source, self.max_length))
