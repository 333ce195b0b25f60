"""A few-shot split of a collection: some of a split's judged queries to fit on, the rest to test on.

The split is written as a collection folder of its own, so every command reads it as it reads any
other: `corpus.jsonl` and `queries.jsonl` (or `corpus.jsonl.gz`...: as the original stores them) are
links to the original's files (same bytes, so indexes of the original corpus serve it), and `qrels/`
holds the two new splits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from densekit.data.dataset import Dataset
from densekit.data.records import Qrels
from densekit.errors import InputError, SettingError
from densekit.io.artefact import artefact_dir
from densekit.io.outputs import claim_folder

KIND = "query split"
FIT, HELD_OUT = "fit", "held-out"
_ENTRIES = ("corpus.jsonl", "corpus.jsonl.gz", "queries.jsonl", "queries.jsonl.gz", "qrels")


@dataclass(frozen=True)
class QuerySplit:
    """Where the split went and how many queries each side holds."""

    folder: Path
    fit: int
    held_out: int
    reused: bool


def split_judged_queries(
    data: Path | str, split: str, take: int, seed: int, output: Path | str, overwrite: bool = False
) -> QuerySplit:
    """Write `output`, a view of the BEIR collection `data` whose `fit` split holds `take` of `split`'s
    judged queries (drawn with `seed`) and whose `held-out` split holds the others, every judgement of
    a query kept on its side. The same split already there is reused; another is replaced only with
    `overwrite`, and a folder densekit did not make never."""
    dataset = Dataset.open(data)
    if dataset.layout != "beir":
        raise InputError(f"{dataset.root}: splitting queries needs a BEIR folder (corpus.jsonl and queries)")
    _, qrels = dataset.split_queries(split)  # every judged query must exist
    judged = sorted(qrels)
    if not 0 < take < len(judged):
        raise SettingError(
            f"--take {take}: split {split!r} of {dataset.root} has {len(judged)} judged queries; "
            f"take between 1 and {len(judged) - 1}"
        )
    identity = {
        "corpus": dataset.corpus_digest(),
        "queries": dataset.digest(dataset.queries_path(split)),
        "qrels": dataset.digest(dataset.qrels_path(split)),
        "split": split,
        "take": take,
        "seed": seed,
    }
    sizes = {"fit": take, "held_out": len(judged) - take}
    if claim_folder(output, KIND, identity, [dataset.root], overwrite, _ENTRIES) == "matching":
        return QuerySplit(Path(output), **sizes, reused=True)
    chosen = set(random.Random(seed).sample(judged, take))
    with artefact_dir(output, KIND, identity, {"source": str(dataset.root.resolve())}) as tmp:
        for original in (dataset.corpus_path, dataset.queries_path(split)):
            (tmp / original.name).symlink_to(original.resolve())
        (tmp / "qrels").mkdir()
        _write_qrels(tmp / "qrels" / f"{FIT}.tsv", {q: qrels[q] for q in judged if q in chosen})
        _write_qrels(tmp / "qrels" / f"{HELD_OUT}.tsv", {q: qrels[q] for q in judged if q not in chosen})
    return QuerySplit(Path(output), **sizes, reused=False)


def _write_qrels(path: Path, qrels: Qrels) -> None:
    lines = ["query-id\tcorpus-id\tscore"]
    lines += [f"{query}\t{doc}\t{grade}" for query, docs in qrels.items() for doc, grade in docs.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
