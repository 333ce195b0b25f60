"""Slices of a collection that keep its judgements: N documents holding every document judged in the
chosen splits, the others drawn with a seed, so slices of several sizes share their queries.

The draw orders the unjudged documents by a seeded hash of their ids and takes the first ones, so a
smaller slice with the same seed and splits is a subset of a larger one (slices are nested), and the
draw does not depend on the corpus's order. The corpus is streamed twice (once to find the ids and
their hashes, once to write what is kept), holding an 8-byte hash per document and the judged ids.

A slice is a BEIR folder written atomically: `corpus.jsonl` (gzip-compressed, `corpus.jsonl.gz`, when
the source's corpus is: it takes the space the source would), `queries.jsonl` with the queries judged
in the kept splits, and `qrels/<split>.tsv` for each. Its manifest (`densekit-artefact.json`, kind
`collection slice`) records what it was cut from: the source's digest and folder, the size, the seed
and the splits.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from densekit.data.collection_files import COMPRESSED_SUFFIX, is_compressed
from densekit.data.dataset import Dataset
from densekit.data.records import Qrels
from densekit.errors import DensekitError, StateError
from densekit.io.artefact import artefact_dir, read_manifest, verify
from densekit.io.outputs import claim_folder

log = logging.getLogger("densekit")

KIND = "collection slice"
# How the unjudged documents are ordered; recorded in the identity, so another draw is never reused.
DRAW = "blake2b-64 of the seed and the id, smallest first"
_ENTRIES = ("corpus.jsonl", f"corpus.jsonl{COMPRESSED_SUFFIX}", "queries.jsonl", "qrels")
_MAX_SEED = 2**63


class SliceError(DensekitError, ValueError):
    """A slice that cannot be cut as asked (too small for the judged documents, larger than the corpus)."""


@dataclass(frozen=True)
class CollectionSlice:
    """Where a slice went and what it holds."""

    folder: Path
    documents: int
    judged: int
    queries: int
    reused: bool


def slice_collection(
    source: Path | str,
    size: int,
    output: Path | str,
    splits: list[str] | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> CollectionSlice:
    """Write `output`, a slice of `size` documents of the collection `source` (a folder or a name) that
    keeps every document judged in `splits` (all of its splits by default) and draws the others with
    `seed`. The same slice already there is reused; another is replaced only with `overwrite`, and a
    folder densekit did not make never. `size` below the judged documents, or above the corpus, is
    refused in one line."""
    if not 0 <= seed < _MAX_SEED:
        raise SliceError(f"--seed {seed}: give a whole number from 0 to {_MAX_SEED - 1}")
    dataset = Dataset.open(source)
    chosen = sorted(set(splits or dataset.splits()))
    if not chosen:
        raise SliceError(f"{dataset.root}: no judgements (qrels) to keep; a slice keeps a split's judgements")
    judged_queries = {split: dataset.split_queries(split) for split in chosen}
    identity = {"source": dataset.fingerprint(), "size": size, "seed": seed, "splits": chosen, "draw": DRAW}
    state = claim_folder(output, KIND, identity, [dataset.root], overwrite, _ENTRIES)
    if state == "matching" and not overwrite and _intact(Path(output)):
        kept = read_manifest(output).about  # type: ignore[union-attr]  # claim_folder read one
        queries = sum(len(queries) for queries, _ in judged_queries.values())
        return CollectionSlice(Path(output), size, kept["judged"], queries, reused=True)

    judged = {doc for _, qrels in judged_queries.values() for docs in qrels.values() for doc in docs}
    draw = _Draw(seed)
    present, keys = _scan(dataset, judged, draw)
    total = len(keys) + len(present)
    _check_size(dataset, size, len(present), total, chosen)
    threshold, at_threshold = _threshold(keys, size - len(present))
    about = {"source": str(source), "source_folder": str(dataset.root.resolve()),
             "source_documents": total, "judged": len(present)}  # fmt: skip
    compressed = is_compressed(dataset.corpus_path)
    with artefact_dir(output, KIND, identity, about) as tmp:
        corpus = tmp / ("corpus.jsonl" + (COMPRESSED_SUFFIX if compressed else ""))
        with _text_writer(corpus, compressed) as out:
            written = _write_corpus(dataset, judged, draw, threshold, at_threshold, out)
        if written != size:
            message = f"changed while it was sliced: {written} documents kept, not {size}"
            raise StateError(f"{dataset.corpus_path} {message}")
        queries = _write_queries(tmp, judged_queries)
    log.info("%s: %d documents (%d judged) of %d, %d queries", output, size, len(present), total, queries)
    return CollectionSlice(Path(output), size, len(present), queries, reused=False)


class _Draw:
    """The seeded order of the unjudged documents: a 64-bit hash of the seed and the id."""

    def __init__(self, seed: int):
        self.key = seed.to_bytes(8, "big")

    def __call__(self, doc_id: str) -> int:
        digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8, key=self.key).digest()
        return int.from_bytes(digest, "big")


def _intact(folder: Path) -> bool:
    """True when the slice's files still match their checksums; a damaged slice is made again."""
    try:
        verify(folder)
    except DensekitError as err:
        log.warning("%s; cutting the slice again", str(err).splitlines()[0])
        return False
    return True


