"""Encoding texts in batches ordered by length, each padded only to its own longest text."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from densekit.device import Precision
from densekit.errors import InputError, StateError
from densekit.inference import infer_in_batches
from densekit.models import padding
from densekit.models.config import TextSide
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice

# (input_ids, attention_mask, the batch's rows among the texts) -> vectors
BatchEncoder = Callable[[torch.Tensor, torch.Tensor, np.ndarray], torch.Tensor]


def embed_texts(
    encoder: DenseEncoder,
    texts: list[str],
    side: TextSide,
    batch_size: int = 64,
    precision: Precision = "float32",
    advance: Callable[[int], None] | None = None,
    encode: BatchEncoder | None = None,
    module: ModuleChoice = OWN,
) -> np.ndarray:
    """Vectors for `texts` in their order, as a float32 array (len(texts), dimension).

    Texts are tokenized once, sorted by token count (longest first, so memory peaks at the start) and
    batched, so padding is small; the encoder stays on whatever device it is on. `encode(input_ids,
    attention_mask, rows)` replaces the encoder's own forward (a route, which needs to know the rows);
    otherwise `module` encodes (by default the encoder's own). With the encoder's `runtime` set
    (`runtimes.use_backend`), batches run through that export, which must have been made with
    `module`; `precision` is then torch's float32.
    """
    _check_batch_size(batch_size)
    token_ids = encoder.tokenize(texts, side) if texts else []
    return embed_tokens(encoder, token_ids, side, batch_size, precision, advance, encode, module)


def embed_tokens(
    encoder: DenseEncoder,
    token_ids: list[list[int]],
    side: TextSide,
    batch_size: int = 64,
    precision: Precision = "float32",
    advance: Callable[[int], None] | None = None,
    encode: BatchEncoder | None = None,
    module: ModuleChoice = OWN,
) -> np.ndarray:
    """`embed_texts` of texts already tokenized by `encoder.tokenize(texts, side)`, for a caller that
    needs the token ids too (the service counts them), so that texts are tokenized once."""
    _check_batch_size(batch_size)
    name = encoder.chosen(module)
    runtime = encoder.runtime
    if runtime is not None:
        if encode is not None:
            raise InputError(
                f"a route encodes through PyTorch: --backend {runtime.backend} does not apply to it"
            )
        if precision != "float32":
            raise InputError(
                f"the encoder runs {runtime.backend} at {runtime.precision}, not torch {precision}"
            )
        if runtime.module != name:
            raise StateError(
                f"the {runtime.backend} export was made with module {runtime.module!r}, not {name!r}: "
                "export it again"
            )
    output = np.empty((len(token_ids), encoder.dimension), dtype=np.float32)
    if not token_ids:
        return output
    device = encoder.device

    def step(rows: np.ndarray) -> None:
        inputs = encoder.pad([token_ids[i] for i in rows])
        input_ids, attention_mask = inputs["input_ids"].to(device), inputs["attention_mask"].to(device)
        if runtime is not None:
            vectors = runtime(input_ids, attention_mask, side)
        elif encode is None:
            vectors = encoder(input_ids, attention_mask, side=side, module=name)
        else:
            vectors = encode(input_ids, attention_mask, rows)
        output[rows] = vectors.float().cpu().numpy()
        if advance is not None:
            advance(len(rows))

    computes_padding = (
        runtime is not None or encode is not None or not encoder.computes_only_tokens(side, name)
    )
    lengths = [len(ids) for ids in token_ids]
    cost = padding.pass_cost(device, computes_padding)
    infer_in_batches(encoder, lengths, batch_size, device, precision, step, cost)
    return output


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise InputError(f"batch size must be at least 1, got {batch_size}")
