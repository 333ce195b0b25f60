"""A test collection on disk: a corpus, queries and relevance judgements per split.

Two layouts are read, told apart by which corpus file the folder holds:

- BEIR: `corpus.jsonl`, `queries.jsonl`, `qrels/<split>.tsv`;
- MS MARCO-style TSV: `collection.tsv` (`id<TAB>text` or `id<TAB>title<TAB>text`), queries in
  `queries.<split>.tsv` or one `queries.tsv`, judgements in TREC's four-column `qrels.<split>.tsv`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from densekit.data.jsonl import iter_jsonl_corpus, read_jsonl_queries
from densekit.data.lines import count_nonblank_lines
from densekit.data.named import resolve_collection
from densekit.data.records import Document, Qrels
from densekit.data.trec import Judgement, check_judged_ids, read_judgements, to_qrels
from densekit.data.tsv import iter_tsv_corpus, read_tsv_queries
from densekit.diagnostics import DataError, Diagnostics, Problem
from densekit.io.artefact import path_fingerprint
from densekit.io.fingerprint import digest_of, file_digest

Layout = Literal["beir", "tsv"]


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
        has_beir = (root / "corpus.jsonl").is_file()
        has_tsv = (root / "collection.tsv").is_file()
        if has_beir and has_tsv:
            raise DataError(
                [Problem(root, None, "holds both corpus.jsonl and collection.tsv; keep one corpus a folder")]
            )
        if not (has_beir or has_tsv):
            raise DataError(
                [
                    Problem(
                        root,
                        None,
                        "no corpus found: expected corpus.jsonl (BEIR layout) or collection.tsv "
                        "(MS MARCO-style layout)",
                    )
                ]
            )
        return cls(root, "beir" if has_beir else "tsv", diagnostics or Diagnostics())

    @property
    def corpus_path(self) -> Path:
        """The corpus file."""
        return self.root / ("corpus.jsonl" if self.layout == "beir" else "collection.tsv")

    def queries_path(self, split: str | None = None) -> Path:
        """The file holding the queries of `split` (BEIR keeps every split's queries in one file)."""
        if self.layout == "beir":
            return self.root / "queries.jsonl"
        per_split = self.root / f"queries.{split}.tsv"
        return per_split if split is not None and per_split.is_file() else self.root / "queries.tsv"

    def qrels_path(self, split: str) -> Path:
        """The judgements file of `split`."""
        if self.layout == "beir":
            return self.root / "qrels" / f"{split}.tsv"
        return self.root / f"qrels.{split}.tsv"

    def splits(self) -> list[str]:
        """The splits that have judgements, sorted."""
        if self.layout == "beir":
            return sorted(p.stem for p in (self.root / "qrels").glob("*.tsv"))
        return sorted(p.name[len("qrels.") : -len(".tsv")] for p in self.root.glob("qrels.*.tsv"))

    def digest(self, path: Path) -> str:
        """The digest of one of the collection's files, computed once per `Dataset`."""
        if path not in self._digests:
            self._digests[path] = file_digest(path)
        return self._digests[path]

    def corpus_digest(self) -> str:
        """The digest of the corpus file's bytes (computed once per `Dataset`)."""
        return self.digest(self.corpus_path)

    def fingerprint(self) -> str:
        """One digest of every file densekit reads here: the corpus, the queries, every split's
        judgements. Other files in the folder (outputs written into it) do not count."""
        files = [self.corpus_path, *self._query_files(), *(self.qrels_path(s) for s in self.splits())]
        return digest_of({p.relative_to(self.root).as_posix(): self.digest(p) for p in files if p.is_file()})

    def _query_files(self) -> list[Path]:
        if self.layout == "beir":
            return [self.root / "queries.jsonl"]
        return sorted(p for p in self.root.glob("queries*.tsv") if p.is_file())

    def iter_corpus(self) -> Iterator[Document]:
        """Stream the corpus in file order; warnings (empty texts) come when it ends."""
        reader = iter_jsonl_corpus if self.layout == "beir" else iter_tsv_corpus
        yield from reader(self.corpus_path, self.diagnostics)

    def count_documents(self) -> int:
        """The number of documents, counted without parsing them."""
        return count_nonblank_lines(self.corpus_path)

    def queries(self, split: str | None = None) -> dict[str, str]:
        """Every query in the queries file of `split`."""
        path = self.queries_path(split)
        reader = read_jsonl_queries if self.layout == "beir" else read_tsv_queries
        return reader(path, self.diagnostics)

    def judgements(self, split: str) -> list[Judgement]:
        """The judgements of `split` with their lines; a missing split names the ones there are."""
        path = self.qrels_path(split)
        if not path.is_file():
            available = ", ".join(self.splits()) or "none"
            raise DataError([Problem(path, None, f"split {split!r} not found; splits here: {available}")])
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
    if path.is_dir() and ((path / "corpus.jsonl").is_file() or (path / "collection.tsv").is_file()):
        return Dataset.open(path).fingerprint()
    return path_fingerprint(path)