def _scan(dataset: Dataset, judged: set[str], draw: _Draw) -> tuple[set[str], array]:
    """The first pass: the judged ids the corpus holds, and the draw's key of every other document."""
    present: set[str] = set()
    keys = array("Q")
    for document in dataset.iter_corpus():
        if document.id in judged:
            present.add(document.id)
        else:
            keys.append(draw(document.id))
    missing = len(judged) - len(present)
    if missing:
        log.warning("%s: %d judged documents are not in the corpus", dataset.corpus_path, missing)
    return present, keys


def _check_size(dataset: Dataset, size: int, judged: int, total: int, splits: list[str]) -> None:
    if size < judged:
        raise SliceError(
            f"--size {size}: {_splits(splits)} of {dataset.root} judge{'' if len(splits) > 1 else 's'} "
            f"{judged} documents, all of which a slice keeps; give a size of at least {judged}"
        )
    if size > total:
        raise SliceError(f"--size {size}: {dataset.corpus_path} holds only {total} documents")


def _splits(splits: list[str]) -> str:
    return f"split{'s' if len(splits) > 1 else ''} {', '.join(splits)}"


def _threshold(keys: array, wanted: int) -> tuple[int, int]:
    """The largest key taken and how many documents of exactly that key are taken (in corpus order):
    every key below it is taken. (-1, 0) when no unjudged document is."""
    if wanted == 0:
        return -1, 0
    values = np.frombuffer(keys, dtype=np.uint64)
    threshold = int(np.partition(values, wanted - 1)[wanted - 1])
    below = int(np.count_nonzero(values < threshold))
    return threshold, wanted - below


def _write_corpus(
    dataset: Dataset, judged: set[str], draw: _Draw, threshold: int, at_threshold: int, out: IO[str]
) -> int:
    """The second pass: write every judged document and every drawn one, in corpus order."""
    written = 0
    for document in dataset.iter_corpus():
        keep = document.id in judged
        if not keep and threshold >= 0:
            key = draw(document.id)
            keep = key < threshold or (key == threshold and at_threshold > 0)
            at_threshold -= key == threshold and keep
        if keep:
            row = {"_id": document.id, "title": document.title, "text": document.text}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
    return written


@contextmanager
def _text_writer(path: Path, compressed: bool) -> Iterator[IO[str]]:
    """A UTF-8 text file, gzip-compressed when asked, without a time or a name in the gzip header (the
    same slice is the same bytes)."""
    if not compressed:
        with path.open("w", encoding="utf-8") as handle:
            yield handle
        return
    with (
        path.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as packed,
        io.TextIOWrapper(packed, encoding="utf-8", newline="\n") as handle,
    ):
        yield handle


def _write_queries(folder: Path, judged_queries: dict[str, tuple[dict[str, str], Qrels]]) -> int:
    """`queries.jsonl` with every query judged in the kept splits, and each split's judgements."""
    queries: dict[str, str] = {}
    for split, (split_queries, _) in judged_queries.items():
        for query_id, text in split_queries.items():
            if queries.setdefault(query_id, text) != text:
                raise SliceError(f"query {query_id!r} has another text in split {split!r} than in an earlier "
                                 "split; one queries.jsonl cannot hold both")  # fmt: skip
    with (folder / "queries.jsonl").open("w", encoding="utf-8") as out:
        for query_id, text in queries.items():
            out.write(json.dumps({"_id": query_id, "text": text}, ensure_ascii=False) + "\n")
    (folder / "qrels").mkdir()
    for split, (_, qrels) in judged_queries.items():
        lines = ["query-id\tcorpus-id\tscore"]
        lines += [f"{query}\t{doc}\t{grade}" for query, docs in qrels.items() for doc, grade in docs.items()]
        (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(queries)
