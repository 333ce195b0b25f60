"""A test collection on disk: a corpus, queries and relevance judgements per split.

Two layouts are read, told apart by which corpus file the folder holds:

- BEIR: `corpus.jsonl`, `queries.jsonl`, `qrels/<split>.tsv`;
- MS MARCO-style TSV: `collection.tsv` (`id<TAB>text` or `id<TAB>title<TAB>text`), queries in
  `queries.<split>.tsv` or one `queries.tsv`, judgements in TREC's four-column `qrels.<split>.tsv`.

Any of these files may be gzip-compressed (`corpus.jsonl.gz`, `qrels/test.tsv.gz`...): it is read
streaming and known by its content (`densekit.data.collection_files`); a folder holding a file both
plain and compressed is refused as ambiguous.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from densekit.data.collection_files import (
    COMPRESSED_SUFFIX,
    content_digest,
    plain_name,
    reported_as_damage,
    stored_file,
)
from densekit.data.jsonl import iter_jsonl_corpus, read_jsonl_queries
from densekit.data.lines import count_nonblank_lines
from densekit.data.named import resolve_collection
from densekit.data.records import Document, Qrels
from densekit.data.trec import Judgement, check_judged_ids, read_judgements, to_qrels
from densekit.data.tsv import iter_tsv_corpus, read_tsv_queries
from densekit.diagnostics import DataError, Diagnostics, Problem
from densekit.io.artefact import path_fingerprint
from densekit.io.fingerprint import digest_of

Layout = Literal["beir", "tsv"]
_CORPUS_FILES: dict[Layout, str] = {"beir": "corpus.jsonl", "tsv": "collection.tsv"}


@dataclass
class Dataset:
    """A collection folder in either layout; reading is lazy and the corpus is streamed."""

    root: Path
    layout: Layout
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    _digests: dict[Path, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def open(cls, root: Path | str, diagnostics: Diagnostics | None = None) -> Dataset:
        """Open the collection at `root` (or the cached folder of a name such as `irds:beir/nfcorpus/test`,
        `densekit.data.named`), raising `DataError` if it is in neither layout."""
        root = resolve_collection(root)
        if not root.is_dir():
            raise DataError([Problem(root, None, "not a folder")])
        layout = collection_layout(root)
        if layout is None:
            raise DataError(
                [
                    Problem(
                        root,
                        None,
                        "no corpus found: expected corpus.jsonl (BEIR layout) or collection.tsv "
                        "(MS MARCO-style layout), either one plain or gzip-compressed (.gz)",
                    )
                ]
            )
        dataset = cls(root, layout, diagnostics or Diagnostics())
        dataset.fingerprint_files()  # refuses a file held both plain and compressed before any work
        return dataset

    def _file(self, relative: str) -> Path:
        """The collection's file `relative` as it is stored (plain or `.gz`); the plain name when it is
        absent, for a message to name."""
        where = self.root / relative
        return stored_file(where.parent, where.name) or where

    @property
    def corpus_path(self) -> Path:
        """The corpus file."""
        return self._file(_CORPUS_FILES[self.layout])

    def queries_path(self, split: str | None = None) -> Path:
        """The file holding the queries of `split` (BEIR keeps every split's queries in one file)."""
        if self.layout == "beir":
            return self._file("queries.jsonl")
        per_split = self._file(f"queries.{split}.tsv")
        return per_split if split is not None and per_split.is_file() else self._file("queries.tsv")

    def qrels_path(self, split: str) -> Path:
        """The judgements file of `split`."""
        return self._file(f"qrels/{split}.tsv" if self.layout == "beir" else f"qrels.{split}.tsv")

    def splits(self) -> list[str]:
        """The splits that have judgements, sorted."""
        if self.layout == "beir":
            names = [plain_name(p) for p in _tsv_files(self.root / "qrels", "*")]
            return sorted({name[: -len(".tsv")] for name in names})
        names = [plain_name(p) for p in _tsv_files(self.root, "qrels.*")]
        return sorted({name[len("qrels.") : -len(".tsv")] for name in names})

    def digest(self, path: Path) -> str:
        """The digest of one of the collection's files, its content's when it is compressed (so a plain
        and a compressed copy of one file share it), computed once per `Dataset`."""
        if path not in self._digests:
            self._digests[path] = content_digest(path)
        return self._digests[path]

    def corpus_digest(self) -> str:
        """The digest of the corpus's content (computed once per `Dataset`)."""
        return self.digest(self.corpus_path)

    def digest_files(self, files: list[Path]) -> str:
        """One digest of some of the collection's files, each by its content and its name as stored
        plain: a folder of compressed files and one of the same files plain have the same."""
        named = {p.relative_to(self.root).with_name(plain_name(p)).as_posix(): self.digest(p) for p in files}
        return digest_of(named)

    def fingerprint_files(self) -> list[Path]:
        """Every file densekit reads here: the corpus, the queries, every split's judgements."""
        files = [self.corpus_path, *self._query_files(), *(self.qrels_path(s) for s in self.splits())]
        return [p for p in files if p.is_file()]

    def fingerprint(self) -> str:
        """One digest of every file densekit reads here (`fingerprint_files`). Other files in the folder
        (outputs written into it) do not count."""
        return self.digest_files(self.fingerprint_files())

    def _query_files(self) -> list[Path]:
        if self.layout == "beir":
            return [self.queries_path()]
        names = sorted({plain_name(p) for p in _tsv_files(self.root, "queries*")})
        return [self._file(name) for name in names]

    def iter_corpus(self) -> Iterator[Document]:
        """Stream the corpus in file order; warnings (empty texts) come when it ends."""
        reader = iter_jsonl_corpus if self.layout == "beir" else iter_tsv_corpus
        path = self.corpus_path
        with reported_as_damage(path):
            yield from reader(path, self.diagnostics)

    def count_documents(self) -> int:
        """The number of documents, counted without parsing them."""
        return count_nonblank_lines(self.corpus_path)

    def queries(self, split: str | None = None) -> dict[str, str]:
        """Every query in the queries file of `split`."""
        path = self.queries_path(split)
        reader = read_jsonl_queries if self.layout == "beir" else read_tsv_queries
        with reported_as_damage(path):
            return reader(path, self.diagnostics)

    def judgements(self, split: str) -> list[Judgement]:
        """The judgements of `split` with their lines; a missing split names the ones there are."""
        path = self.qrels_path(split)
        if not path.is_file():
            available = ", ".join(self.splits()) or "none"
            raise DataError([Problem(path, None, f"split {split!r} not found; splits here: {available}")])
        with reported_as_damage(path):
            return read_judgements(path, self.diagnostics)

    def qrels(self, split: str) -> Qrels:
        """The judgements of `split` as `{query id: {doc id: relevance}}`."""
        return to_qrels(self.judgements(split))

    def split_queries(self, split: str) -> tuple[dict[str, str], Qrels]:
        """The queries judged in `split` with their judgements; every judged query must exist."""
        judgements = self.judgements(split)
        queries = self.queries(split)
        check_judged_ids(
            self.qrels_path(split),
            judgements,
            queries,
            "query_id",
            self.queries_path(split),
            self.diagnostics,
        )
        qrels = to_qrels(judgements)
        return {qid: queries[qid] for qid in qrels}, qrels


def input_fingerprint(path: Path | str) -> str:
    """A run input's fingerprint: a collection folder by the files densekit reads from it (so outputs
    written into it do not count, and a collection's name by its cached folder), anything else by its
    bytes (see `path_fingerprint`)."""
    path = resolve_collection(path)
    if path.is_dir() and collection_layout(path) is not None:
        return Dataset.open(path).fingerprint()
    return path_fingerprint(path)


def collection_layout(root: Path) -> Layout | None:
    """The layout of the collection folder `root` by the corpus file it holds (plain or compressed),
    None when it holds none; both layouts' corpora, or one corpus both plain and compressed, are
    refused as ambiguous."""
    found = [layout for layout, name in _CORPUS_FILES.items() if stored_file(root, name) is not None]
    if len(found) > 1:
        raise DataError(
            [Problem(root, None, "holds both corpus.jsonl and collection.tsv; keep one corpus a folder")]
        )
    return found[0] if found else None


def _tsv_files(folder: Path, stem: str) -> list[Path]:
    """The files `<stem>.tsv` and `<stem>.tsv.gz` of `folder` (`stem` a glob pattern)."""
    patterns = (f"{stem}.tsv", f"{stem}.tsv{COMPRESSED_SUFFIX}")
    return [path for pattern in patterns for path in folder.glob(pattern) if path.is_file()]
