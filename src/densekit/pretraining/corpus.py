"""The raw text pre-training reads, tokenized once with word boundaries for whole-word masking."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from densekit.data.dataset import Dataset
from densekit.data.lines import iter_lines
from densekit.diagnostics import DataError, Problem
from densekit.errors import InputError
from densekit.progress import progress_bar

log = logging.getLogger("densekit")


def read_texts(path: Path) -> list[str]:
    """Documents from a collection folder (title + text) or a text file holding one document a line.

    Blank lines of a text file are skipped and counted in a warning.
    """
    path = Path(path)
    if path.is_dir():
        return [doc.full_text for doc in Dataset.open(path).iter_corpus()]
    texts, blank = [], []
    for lineno, line in iter_lines(path):
        if line.strip():
            texts.append(line)
        else:
            blank.append(lineno)
    if blank:
        log.warning(
            "%s: %d blank lines skipped (lines %s)", path, len(blank), ", ".join(map(str, blank[:10]))
        )
    if not texts:
        raise DataError([Problem(path, None, "no documents")])
    return texts


@dataclass
class TokenizedCorpus:
    """Token ids of every document (no special tokens) and each token's word index."""

    token_ids: list[np.ndarray]
    word_ids: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.token_ids)


def tokenize_corpus(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, max_tokens: int | None, show_progress: bool = True
) -> TokenizedCorpus:
    """Tokenize without special tokens, keeping at most `max_tokens` per document (all when None)."""
    if not tokenizer.is_fast:
        raise InputError("pre-training needs a fast tokenizer, for the word boundaries of whole-word masking")
    # A copy of the tokenizers backend, without the truncation and padding its file may set: whole
    # documents are tokenized on purpose (spans are cut later), which transformers' wrapper would warn of.
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    token_ids, word_ids = [], []
    batch = 1024
    with progress_bar("tokenizing", len(texts), show_progress) as advance:
        for start in range(0, len(texts), batch):
            encodings = backend.encode_batch(texts[start : start + batch], add_special_tokens=False)
            for encoding in encodings:
                if max_tokens is not None:
                    encoding.truncate(max_tokens)
                token_ids.append(np.asarray(encoding.ids, dtype=np.int64))
                words = [-1 if w is None else w for w in encoding.word_ids]
                word_ids.append(np.asarray(words, dtype=np.int64))
            advance(len(encodings))
    empty = sum(len(ids) == 0 for ids in token_ids)
    if empty:
        log.warning("%d documents have no tokens; they are trained on as empty sequences", empty)
    return TokenizedCorpus(token_ids, word_ids)
