"""Training examples: a query with its positive and negative document ids, one JSON object a line.

```json
{"query_id": "q1", "query": "text", "positives": ["d1"], "negatives": ["d7", "d9"],
 "teacher_scores": {"d1": 9.1, "d7": 2.3}, "domain": "scifact"}
```

`negatives` may be empty (in-batch negatives only); `teacher_scores` (document id -> score from a
teacher such as a cross-encoder) and `domain` (which domain the query belongs to, for training one
domain per batch and for routing) are optional. Document ids refer to the corpus of the collection the
training run names; texts are looked up there, so a file stays small and one corpus has one copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from densekit.data.lines import iter_lines
from densekit.data.records import Qrels
from densekit.diagnostics import Diagnostics
from densekit.io.outputs import output_file

log = logging.getLogger("densekit")


class TrainingExample(BaseModel):
    """One query and the documents it is trained against."""

    model_config = ConfigDict(extra="forbid")

    query_id: str
    query: str
    positives: list[str] = Field(min_length=1)
    negatives: list[str] = Field(default_factory=list)
    teacher_scores: dict[str, float] | None = None
    domain: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _no_document_both_ways(self) -> TrainingExample:
        both = sorted(set(self.positives) & set(self.negatives))
        if both:
            raise ValueError(f"document {', '.join(map(repr, both))} is both a positive and a negative")
        return self


def read_examples(path: Path, diagnostics: Diagnostics | None = None) -> list[TrainingExample]:
    """Read a training file; each bad line is an error naming the file, the line and the field."""
    diagnostics = diagnostics or Diagnostics()
    examples = []
    for lineno, line in iter_lines(path):
        if not line.strip():
            diagnostics.error(path, lineno, "blank line")
            continue
        try:
            examples.append(TrainingExample.model_validate_json(line))
        except ValidationError as err:
            first = err.errors()[0]
            message = first["msg"].removeprefix("Value error, ")
            where = ".".join(str(part) for part in first["loc"])
            if first["type"] == "json_invalid":
                message = "malformed JSON"
            diagnostics.error(path, lineno, f"{where}: {message}" if where else message)
    return examples


def check_example_ids(
    path: Path,
    examples: list[TrainingExample],
    known: Container[str] | Callable[[TrainingExample], Container[str]],
    diagnostics: Diagnostics,
) -> None:
    """Report, at the first line naming one, every document id the corpus lacks; `known` is the corpus's
    ids, or gives them per example (examples of several collections)."""
    unknown: dict[str, int] = {}
    for lineno, example in enumerate(examples, start=1):
        ids = known(example) if callable(known) else known
        for doc_id in [*example.positives, *example.negatives]:
            if doc_id not in ids and doc_id not in unknown:
                unknown[doc_id] = lineno
    if unknown:
        listed = ", ".join(f"{d!r} (line {n})" for d, n in list(unknown.items())[:20])
        more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        diagnostics.error(
            path,
            next(iter(unknown.values())),
            f"{len(unknown)} document ids not in the corpus: {listed}{more}",
        )


EXAMPLES_KIND = "training examples"


def write_examples(
    path: Path,
    examples: Iterable[TrainingExample],
    inputs: Iterable[Path | str] = (),
    identity: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> int:
    """Write examples atomically, one a line, as they come, as a file output (see `densekit.io.outputs`)
    recording `identity` (one made from another is replaced only with `overwrite`); returns how many."""
    count = 0
    with output_file(path, EXAMPLES_KIND, identity, inputs=inputs, overwrite=overwrite) as handle:
        for example in examples:
            handle.write(example.model_dump_json(exclude_none=True) + "\n")
            count += 1
    return count


def examples_from_qrels(
    queries: dict[str, str], qrels: Qrels, min_relevance: int = 1, domain: str | None = None
) -> list[TrainingExample]:
    """One example per judged query with its documents of relevance >= `min_relevance` as positives,
    each of `domain` when given.

    Queries with no such document cannot be trained on; their number is logged.
    """
    examples = []
    without = 0
    for query_id, judged in qrels.items():
        positives = [doc for doc, relevance in judged.items() if relevance >= min_relevance]
        if positives:
            examples.append(
                TrainingExample(
                    query_id=query_id, query=queries[query_id], positives=positives, domain=domain
                )
            )
        else:
            without += 1
    if without:
        log.warning(
            "%d judged queries have no document of relevance >= %d and are not trained on",
            without,
            min_relevance,
        )
    return examples
