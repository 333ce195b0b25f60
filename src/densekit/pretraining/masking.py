"""Masking and sampling mechanics: whole-word MLM masks, span pairs, RetroMAE's decoder attention."""

from __future__ import annotations

import numpy as np

IGNORE = -100


def whole_word_mask(
    token_ids: np.ndarray,
    word_ids: np.ndarray,
    ratio: float,
    rng: np.random.Generator,
    mask_id: int,
    vocab_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask whole words until about `ratio` of the tokens are masked; returns (inputs, labels).

    Words are picked in random order and added while the masked count stays within the target (at
    least one word is always masked). A masked token becomes [MASK] 80% of the time, a random token
    10%, itself 10%, as in BERT; labels hold the original id at masked positions and -100 elsewhere.
    Tokens with word index -1 (special tokens) are never masked.
    """
    inputs = token_ids.copy()
    labels = np.full_like(token_ids, IGNORE)
    maskable = word_ids >= 0
    if not maskable.any():
        return inputs, labels
    words = np.unique(word_ids[maskable])
    target = max(1, round(ratio * int(maskable.sum())))
    chosen = np.zeros(len(token_ids), dtype=bool)
    count = 0
    for word in rng.permutation(words):
        positions = word_ids == word
        size = int(positions.sum())
        if count and count + size > target:
            continue
        chosen |= positions
        count += size
        if count >= target:
            break
    labels[chosen] = token_ids[chosen]
    draw = rng.random(len(token_ids))
    inputs[chosen & (draw < 0.8)] = mask_id
    random_tokens = chosen & (draw >= 0.8) & (draw < 0.9)
    inputs[random_tokens] = rng.integers(vocab_size, size=int(random_tokens.sum()))
    return inputs, labels


def sample_span_pair(
    length: int, span_min: int, span_max: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    """Two random spans `[start, end)` of a document of `length` tokens, each span_min..span_max long.

    A document shorter than `span_min` gives its whole text twice.
    """
    spans = []
    for _ in range(2):
        if length <= span_min:
            spans.append((0, length))
            continue
        size = int(rng.integers(span_min, min(span_max, length) + 1))
        start = int(rng.integers(0, length - size + 1))
        spans.append((start, start + size))
    return spans


def decoder_visibility(length: int, width: int, visible_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """RetroMAE's enhanced-decoding attention for one sequence: which positions each query row sees.

    Returns a bool array (width - 1, width): row r predicts the token at position r + 1; it sees
    position 0 (the sentence embedding) always, never its own position, and each other real position
    (below `length`) with probability `visible_ratio`; padding positions are never seen.
    """
    visible = rng.random((width - 1, width)) < visible_ratio
    rows = np.arange(width - 1)
    visible[rows, rows + 1] = False
    visible[:, length:] = False
    visible[:, 0] = True
    return visible
