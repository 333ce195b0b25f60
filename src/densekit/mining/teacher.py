"""`densekit score`: a teacher's (cross-encoder's) score for every positive and negative of training
examples, written into their `teacher_scores`, for distillation.

Scoring is resumable. Examples are scored a chunk at a time and each finished chunk is appended to a
work file beside the output (`.NAME.scoring.jsonl`), whose first line records what the scores are made
from: the teacher's weights, its length limit and precision, the examples file and the corpus. A rerun
with the same record continues after the last whole chunk; one with another record starts again. The
output is written atomically once every example is scored, and the work file is then removed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from densekit.data.dataset import Dataset
from densekit.data.examples import EXAMPLES_KIND, check_example_ids, read_examples, write_examples
from densekit.device import Precision
from densekit.diagnostics import Diagnostics
from densekit.io.atomic import write_text_atomic
from densekit.io.fingerprint import file_digest
from densekit.io.lock import holding
from densekit.io.outputs import OutputError, check_file_output
from densekit.models.cross_encoder import CrossEncoder
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

WORK_MARK = "densekit teacher scores in progress"


def work_file(output: Path) -> Path:
    """Where scoring keeps the chunks it has finished."""
    return output.with_name(f".{output.name}.scoring.jsonl")


def _finished_chunks(path: Path, identity: dict[str, Any]) -> list[list[dict[str, float]]]:
    """The chunks a previous run finished for this very identity; a work file made for another identity
    is removed (densekit made it), and a torn last line (a killed write) is cut off."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = {}
    if header.get("densekit") != WORK_MARK:
        raise OutputError(f"{path} is in the way and densekit did not write it: move it or write elsewhere")
    if header.get("identity") != identity:
        log.info("%s was made for other inputs or another teacher: scoring starts again", path)
        path.unlink()
        return []
    chunks = []
    for line in lines[1:]:
        try:
            chunks.append(json.loads(line)["scores"])
        except (json.JSONDecodeError, KeyError, TypeError):
            break
    whole = "\n".join(lines[: 1 + len(chunks)]) + "\n"
    if whole != "\n".join(lines):
        write_text_atomic(path, whole)
    if chunks:
        log.info("resuming: %d chunks scored by an earlier run", len(chunks))
    return chunks


@holding("output")
def score_examples(
    cross_encoder: CrossEncoder,
    examples_path: Path,
    dataset: Dataset,
    output: Path,
    batch_size: int = 32,
    chunk_examples: int = 64,
    show_progress: bool = True,
    on_chunk: Callable[[int], None] | None = None,
    precision: Precision = "float32",
    overwrite: bool = False,
) -> int:
    """Write `examples_path`'s examples to `output` with `teacher_scores` holding the cross-encoder's
    score of the query with each positive and negative (scores the input had are replaced); returns
    the number of pairs scored by this call, at `precision`. `on_chunk(i)` is called after chunk `i`
    is saved. A file scored by another teacher or from other examples is replaced only with
    `overwrite`."""
    examples_path, output = Path(examples_path), Path(output)
    check_file_output(output, EXAMPLES_KIND, [examples_path, dataset.root])
    diagnostics = Diagnostics()
    examples = read_examples(examples_path, diagnostics)
    wanted = {doc for e in examples for doc in (*e.positives, *e.negatives)}
    texts = {d.id: d.full_text for d in dataset.iter_corpus() if d.id in wanted}
    check_example_ids(examples_path, examples, texts, diagnostics)
    replaced = sum(1 for e in examples if e.teacher_scores)
    if replaced:
        log.warning("%d examples of %s had teacher scores; they are replaced", replaced, examples_path)

    identity = {
        "teacher": cross_encoder.fingerprint(),
        "max_length": cross_encoder.max_length,
        "examples": file_digest(examples_path),
        "corpus": dataset.corpus_digest(),
        "chunk_examples": chunk_examples,
        "precision": precision,
    }
    check_file_output(output, EXAMPLES_KIND, [examples_path, dataset.root], identity, overwrite)
    work = work_file(output)
    chunks = _finished_chunks(work, identity)
    if not chunks:
        write_text_atomic(work, json.dumps({"densekit": WORK_MARK, "identity": identity}) + "\n")
    starts = range(0, len(examples), chunk_examples)
    total_pairs = sum(len(e.positives) + len(e.negatives) for e in examples)
    done_pairs = sum(len(scores) for chunk in chunks for scores in chunk)
    scored = 0
    with (
        progress_bar("scoring", total_pairs, show_progress, completed=done_pairs) as advance,
        work.open("a", encoding="utf-8") as handle,
    ):
        for number, start in enumerate(starts):
            if number < len(chunks):
                continue
            part = examples[start : start + chunk_examples]
            pairs = [(e.query, texts[d]) for e in part for d in (*e.positives, *e.negatives)]
            values = iter(cross_encoder.score(pairs, batch_size, advance, precision).tolist())
            chunk = [{d: next(values) for d in (*e.positives, *e.negatives)} for e in part]
            handle.write(json.dumps({"scores": chunk}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
            chunks.append(chunk)
            scored += len(pairs)
            if on_chunk is not None:
                on_chunk(number)
    scores = [docs for chunk in chunks for docs in chunk]
    write_examples(
        output,
        (e.model_copy(update={"teacher_scores": s}) for e, s in zip(examples, scores, strict=True)),
        [examples_path, dataset.root],
        identity,
        overwrite,
    )
    work.unlink()
    return scored
