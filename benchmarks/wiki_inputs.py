"""What the wiki1m benchmarks (`wiki_quality`, `wiki_ann`) share: the collection at each size, its
passages' vectors taken by id from embeddings the user made (of the whole corpus or of the slice,
never encoded again), its queries' vectors, and a results file saved after every stage, in which a
stage already measured from the same inputs is kept, so that a killed run resumes where it stopped.

A size is `NAME=FOLDER`: a slice cut by `densekit slice` (`runs/wiki/data-wiki-100k`), or the whole
collection (`../shared/data/wiki1m`). Slices of one seed are nested subsets of the collection, so one
embedding folder of the whole corpus holds every slice's passages: a slice's rows are gathered by id,
in the slice's corpus order, into an embedding folder of the slice's own (`import_embeddings`, which
records the model and the slice's corpus digest), kept under the work folder with the identity of
the embeddings it was taken from, and reused while that identity is unchanged. The two benchmarks may
share one work folder (their files do not collide), and so gather each slice and encode the queries
once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import machine_info

log = logging.getLogger("benchmarks.wiki")


def setup_logging() -> None:
    """Progress on standard error, each line with its time; densekit's own lines too, and each value a
    recall target tries (at a million passages they are minutes apart)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    for name in ("benchmarks.wiki", "densekit", "densekit.index.recall"):
        logging.getLogger(name).setLevel(logging.INFO)


MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def wiki_parser(doc: str, benchmark: str, work: Path, holds: str) -> argparse.ArgumentParser:
    """The options both wiki benchmarks take: `--sizes`, `--embeddings`, `--model`, `--batch-size`,
    `--work` (`work` by default; it `holds` what the benchmark keeps there) and `--output`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", required=True, help="NAME=FOLDER: a slice or the collection")
    parser.add_argument("--embeddings", type=Path, required=True,
                        help="an embedding folder of the whole corpus (or of the slice)")  # fmt: skip
    parser.add_argument("--model", default=MODEL, help="the model that made the embeddings")
    parser.add_argument("--batch-size", type=int, default=128, help="queries encoded at once")
    parser.add_argument("--work", type=Path, default=work, help=f"{holds}, sliced embeddings, query vectors")
    parser.add_argument("--output", type=Path, help=f"the results' JSON (default: WORK/{benchmark}.json)")
    return parser


def parse_sizes(values: list[str]) -> dict[str, Path]:
    """`NAME=FOLDER` pairs, in order (`100k=runs/wiki/data-wiki-100k`)."""
    sizes: dict[str, Path] = {}
    for value in values:
        name, _, folder = value.partition("=")
        if not name or not folder:
            raise SystemExit(f"--sizes {value}: give NAME=FOLDER, e.g. 100k=runs/wiki/data-wiki-100k")
        if name in sizes:
            raise SystemExit(f"--sizes: {name} is given twice")
        sizes[name] = Path(folder)
    return sizes


def digest(value: Any) -> str:
    """A short digest of a JSON-able value (its sorted JSON)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def array_digest(array: np.ndarray) -> str:
    """A short digest of an array's shape, type and bytes."""
    hashed = hashlib.sha256(f"{array.shape} {array.dtype}".encode())
    hashed.update(np.ascontiguousarray(array).tobytes())
    return hashed.hexdigest()[:20]


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def resident_mib() -> float:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return round(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def source_identity(store: Any) -> dict[str, Any]:
    """What names an embedding folder's vectors: its identity and each part's checksums."""
    return {"identity": store.identity, "parts": [part.meta.get("checksums") for part in store.parts]}


def vectors_made_by(inference: dict | None) -> str:
    """An embedding folder's `inference` record as "BACKEND PRECISION" (none: torch at float32)."""
    inference = inference or {"backend": "torch", "precision": "float32"}
    return f"{inference['backend']} {inference['precision']}"


def write_array(path: Path, array: np.ndarray) -> None:
    """Save `array` as a `.npy` at `path` atomically."""
    from densekit.io.atomic import atomic_file

    with atomic_file(path, "wb", None) as handle:
        np.save(handle, array)


@dataclass
class Passages:
    """The embeddings given (`--embeddings`), the model that made them, loaded with the settings they
    record (refused unless it made them), and the work folder."""

    folder: Path
    model: str
    work: Path
    batch_size: int = 128

    @cached_property
    def store(self) -> Any:
        """The embedding folder given."""
        from densekit.encoding.store import EmbeddingStore

        return EmbeddingStore.open(self.folder)

    @cached_property
    def encoder(self) -> Any:
        """`model`, with the settings the embeddings record, checked to have made them."""
        from densekit.models import DenseEncoder
        from densekit.retrieval.dense import check_passages_made_by

        settings = self.store.identity["model"]["settings"]
        encoder = DenseEncoder.load(self.model, **settings).eval()
        check_passages_made_by(encoder, self.store.identity, f"{self.folder} was encoded")
        return encoder

    @property
    def made_by(self) -> str:
        """How the embeddings' vectors were computed, as `densekit encode` was asked: "onnx int8",
        "torch float32" (what an identity without `inference` means)."""
        return vectors_made_by(self.store.identity.get("inference"))

    def identity(self) -> dict[str, Any]:
        """What results made from these embeddings depend on: their vectors and the model's name."""
        return {"embeddings": source_identity(self.store), "model": self.model}

    def of(self, name: str, dataset: Any) -> Any:
        """The embedding folder of `dataset`'s corpus: the one given, when it is of that corpus, else
        its rows of the corpus's ids, gathered into `work/name/embeddings`."""
        from densekit.encoding.store import EmbeddingStore

        if self.store.identity["corpus"] == dataset.corpus_digest():
            return self.store
        folder = self.work / name / "embeddings"
        taken_from = {"source": source_identity(self.store), "corpus": dataset.corpus_digest()}
        record = folder.with_name("embeddings.taken-from.json")  # what they were taken from
        if record.is_file() and json.loads(record.read_text(encoding="utf-8")) == taken_from:
            log.info("%s: the slice's vectors, taken from %s before, are kept", folder, self.folder)
            return EmbeddingStore.open(folder)
        self._gather(dataset, folder)
        record.write_text(json.dumps(taken_from, indent=2) + "\n", encoding="utf-8")
        return EmbeddingStore.open(folder)

    def _gather(self, dataset: Any, folder: Path) -> None:
        """Write the vectors of `dataset`'s passages, taken by id from the embeddings given, as the
        embedding folder `folder`; an id they lack is an error naming it."""
        from densekit.encoding.imported import import_embeddings

        start = time.perf_counter()
        wanted = {document.id: row for row, document in enumerate(dataset.iter_corpus())}
        gathered = folder.parent / "gathered.npy"
        gathered.parent.mkdir(parents=True, exist_ok=True)
        vectors = np.lib.format.open_memmap(
            gathered, mode="w+", dtype=np.float32, shape=(len(wanted), self.store.dimension)
        )
        filled = np.zeros(len(wanted), dtype=bool)
        for part in self.store.parts:
            rows = np.fromiter((wanted.get(doc_id, -1) for doc_id in part.ids()), dtype=np.int64)
            for first, chunk in part.row_chunks(65536):
                into = rows[first : first + len(chunk)]
                kept = into >= 0
                vectors[into[kept]] = chunk[kept]
                filled[into[kept]] = True
        vectors.flush()
        del vectors
        if not filled.all():
            ids = list(wanted)
            missing = [ids[row] for row in np.flatnonzero(~filled)[:5]]
            gathered.unlink()
            raise SystemExit(
                f"{self.folder}: no vector for {int((~filled).sum())} passages of {dataset.corpus_path} "
                f"(first: {', '.join(missing)}); give embeddings of a corpus that holds the slice"
            )
        import_embeddings(self.encoder, dataset, gathered, folder, overwrite=True, show_progress=False)
        gathered.unlink()
        log.info("%s: %d passages' vectors taken by id from %s in %.0f s", folder, len(wanted), self.folder,
                 time.perf_counter() - start)  # fmt: skip

    def queries(self, dataset: Any, split: str) -> tuple[list[str], np.ndarray]:
        """`split`'s query ids and vectors, encoded once and kept under the work folder (named by the
        encoder's identity and the queries' texts, so slices sharing their queries share them)."""
        from densekit.encoding.embed import embed_texts

        texts, _ = dataset.split_queries(split)
        ids = list(texts)
        key = digest({"encoder": self.encoder.identity(), "queries": [[q, texts[q]] for q in ids]})
        cached = self.work / "queries" / f"{split}-{key}.npy"
        if cached.is_file():
            return ids, np.load(cached)
        start = time.perf_counter()
        vectors = embed_texts(self.encoder, [texts[q] for q in ids], "query", self.batch_size)
        write_array(cached, vectors)
        log.info("%d %s queries encoded in %.0f s", len(ids), split, time.perf_counter() - start)
        return ids, vectors


@dataclass
class Ledger:
    """A benchmark's results as JSON at `path`, with each run's command (its `arguments`) and machine,
    written atomically after every stage. A stage found there measured from the same inputs (their
    digest, `made_from`) is kept, not measured again, while what it left on disk is still there
    (`present`; a stage's inputs are data and settings, not the benchmark's code: results of changed
    code go to a new file); `on_save` is called with the results and the stage's keys (none for the last save)
    before each write, to add what is derived from them and redraw tables and plots."""

    path: Path
    benchmark: str
    arguments: list[str]
    on_save: Callable[[dict, tuple[str, ...]], None] | None = None
    data: dict = field(init=False)

    def __post_init__(self) -> None:
        self.data = {"benchmark": self.benchmark, "runs": []}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            found = json.loads(self.path.read_text(encoding="utf-8"))
            if found.get("benchmark") != self.benchmark:
                raise SystemExit(f"{self.path} holds other results than {self.benchmark}'s; choose another "
                                 "--output")  # fmt: skip
            self.data = found
        command = f"python -m benchmarks.{self.benchmark} {shlex.join(self.arguments)}"
        self.data["runs"].append({"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                  "machine": machine_info()})  # fmt: skip

    def stage(
        self,
        where: tuple[str, ...],
        inputs: Any,
        measure: Callable[[], dict],
        present: Callable[[], bool] = lambda: True,
    ) -> dict:
        """The results at `where` (keys into the JSON): kept when made from the same `inputs`, else
        `measure()`d, recorded with its seconds, the process's peak memory so far, the run that made
        it (an index into `runs`) and the inputs' digest, and saved."""
        made_from = digest(inputs)
        node = self.data
        for key in where[:-1]:
            node = node.setdefault(key, {})
        found = node.get(where[-1])
        label = " ".join(where[1:] if where[0] == "sizes" else where)
        if isinstance(found, dict) and found.get("made_from") == made_from and present():
            log.info("%s: kept from an earlier run", label)
            return found
        log.info("%s: measuring", label)
        start = time.perf_counter()
        result = measure()
        seconds = time.perf_counter() - start
        node[where[-1]] = {**result, "stage_s": round(seconds, 2), "peak_rss_mib": peak_rss_mib(),
                           "measured_in": len(self.data["runs"]) - 1, "made_from": made_from}  # fmt: skip
        self.save(where)
        log.info("%s: done in %.1f s", label, seconds)
        return node[where[-1]]

    def save(self, where: tuple[str, ...] = ()) -> None:
        """Call `on_save` (after the stage at `where`), then write the results (atomically)."""
        from densekit.io.atomic import write_text_atomic

        if self.on_save is not None:
            self.on_save(self.data, where)
        write_text_atomic(self.path, json.dumps(self.data, indent=2) + "\n")
