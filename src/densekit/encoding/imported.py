"""Embeddings made elsewhere: a float32 `.npy` of one row per document, in corpus order, becomes an
embedding folder that `index` and `search` take exactly as they take one `encode` made.

The folder's identity is `encode`'s for the model the user names (its weights' fingerprint and every
setting), the corpus's digest, one shard and no MaxP, plus `imported`: the digest of the vectors. So it
is never taken for an encoding of another model or corpus, nor for one of `encode`'s (which refuses
it), and an index built from it records which vectors it holds. Everything is checked from the file's
header and the ids before the vectors are read; they are then copied a chunk at a time, each read
through a memory map of its own, hashed as they are written, into a folder that takes its place
atomically.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from densekit.data.dataset import Dataset
from densekit.data.lines import iter_lines
from densekit.diagnostics import DataError, Problem
from densekit.encoding.corpus import embedding_identity
from densekit.encoding.store import KIND, part_stem
from densekit.io.artefact import MANIFEST, is_artefact, new_manifest
from densekit.io.atomic import TEMPORARY, atomic_dir
from densekit.io.fingerprint import file_digest
from densekit.io.npy import NpyHeader, iter_row_chunks, read_npy_header
from densekit.io.outputs import OutputError, check_not_input
from densekit.models.encoder import DenseEncoder
from densekit.progress import progress_bar

CHUNK_ROWS = 65536


def import_embeddings(
    encoder: DenseEncoder,
    dataset: Dataset,
    vectors: Path | str,
    output: Path | str,
    ids: Path | str | None = None,
    overwrite: bool = False,
    show_progress: bool = True,
    chunk_rows: int = CHUNK_ROWS,
) -> Path:
    """Make the embedding folder `output` from `vectors` (a float32 `.npy` of shape (rows, dimension),
    row i the vector of the i-th id) for `dataset`'s corpus, as made by `encoder`; returns `output`.

    `ids` (one a line) must be the corpus's ids in corpus order; without it the rows are taken to be in
    corpus order. Each problem is a `DataError` naming its file, raised before the vectors are read:
    a file that is not a 2-D float32 array, a width other than the encoder's, rows other than the ids
    or the documents, ids out of corpus order. `output` may be new or empty; an embedding folder of
    densekit's is replaced only with `overwrite`; nothing else is written over, nor any input.
    """
    vectors, output = Path(vectors), Path(output)
    ids = Path(ids) if ids is not None else None
    check_not_input(output, [dataset.root, vectors, *([ids] if ids else []), encoder.source])
    _check_output(output, overwrite)
    header = _checked_header(vectors, encoder)
    rows, dimension = header.shape
    if ids is not None:
        given = sum(1 for _ in _id_lines(ids))
        if given != rows:
            raise DataError([Problem(ids, None, f"{given} ids for the {rows} rows of {vectors}")])
    documents = dataset.count_documents()
    if documents != rows:
        message = f"{rows} rows, but {dataset.corpus_path} holds {documents} documents: one row a document"
        raise DataError([Problem(vectors, None, message)])
    identity = embedding_identity(encoder, dataset, 1, None)
    with atomic_dir(output, may_replace=lambda existing: overwrite and is_artefact(existing, KIND)) as tmp:
        stem = tmp / part_stem(0, 1)
        _write_ids(stem.with_suffix(".ids"), dataset, ids)
        digest = _copy_vectors(vectors, header, stem.with_suffix(".npy"), chunk_rows, show_progress)
        identity = {**identity, "imported": {"vectors": digest}}
        checksums = {"npy": digest, "ids": file_digest(stem.with_suffix(".ids"))}
        meta = {"identity": identity, "dimension": dimension, "rows": rows, "first_row": 0,
                "corpus_rows": documents, "checksums": checksums}  # fmt: skip
        stem.with_suffix(".json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        about = {"model": encoder.source, "corpus": str(dataset.corpus_path), "imported": str(vectors)}
        (tmp / MANIFEST).write_text(new_manifest(KIND, identity, None, about).to_json(), encoding="utf-8")
    return output


def _check_output(output: Path, overwrite: bool) -> None:
    """Refuse, before any work, an output that is a file, a folder densekit did not make as embeddings,
    one it did without `overwrite`, or one holding anything an embedding folder does not."""
    if output.is_symlink() or (output.exists() and not output.is_dir()):
        raise OutputError(f"{output} exists and is not a folder; give a new or empty folder")
    if not output.exists() or all(TEMPORARY.match(child.name) for child in output.iterdir()):
        return
    if not is_artefact(output, KIND):
        raise OutputError(f"{output} holds files densekit did not make as embeddings; choose another folder")
    if not overwrite:
        raise OutputError(f"{output} holds embeddings already; pass --overwrite to replace them")
    foreign = [c.name for c in output.iterdir() if not (c.name.startswith("part-") or c.name == MANIFEST)]
    if foreign:
        raise OutputError(f"{output} also holds {', '.join(sorted(foreign))}, which densekit did not make; "
                          "move it away first, or choose another folder")  # fmt: skip


def _checked_header(vectors: Path, encoder: DenseEncoder) -> NpyHeader:
    """The header of `vectors`, refused unless it announces a 2-D float32 array of the encoder's width."""
    if not vectors.is_file():
        raise DataError([Problem(vectors, None, "file not found")])
    try:
        header = read_npy_header(vectors)
    except ValueError as err:
        raise DataError([Problem(vectors, None, f"not a readable .npy file: {err}")]) from None
    if header.dtype.kind != "f" or header.dtype.itemsize != 4:
        message = f"holds {header.dtype} values, not float32; convert it (numpy: array.astype('float32'))"
        raise DataError([Problem(vectors, None, message)])
    if len(header.shape) != 2:
        message = f"holds a {header.describe()} array; expected 2-D: (rows, dimension)"
        raise DataError([Problem(vectors, None, message)])
    if header.shape[1] != encoder.dimension:
        message = f"{header.shape[1]}-dimensional vectors, but {encoder.source} makes {encoder.dimension}"
        raise DataError([Problem(vectors, None, message)])
    return header


