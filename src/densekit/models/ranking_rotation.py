"""A rotation refined so that a model's cut vectors rank a corpus as its full-width vectors do.

The principal directions (`rotation.fit_rotation`) keep the most of the vectors' squared length in
their first N, which is not the same as keeping their rankings: a direction every vector shares holds
much of the length and ranks nothing. This fit starts from them and turns the rotation, kept
orthogonal (so full-width scores do not change), to make each cut width's scores of an anchor's
candidates match the full width's: the KL divergence from the full width's softmax over them (at
`TEMPERATURE`, the fine-tuning recipes' own) to each cut width's, summed over `widths`, as Starbucks
aligns its sub-models with the full model (Zhuang et al., 2024, arXiv:2410.13230). Each anchor's
candidates are its `NEIGHBOURS` nearest corpus vectors at full width and `RANDOM_CANDIDATES` drawn
from the corpus for each batch. Anchors are query vectors where the user has queries (no relevance
labels are read), the corpus vectors otherwise.

One tenth of the anchors is held out; the rotation kept is the one with the lowest loss on them, and
the fit stops after `PATIENCE` checks without a lower one, so no evaluation data chooses the steps.
Written here because no library fits an orthogonal matrix to a ranking loss; the rotation is
`start @ matrix_exp(A - A.T)`, which is orthogonal for every A.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from densekit.errors import InputError
from densekit.models.dimensions import truncated

TEMPERATURE = 0.05
NEIGHBOURS = 64
RANDOM_CANDIDATES = 512
BATCH = 256
LEARNING_RATE = 1e-3
MAX_STEPS = 400
CHECK_EVERY = 25
PATIENCE = 4
HELD_OUT_SHARE = 0.1
MIN_ANCHORS = 20
CHUNK = 512


@dataclass(frozen=True)
class RankingFit:
    """The refined orthogonal `matrix` (a vector `v` is rotated to `v @ matrix`), the `steps` taken to
    it and the held-out loss at the start and at the matrix kept."""

    matrix: np.ndarray
    steps: int
    start_loss: float
    loss: float


def fit_ranking_rotation(
    start: np.ndarray,
    anchors: np.ndarray,
    candidates: np.ndarray,
    widths: Sequence[int],
    normalise: bool,
    seed: int,
    anchor_rows: np.ndarray | None = None,
    max_steps: int = MAX_STEPS,
) -> RankingFit:
    """Refine the orthogonal `start` (d x d) so that the first `widths` dimensions of rotated vectors
    rank `candidates` (rows x d) for `anchors` (queries x d) as all d do; cut vectors are renormalised
    where `normalise` (as the model normalises). Where the anchors are corpus vectors, `anchor_rows`
    gives each one's row among the candidates, left out of its own candidates. Seeded by `seed`; at
    most `max_steps` steps."""
    dimension = start.shape[0]
    if any(not 0 < width < dimension for width in widths) or not widths:
        raise InputError(f"widths {list(widths)}: each must be above 0 and below the {dimension} dimensions")
    if len(anchors) < MIN_ANCHORS:
        raise InputError(f"{len(anchors)} anchors: a ranking fit needs at least {MIN_ANCHORS}")
    if len(candidates) <= NEIGHBOURS:
        raise InputError(f"{len(candidates)} corpus vectors: a ranking fit needs more than {NEIGHBOURS}")
    generator = torch.Generator().manual_seed(seed)
    corpus = torch.from_numpy(np.ascontiguousarray(candidates, dtype=np.float32))
    queries = torch.from_numpy(np.ascontiguousarray(anchors, dtype=np.float32))
    neighbours = _nearest(queries, corpus, anchor_rows)
    order = torch.randperm(len(queries), generator=generator)
    held = order[: max(1, int(len(queries) * HELD_OUT_SHARE))]
    fitted = order[len(held) :]
    held_random = torch.randint(len(corpus), (RANDOM_CANDIDATES,), generator=generator)
    base = torch.from_numpy(np.asarray(start, dtype=np.float32))
    skew = torch.zeros(dimension, dimension, requires_grad=True)
    optimiser = torch.optim.Adam([skew], lr=LEARNING_RATE)
    sizes = (tuple(widths), normalise)

    def held_loss() -> float:
        with torch.no_grad():
            rotation = base @ torch.linalg.matrix_exp(skew - skew.T)
            held_candidates = corpus[neighbours[held]]
            return _loss(rotation, queries[held], held_candidates, corpus[held_random], *sizes).item()

    best_loss = start_loss = held_loss()
    best, best_step, checks_without_gain = skew.detach().clone(), 0, 0
    for step in range(1, max_steps + 1):
        rows = fitted[torch.randint(len(fitted), (min(BATCH, len(fitted)),), generator=generator)]
        drawn = torch.randint(len(corpus), (RANDOM_CANDIDATES,), generator=generator)
        rotation = base @ torch.linalg.matrix_exp(skew - skew.T)
        loss = _loss(rotation, queries[rows], corpus[neighbours[rows]], corpus[drawn], *sizes)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % CHECK_EVERY:
            continue
        now = held_loss()
        if now < best_loss:
            best_loss, best, best_step, checks_without_gain = now, skew.detach().clone(), step, 0
        else:
            checks_without_gain += 1
            if checks_without_gain >= PATIENCE:
                break
    with torch.no_grad():
        matrix = (base @ torch.linalg.matrix_exp(best - best.T)).double().numpy()
    return RankingFit(matrix, best_step, start_loss, best_loss)


def _nearest(queries: torch.Tensor, corpus: torch.Tensor, anchor_rows: np.ndarray | None) -> torch.Tensor:
    """Each query's `NEIGHBOURS` highest-scoring corpus rows at full width, its own row left out."""
    found = []
    for first in range(0, len(queries), CHUNK):
        scores = queries[first : first + CHUNK] @ corpus.T
        if anchor_rows is not None:
            own = torch.from_numpy(np.asarray(anchor_rows[first : first + CHUNK], dtype=np.int64))
            scores[torch.arange(len(own)), own] = -torch.inf
        found.append(scores.topk(NEIGHBOURS, dim=1).indices)
    return torch.cat(found)


def _loss(
    rotation: torch.Tensor,
    queries: torch.Tensor,
    neighbours: torch.Tensor,
    drawn: torch.Tensor,
    widths: tuple[int, ...],
    normalise: bool,
) -> torch.Tensor:
    """The mean over `queries` of the KL divergence from the full width's softmax over each query's
    `neighbours` (queries x NEIGHBOURS x d) and the `drawn` rows to each cut width's, summed over
    `widths`."""

    def scores(q: torch.Tensor, near: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.einsum("qd,qkd->qk", q, near), q @ other.T], dim=1) / TEMPERATURE

    teacher = F.log_softmax(scores(queries, neighbours, drawn), dim=1)
    turned = (queries @ rotation, neighbours @ rotation, drawn @ rotation)
    total = torch.zeros(())
    for width in widths:
        cut = [truncated(part, width, normalise) for part in turned]
        student = F.log_softmax(scores(*cut), dim=1)
        total = total + F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    return total
