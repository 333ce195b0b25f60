"""Encoding a corpus (or one shard of it) into an embedding folder, resumably."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densekit.data.dataset import Dataset
from densekit.data.records import Document
from densekit.device import Precision
from densekit.encoding.embed import embed_texts
from densekit.encoding.passages import MaxPSettings, PassageSplitter
from densekit.encoding.runtimes import needs_calibration, use_backend
from densekit.encoding.store import KIND, PART_PATTERNS, complete_part, part_stem
from densekit.errors import InputError, StateError
from densekit.io.artefact import write_folder_manifest
from densekit.io.atomic import write_text_atomic
from densekit.io.lock import hold
from densekit.io.npy import float32_rows_writer, read_npy_header
from densekit.io.outputs import claim_folder
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice
from densekit.progress import progress_bar

log = logging.getLogger("densekit")


@dataclass(frozen=True)
class Shard:
    """Part `index` of `count` equal contiguous slices of the corpus."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """Read `i/n` (0 <= i < n)."""
        try:
            index, count = (int(x) for x in text.split("/"))
        except ValueError:
            raise InputError(f"shard {text!r} is not of the form i/n, e.g. 0/4") from None
        if not 0 <= index < count:
            raise InputError(f"shard {text!r}: need 0 <= i < n")
        return cls(index, count)

    def bounds(self, total: int) -> tuple[int, int]:
        """The corpus rows [start, end) of this shard."""
        return total * self.index // self.count, total * (self.index + 1) // self.count


def embedding_identity(
    encoder: DenseEncoder,
    dataset: Dataset,
    shards: int,
    maxp: MaxPSettings | None,
    precision: Precision = "float32",
    module: ModuleChoice = OWN,
) -> dict:
    """What an embedding folder records of what made it (the encoder with `module`), and what a resumed
    or reused part must match: with a backend or precision other than PyTorch's float32, that too
    (`inference`, `DenseEncoder.artefact_identity`)."""
    identity = {
        "model": encoder.passage_identity(module),
        "corpus": dataset.corpus_digest(),
        "shards": shards,
        "maxp": maxp.model_dump() if maxp is not None else None,
    }
    return encoder.artefact_identity(identity, precision)


def use_corpus_backend(encoder: DenseEncoder, backend: str, precision: str, dataset: Dataset) -> Precision:
    """`runtimes.use_backend` for encoding `dataset`'s passages: an export that is calibrated
    (`runtimes.needs_calibration`) is calibrated on documents spread over its corpus."""
    calibration = None
    if needs_calibration(backend, precision):
        from densekit.encoding.openvino_backend import calibration_texts

        calibration = {"passage": calibration_texts(dataset)}
    return use_backend(encoder, backend, precision, ["passage"], calibration=calibration)


def encode_corpus(
    encoder: DenseEncoder,
    dataset: Dataset,
    output: Path,
    shard: Shard = Shard(),
    batch_size: int = 64,
    precision: Precision = "float32",
    chunk_size: int = 4096,
    show_progress: bool = True,
    maxp: MaxPSettings | None = None,
    overwrite: bool = False,
    module: ModuleChoice = OWN,
) -> Path:
    """Encode `shard` of the corpus into `output` and return the part's metadata file.

    Rows are written into the part's `.npy` as each chunk of `chunk_size` rows is done, and the count
    of finished rows is saved after each chunk: a killed run started again with the same arguments
    continues from the last finished chunk. A part already complete is reused only when the folder was
    made by the same model weights, settings and corpus bytes; a folder of another encoding is refused
    (naming what differs) unless `overwrite`, which removes its parts first. With `maxp`, each document
    of the shard is cut into passages and each passage is a row (a first pass over the shard counts
    them, so the corpus is still streamed). The part is locked while it is written (`densekit.io.lock`),
    so a second run on it is refused; other shards of the folder may be encoded at the same time.
    Passages are encoded with `module` (by default the encoder's own).
    """
    output = Path(output)
    with hold(output / part_stem(shard.index, shard.count)):
        return _encode_part(encoder, dataset, output, shard, batch_size, precision, chunk_size,
                            show_progress, maxp, overwrite, encoder.chosen(module))  # fmt: skip


def _encode_part(
    encoder: DenseEncoder,
    dataset: Dataset,
    output: Path,
    shard: Shard,
    batch_size: int,
    precision: Precision,
    chunk_size: int,
    show_progress: bool,
    maxp: MaxPSettings | None,
    overwrite: bool,
    module: str | None,
) -> Path:
    """`encode_corpus`, with the part's lock held."""
    identity = embedding_identity(encoder, dataset, shard.count, maxp, precision, module)
    about = {"model": encoder.source, "corpus": str(dataset.corpus_path)}
    state = claim_folder(output, KIND, identity, [dataset.root, encoder.source], overwrite, PART_PATTERNS)
    output.mkdir(parents=True, exist_ok=True)
    if state == "new":
        write_folder_manifest(output, KIND, identity, about)
    stem = output / part_stem(shard.index, shard.count)
    meta_file = stem.with_suffix(".json")
    if meta_file.is_file():
        log.info("%s is already complete (same model, settings and corpus)", meta_file)
        return meta_file

    total = dataset.count_documents()
    start, end = shard.bounds(total)
    splitter = PassageSplitter(encoder, maxp) if maxp is not None else None

    def units() -> Iterator[Document]:
        documents = itertools.islice(dataset.iter_corpus(), start, end)
        return splitter.split_all(documents) if splitter is not None else documents

    rows = sum(1 for _ in units()) if splitter is not None else end - start
    meta = {
        "identity": identity,
        "dimension": encoder.dimension,
        "rows": rows,
        "first_row": start,
        "corpus_rows": total,
    }
    partial = stem.with_name(stem.name + ".partial.npy")
    progress_file = stem.with_name(stem.name + ".progress.json")
    done = _resume_point(progress_file, partial, meta)
    if done:
        log.info("resuming %s at row %d of %d", stem.name, done, rows)
    documents = units()
    ids: list[str] = []
    with (
        float32_rows_writer(partial, rows, encoder.dimension, resume=done > 0) as write_rows,
        progress_bar(f"encoding {stem.name}", rows, show_progress, completed=done) as advance,
    ):
        for chunk_start in range(0, rows, chunk_size):
            chunk = list(itertools.islice(documents, chunk_size))
            ids.extend(doc.id for doc in chunk)
            if chunk_start + len(chunk) <= done:
                continue
            vectors = embed_texts(
                encoder,
                [d.full_text for d in chunk],
                "passage",
                batch_size,
                precision,
                advance,
                module=module,
            )
            write_rows(chunk_start, vectors)  # on disk before the progress file says they are
            write_text_atomic(progress_file, json.dumps({**meta, "done": chunk_start + len(chunk)}))
    if len(ids) != rows:
        raise StateError(f"{dataset.corpus_path} changed while it was encoded: {len(ids)} rows, not {rows}")
    meta_file = complete_part(output, shard.index, shard.count, partial, ids, meta)
    progress_file.unlink(missing_ok=True)
    return meta_file


def _resume_point(progress_file: Path, partial: Path, meta: dict) -> int:
    """Rows already encoded by an earlier run with the same model, settings and corpus, else 0."""
    if not (progress_file.is_file() and partial.is_file()):
        return 0
    saved = json.loads(progress_file.read_text(encoding="utf-8"))
    done = saved.pop("done", 0)
    if saved != json.loads(json.dumps(meta)):
        log.warning("%s was made by another model, setting or corpus; starting over", partial)
        return 0
    try:
        header = read_npy_header(partial)
    except ValueError:
        header = None
    if header is None or (header.shape, header.dtype) != ((meta["rows"], meta["dimension"]), np.float32):
        log.warning("%s is not the %d x %d float32 matrix its progress file describes; starting over",
                    partial, meta["rows"], meta["dimension"])  # fmt: skip
        return 0
    return int(done)
