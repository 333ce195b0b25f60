"""Choosing negatives from a ranked candidate list, and counting what each filter removed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from densekit.data.examples import TrainingExample
from densekit.data.records import Run
from densekit.limits import MAX_RUN_DEPTH


class MiningSettings(BaseModel):
    """Which candidates may become negatives, and how many are kept."""

    model_config = ConfigDict(extra="forbid")

    first_rank: int = Field(10, ge=1, le=MAX_RUN_DEPTH, description="best rank (1-based) a negative may have")
    last_rank: int = Field(200, ge=1, le=MAX_RUN_DEPTH, description="worst rank a negative may have")
    count: int = Field(30, ge=1, description="negatives sampled per query")
    margin: float | None = Field(None, description="drop candidates scoring above (positive score - margin)")
    relative_margin: float | None = Field(
        None,
        gt=0,
        description="drop candidates scoring above the positive's score less (1 - relative_margin) of its "
        "size: positive x relative_margin for a positive score",
    )
    exclude_identical: bool = Field(True, description="drop candidates whose text equals a positive's")
    seed: int = 42

    @model_validator(mode="after")
    def _ranks_ordered(self) -> MiningSettings:
        if self.first_rank > self.last_rank:
            raise ValueError(f"rank range {self.first_rank}-{self.last_rank} is empty")
        return self


@dataclass
class MiningReport:
    """What mining looked at and what each filter took out."""

    queries: int = 0
    candidates: int = 0
    removed_positive: int = 0
    removed_identical_text: int = 0
    removed_margin: int = 0
    sampled: int = 0
    short_queries: list[str] = field(default_factory=list)
    without_terms: list[str] = field(default_factory=list)  # BM25: queries that match no term

    def as_dict(self, settings: MiningSettings, source: str) -> dict:
        """The report as JSON-able data, with the settings that produced it."""
        return {
            "source": source,
            "settings": settings.model_dump(),
            "queries": self.queries,
            "candidates_in_rank_range": self.candidates,
            "removed_positive": self.removed_positive,
            "removed_identical_text": self.removed_identical_text,
            "removed_margin": self.removed_margin,
            "negatives_written": self.sampled,
            "queries_with_fewer_negatives_than_count": len(self.short_queries),
            "examples_of_short_queries": self.short_queries[:20],
            "queries_without_terms": self.without_terms,
        }


def normalised(text: str) -> str:
    """Text compared for identity: case-folded, whitespace collapsed."""
    return " ".join(text.casefold().split())


def choose_negatives(
    examples: list[TrainingExample],
    ranked: Run,
    positive_scores: Mapping[str, Mapping[str, float]],
    texts: Mapping[str, str],
    settings: MiningSettings,
) -> tuple[list[TrainingExample], MiningReport]:
    """Each example with negatives sampled from its candidates in the rank range that pass the filters.

    Ranks count from 1 in the candidate list as retrieved. Positives are always excluded. The margin
    filters compare with the example's lowest-scoring positive, the one a false negative would most
    likely outrank. Sampled negatives are kept in rank order.
    """
    report = MiningReport()
    mined = []
    identity: dict[str, str] = {}  # each text normalised once: the same passages recur across queries

    def normalised_text(doc_id: str) -> str:
        if doc_id not in identity:
            identity[doc_id] = normalised(texts[doc_id])
        return identity[doc_id]

    for index, example in enumerate(examples):
        report.queries += 1
        positives = set(example.positives)
        positive_texts = (
            {normalised_text(p) for p in example.positives} if settings.exclude_identical else set()
        )
        scores = [positive_scores[example.query_id][p] for p in example.positives]
        reference = min(scores) if scores else None
        window = list(ranked.get(example.query_id, {}).items())[settings.first_rank - 1 : settings.last_rank]
        kept = []
        for doc_id, score in window:
            report.candidates += 1
            if doc_id in positives:
                report.removed_positive += 1
            elif positive_texts and normalised_text(doc_id) in positive_texts:
                report.removed_identical_text += 1
            elif reference is not None and _above_margin(score, reference, settings):
                report.removed_margin += 1
            else:
                kept.append(doc_id)
        if len(kept) > settings.count:
            chosen = np.sort(
                np.random.default_rng([settings.seed, index]).choice(len(kept), settings.count, replace=False)
            )
            kept = [kept[i] for i in chosen]
        if len(kept) < settings.count:
            report.short_queries.append(example.query_id)
        report.sampled += len(kept)
        mined.append(example.model_copy(update={"negatives": kept}))
    return mined, report


def _above_margin(score: float, positive: float, settings: MiningSettings) -> bool:
    if settings.margin is not None and score > positive - settings.margin:
        return True
    # below the positive by (1 - r) of its size, whatever its sign: for a score of -0.5 and r = 0.95,
    # the bar is -0.525, not -0.475 (positive x r), which would keep candidates above the positive
    relative = settings.relative_margin
    return relative is not None and score > positive - (1 - relative) * abs(positive)
