"""A document's tokens as model rows: special tokens around them, whole-word masks, padded batches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from densekit.errors import InputError
from densekit.pretraining.masking import whole_word_mask


@dataclass(frozen=True)
class SequenceMaker:
    """The special token ids and limits every pre-training row is built with."""

    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    vocab_size: int
    max_length: int

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, max_length: int, source: str) -> SequenceMaker:
        """Read the ids from `tokenizer`; it must have [CLS], [SEP] and [MASK]."""
        ids = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id
        if None in ids:
            raise InputError(f"{source}: the tokenizer needs [CLS], [SEP] and [MASK] tokens")
        return cls(*ids, tokenizer.pad_token_id or 0, len(tokenizer), max_length)

    def wrap(self, tokens: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`[CLS] tokens [SEP]`, cut to `max_length`, with word index -1 on the special tokens."""
        limit = self.max_length - 2
        ids = np.concatenate([[self.cls_id], tokens[:limit], [self.sep_id]])
        word_ids = np.concatenate([[-1], words[:limit], [-1]])
        return ids, word_ids

    def mask(
        self, ids: np.ndarray, word_ids: np.ndarray, ratio: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """Whole-word masked inputs and their labels (see `whole_word_mask`)."""
        return whole_word_mask(ids, word_ids, ratio, rng, self.mask_id, self.vocab_size)


def pad(rows: list[np.ndarray], value: int) -> torch.Tensor:
    """Rows of different lengths as one (rows, longest) int64 tensor, filled on the right with `value`."""
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)
