"""Ordering a model's dimensions by a corpus's variance: an orthogonal rotation after its pooling.

Cutting a vector to its first N dimensions keeps what those N carry. A model not trained for it
(Matryoshka training) spreads what its vectors say over all of them; a rotation onto the principal
directions of a corpus's vectors puts the most of them first. The rotation is orthogonal, so every
inner product and norm at full width is unchanged (the model's full-width search is the same), and it
is a linear layer after pooling, saved as sentence-transformers' Dense module, so every tool that cuts
vectors (`--dimensions`, `truncate_dim`) cuts the rotated ones.

The directions are the eigenvectors of the vectors' second moment (not their covariance): the first N
of them are, among all N-dimensional subspaces, the one that keeps the most of the vectors' squared
length, which is what a cut vector keeps of its scores. Written here because the eigenvectors of a d x
d matrix are one `numpy.linalg.eigh`; a PCA library would centre the vectors first, which answers
another question (the spread around the mean), and its components would not rotate the mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from densekit.errors import InputError
from densekit.models.encoder import DenseEncoder
from densekit.models.projection import IDENTITY, Projection


@dataclass(frozen=True)
class Rotation:
    """An orthogonal d x d `matrix` whose columns are the directions, most energy first (a vector `v`
    is rotated to `v @ matrix`), and the `share` of the vectors' squared length each direction holds."""

    matrix: np.ndarray
    share: np.ndarray
    rows: int

    def kept(self, dimensions: int) -> float:
        """The share of the vectors' squared length their first `dimensions` rotated ones keep."""
        return float(self.share[:dimensions].sum())


def fit_rotation(chunks: Iterable[np.ndarray], dimension: int) -> Rotation:
    """The rotation onto the principal directions of the vectors in `chunks` (each rows x `dimension`),
    accumulated in float64; each direction's sign makes its largest entry positive, so the same
    vectors give the same matrix."""
    moment = np.zeros((dimension, dimension), dtype=np.float64)
    rows = 0
    for chunk in chunks:
        block = np.asarray(chunk, dtype=np.float64)
        moment += block.T @ block
        rows += len(block)
    if rows == 0:
        raise InputError("no vectors to fit a rotation on")
    if not np.isfinite(moment).all():
        raise InputError("the vectors hold NaN or infinite values: no rotation can be fitted on them")
    values, vectors = np.linalg.eigh(moment)
    order = np.argsort(values)[::-1]
    values, vectors = np.clip(values[order], 0.0, None), vectors[:, order]
    largest = np.abs(vectors).argmax(axis=0)
    vectors *= np.sign(vectors[largest, np.arange(dimension)])
    total = values.sum()
    share = values / total if total > 0 else np.full(dimension, 1.0 / dimension)
    return Rotation(vectors, share, rows)


def energy_shares(vectors: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """The share of `vectors`' squared length each column of the rotation `matrix` holds."""
    energy = ((np.asarray(vectors, dtype=np.float64) @ matrix) ** 2).sum(axis=0)
    total = energy.sum()
    return energy / total if total > 0 else np.full(len(energy), 1.0 / len(energy))


def put_rotation(encoder: DenseEncoder, rotation: Rotation) -> None:
    """Put `rotation` after `encoder`'s pooling (after its projection, folded into it where that one is
    linear), and record its dimensions as ordered; the Matryoshka widths it records no longer hold, as
    the rotated dimensions mix the ones trained for them, so they are dropped."""
    if rotation.matrix.shape != (encoder.width, encoder.width):
        width = rotation.matrix.shape[0]
        raise InputError(f"a rotation of {width} dimensions for a model of {encoder.width}-wide vectors")
    matrix = torch.from_numpy(rotation.matrix.T.astype(np.float32))  # Linear computes vector @ weight.T
    held = encoder.projection
    if held is None:
        projection = Projection(matrix)
    elif held.activation_name == IDENTITY:
        bias = None if held.linear.bias is None else matrix @ held.linear.bias.detach().float()
        projection = Projection(matrix @ held.linear.weight.detach().float(), bias)
    else:
        raise InputError(
            f"{encoder.source}'s Dense module ends in {held.activation_name}: a rotation after it cannot be "
            "folded into it"
        )
    encoder.projection = projection.to(encoder.device)
    update = {"variance_ordered": True, "matryoshka_dims": None}
    encoder.config = encoder.config.model_copy(update=update)
