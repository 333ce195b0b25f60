"""Fewer dimensions: cutting an encoder's vectors to their first N, and which N a model takes.

A model trained with Matryoshka training (Kusupati et al., 2022; `loss.matryoshka`) packs the most of
what its vectors say into their first dimensions, so that the first N of them, normalised again where
the model normalises, serve as a smaller vector; the widths it was trained for are recorded in its
settings (`EncoderConfig.matryoshka_dims`). Any model's vectors can be cut so, at some cost in quality
where it was not trained for it. `truncated` is the one way densekit cuts vectors: the encoder
(`EncoderConfig.dimensions`), the Matryoshka loss, and whatever cuts saved vectors call it.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import numpy as np
import torch

from densekit.errors import DensekitError

log = logging.getLogger("densekit")

Vectors = TypeVar("Vectors", torch.Tensor, np.ndarray)


class DimensionsError(DensekitError, ValueError):
    """A width the model cannot give: more than its vectors have, or one it was not trained for."""


def truncated(vectors: Vectors, dimensions: int | None, normalize: bool) -> Vectors:
    """The first `dimensions` of each vector (the last axis; all of them for None), L2-normalised when
    `normalize` (the model normalises its vectors). Cutting a normalised vector and normalising it
    again gives what cutting before normalising gives, so this takes an encoder's pooled vectors and its
    finished (saved, indexed) vectors alike; a tensor stays on its device and keeps its graph."""
    cut = vectors if dimensions is None else vectors[..., :dimensions]
    if not normalize:
        return cut
    if isinstance(cut, torch.Tensor):
        return torch.nn.functional.normalize(cut, p=2, dim=-1)
    # as torch's normalize does: a zero vector stays zero
    return cut / np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12)


def check_dimensions(
    dimensions: int,
    width: int,
    trained: list[int] | None,
    source: str,
    setting: str = "--dimensions",
    warn: bool = True,
    ordered: bool = False,
) -> int | None:
    """The `dimensions` setting to encode with, for a model of `source` whose vectors are `width` wide
    and that was trained for the widths `trained` (None: not recorded): None for the full width (the
    model's own vectors, whatever it was trained for). A width above it, or a narrower one the model was
    not trained for where it records them, raises `DimensionsError`; a narrower one where it records
    none is logged as a warning when `warn` (not for each request of a service), unless the model's
    dimensions are `ordered` by a corpus's variance (`densekit rotate`), which any narrower width suits.
    Messages name the width as `setting` (where it was given)."""
    if dimensions > width:
        raise DimensionsError(
            f"{setting} {dimensions}: {source} makes {width}-dimensional vectors; choose {width} or fewer"
        )
    if dimensions == width:
        return None
    if trained is not None and dimensions not in trained:
        widths = ", ".join(map(str, trained))
        raise DimensionsError(
            f"{setting} {dimensions}: {source} was trained (Matryoshka) for {widths} dimensions; "
            "choose one of those"
        )
    if trained is None and warn and not ordered:
        log.warning(
            "%s %d: %s records no Matryoshka training, so its vectors cut to %d of their %d dimensions "
            "may lose much of their quality (docs/training.md, Matryoshka training)",
            setting, dimensions, source, dimensions, width,
        )  # fmt: skip
    return dimensions