def _write_ids(path: Path, dataset: Dataset, ids: Path | None) -> None:
    """Write the corpus's ids, in order, to `path`, checking that `ids` (if given) holds the same."""
    with path.open("w", encoding="utf-8") as out:
        given = _id_lines(ids) if ids is not None else None
        for position, document in enumerate(dataset.iter_corpus(), start=1):
            if given is not None:
                line, text = next(given)
                if text != document.id:
                    message = (f"id {text!r}, but document {position} of {dataset.corpus_path} is "
                               f"{document.id!r}: the rows must be in corpus order")  # fmt: skip
                    raise DataError([Problem(ids, line, message)])
            out.write(f"{document.id}\n")


def _id_lines(path: Path) -> Iterator[tuple[int, str]]:
    """`(line, id)` for each line of an ids file, stripped of whitespace; a line that is blank (or only
    whitespace, U+00A0 included) is an error naming it, so that counting the ids and reading them agree."""
    for line, text in iter_lines(path):
        if not text.strip():
            raise DataError([Problem(path, line, "blank id: give one document id a line, no blank lines")])
        yield line, text.strip()


def _copy_vectors(source: Path, header: NpyHeader, target: Path, chunk_rows: int, show_progress: bool) -> str:
    """Copy the rows of `source` into a new little-endian, C-order float32 `.npy` at `target`, chunk by
    chunk (`iter_row_chunks`), refusing a row holding NaN or an infinity; returns `target`'s digest."""
    rows = header.shape[0]
    digest = hashlib.sha256()
    with target.open("wb") as out, progress_bar(f"importing {source.name}", rows, show_progress) as advance:
        head = io.BytesIO()
        layout = {"descr": "<f4", "fortran_order": False, "shape": header.shape}
        np.lib.format.write_array_header_1_0(head, layout)
        out.write(head.getvalue())
        digest.update(head.getvalue())
        for start, rows_read in iter_row_chunks(source, header, chunk_rows):
            chunk = np.ascontiguousarray(rows_read, dtype="<f4")
            bad = ~np.isfinite(chunk).all(axis=1)
            if bad.any():
                row = start + int(np.argmax(bad))
                what = "NaN" if np.isnan(chunk[row - start]).any() else "an infinite value"
                raise DataError([Problem(source, None, f"row {row} holds {what}")])
            out.write(chunk.data)
            digest.update(chunk.data)
            advance(len(chunk))
    return f"sha256:{digest.hexdigest()}"
