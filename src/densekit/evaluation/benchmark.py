"""A model against BM25 on several collections at once, BEIR's way: one table and one chart.

The output folder holds a sub-folder per collection (`bm25.trec`, `embeddings/`, `index/`,
`dense.trec`) and the results (`results.json`, `results.md`, `results.png`). Every stage is reused
when what made it is unchanged (the runs record their model, settings and input digests; embeddings
and indexes check theirs), so a second benchmark of the same model does no encoding, and a killed one
continues where it stopped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densekit.data.dataset import Dataset
from densekit.data.trec import RUN_KIND, read_run, write_run
from densekit.device import Precision
from densekit.diagnostics import Diagnostics
from densekit.encoding.corpus import embedding_identity, encode_corpus
from densekit.encoding.store import EmbeddingStore, part_stem
from densekit.errors import InputError
from densekit.evaluation.measures import evaluate, parse_measures
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.index.base import index_identity as folder_identity
from densekit.io.artefact import differences, read_manifest, write_folder_manifest
from densekit.io.outputs import claim_folder, is_current, write_output_text
from densekit.models.encoder import DenseEncoder
from densekit.plots import pyplot, save_png
from densekit.retrieval.bm25 import BM25Config, BM25Index
from densekit.retrieval.dense import check_compatible
from densekit.retrieval.retriever import Retriever
from densekit.routing.route import Route

log = logging.getLogger("densekit")

KIND = "benchmark"
RESULTS_KIND = "benchmark results"
BM25_NAME = "BM25"
_ENTRIES = ("results.*",)
BENCHMARK_MEASURES = ("nDCG@10", "R@100")


@dataclass(frozen=True)
class BenchmarkOptions:
    """How a benchmark runs, the same for each of its collections: the `split` searched, the `measures`
    scored (default nDCG@10 and R@100), the depth `k` of each run, the encoding `batch_size`, progress
    bars, whether stages of another model may be replaced (`overwrite`), and torch's autocast
    `precision` (the encoder's `runtime`, when set, encodes instead: `runtimes.use_backend`)."""

    split: str = "test"
    measures: Sequence[str] | None = None
    k: int = 1000
    batch_size: int = 64
    show_progress: bool = True
    overwrite: bool = False
    precision: Precision = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "measures", tuple(self.measures or BENCHMARK_MEASURES))

    @property
    def measure_names(self) -> list[str]:
        """The measures, as a list."""
        return list(self.measures or BENCHMARK_MEASURES)


@dataclass
class CollectionResult:
    """One collection's scores per system, and how each stage was got (seconds spent, or "reused")."""

    name: str
    path: str
    queries: int
    scores: dict[str, dict[str, float]]
    stages: dict[str, float | str] = field(default_factory=dict)


@dataclass
class BenchmarkResult:
    """The scores of BM25 and the model on every collection, and their means."""

    model: str
    split: str
    measures: list[str]
    collections: list[CollectionResult]

    @property
    def systems(self) -> list[str]:
        """BM25, then the model."""
        return [BM25_NAME, self.model]

    def means(self) -> dict[str, dict[str, float]]:
        """Each system's unweighted mean over the collections (BEIR's average)."""
        return {
            system: {
                m: float(np.mean([c.scores[system][m] for c in self.collections])) for m in self.measures
            }
            for system in self.systems
        }

    def to_json(self) -> dict:
        """The results as `results.json` holds them."""
        return {
            "model": self.model, "split": self.split, "measures": self.measures,
            "collections": [c.__dict__ for c in self.collections], "mean": self.means(),
        }  # fmt: skip

    def to_markdown(self) -> str:
        """One row per collection and one for the mean; a column per system and measure."""
        header = ["collection", "queries"] + [f"{s} {m}" for m in self.measures for s in self.systems]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        rows = [(c.name, str(c.queries), c.scores) for c in self.collections]
        rows.append(("**mean**", "", self.means()))
        for name, queries, scores in rows:
            cells = [f"{scores[s][m]:.4f}" for m in self.measures for s in self.systems]
            lines.append("| " + " | ".join([name, queries, *cells]) + " |")
        return "\n".join(lines) + "\n"


def collection_names(data_dirs: list[Path]) -> list[str]:
    """A folder name per collection, made unique by a number where two share one."""
    names: list[str] = []
    for path in data_dirs:
        base = Path(path).resolve().name
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def run_benchmark(
    encoder: DenseEncoder,
    model_name: str,
    data_dirs: list[Path],
    output: Path,
    options: BenchmarkOptions = BenchmarkOptions(),
    route: Route | None = None,
    domains: list[str] | None = None,
    indexes: list[Path] | None = None,
) -> BenchmarkResult:
    """BM25 and `encoder` on the split of each collection, as `options` say; writes the table, its JSON
    and a chart. With `route` (on `encoder`), queries are routed over the base's passages, each
    collection's by its domain (`domains`, one per collection; default: the collections' names). With
    `indexes` (one per collection), each collection is searched in its given index, checked to be of the
    passages this encoder makes, instead of encoding the corpus: the base's indexes serve every
    query-only module and route of that base. The encoder's inference (torch at `options.precision`, or
    its `runtime`) is recorded by every stage."""
    measures = options.measure_names
    parse_measures(measures)  # an unknown measure fails before any work
    if not data_dirs:
        raise InputError("benchmark needs at least one collection")
    datasets = [Dataset.open(path) for path in data_dirs]
    names = collection_names(data_dirs)
    if domains is not None and len(domains) != len(data_dirs):
        raise InputError(f"{len(domains)} domains for {len(data_dirs)} collections")
    if domains is not None and (route is None or not route.strategy.takes_domains):
        raise InputError("domains choose the modules of a fixed route; this benchmark has none")
    if indexes is not None and len(indexes) != len(data_dirs):
        raise InputError(f"{len(indexes)} indexes for {len(data_dirs)} collections: give one per collection")
    output = Path(output)
    identity = {"model": encoder.identity(), "split": options.split, "k": options.k}
    if route is not None:
        identity["route"] = route.identity()
    identity = encoder.artefact_identity(identity, options.precision)
    inputs = [*data_dirs, encoder.source]
    if claim_folder(output, KIND, identity, inputs, options.overwrite, _ENTRIES) == "new":
        output.mkdir(parents=True, exist_ok=True)
        write_folder_manifest(output, KIND, identity, {"model": encoder.source})
    results = []
    for number, (name, dataset) in enumerate(zip(names, datasets, strict=True), 1):
        log.info("collection %d of %d: %s (%s)", number, len(datasets), name, dataset.root)
        fixed = route is not None and route.strategy.takes_domains
        domain = (domains[number - 1] if domains is not None else name) if fixed else None
        given = None if indexes is None else Path(indexes[number - 1])
        result = benchmark_collection(
            encoder, model_name, dataset, output / name, options, route, domain, given
        )
        results.append(result)
        log.info(
            "%s: %s", name, ", ".join(f"{s} {m} {v[m]:.4f}" for s, v in result.scores.items() for m in v)
        )
    result = BenchmarkResult(model_name, options.split, measures, results)
    write_output_text(output / "results.json", RESULTS_KIND, json.dumps(result.to_json(), indent=2) + "\n")
    write_output_text(output / "results.md", RESULTS_KIND, result.to_markdown())
    plot_benchmark(result, output / "results.png")
    return result


def benchmark_collection(
    encoder: DenseEncoder,
    model_name: str,
    dataset: Dataset,
    folder: Path,
    options: BenchmarkOptions = BenchmarkOptions(),
    route: Route | None = None,
    domain: str | None = None,
    given_index: Path | None = None,
) -> CollectionResult:
    """BM25 and `encoder` on one collection, as `options` say, in `folder` (`bm25.trec`, `embeddings/`,
    `index/`, `dense.trec`), each stage reused when what made it is unchanged; the caller checks that
    `folder` may be written. With `route`, queries are routed (by `domain` for a fixed route). With
    `given_index`, that index is searched (after checking it holds this encoder's passages of this
    corpus) and the corpus is not encoded."""
    split, k, precision = options.split, options.k, options.precision
    batch_size, show_progress, overwrite = options.batch_size, options.show_progress, options.overwrite
    folder.mkdir(parents=True, exist_ok=True)
    queries, qrels = dataset.split_queries(split)
    split_identity = {
        "corpus": dataset.corpus_digest(),
        "queries": dataset.digest(dataset.queries_path(split)),
        "split": split,
        "k": k,
    }
    stages: dict[str, float | str] = {}

    bm25_run, bm25_config = folder / "bm25.trec", BM25Config()
    bm25_identity = {**split_identity, "bm25": bm25_config.model_dump()}
    with _stage(stages, "bm25", is_current(bm25_run, RUN_KIND, bm25_identity)) as fresh:
        if fresh:
            index = BM25Index.of_dataset(dataset, bm25_config, show_progress)
            # the benchmark's folder is its own: a stage of other settings is replaced
            write_run(bm25_run, index.search(queries, k), "bm25", [dataset.root], bm25_identity, True)

    given = None
    if given_index is None:
        index_dir = folder / "index"
        index_identity = _encode_and_index(encoder, dataset, folder, batch_size, show_progress, overwrite,
                                           stages, precision)  # fmt: skip
    else:
        index_dir = Path(given_index)
        given = SearchIndex.load(index_dir)
        check_compatible(encoder, given, dataset)
        index_identity = given.identity
        stages.update(encode=f"given: {index_dir}", index=f"given: {index_dir}")

    dense_run = folder / "dense.trec"
    dense_identity = {**split_identity, "model": encoder.identity(), "index": index_identity}
    if route is not None:
        dense_identity.update(route=route.identity(), domain=domain)
    dense_identity = encoder.artefact_identity(dense_identity, precision)
    with _stage(stages, "search", is_current(dense_run, RUN_KIND, dense_identity)) as fresh:
        if fresh:
            index = given if given is not None else SearchIndex.load(index_dir)
            retriever = Retriever(encoder, index, dataset=dataset, route=route)
            ranked = retriever.search_run(queries, k, batch_size, precision, show_progress=show_progress,
                                          domain=domain)  # fmt: skip
            write_run(dense_run, ranked, "densekit", [dataset.root], dense_identity, overwrite=True)

    scores = {}
    for system, path in ((BM25_NAME, bm25_run), (model_name, dense_run)):
        scores[system] = evaluate(qrels, read_run(path, Diagnostics()), options.measure_names)
    return CollectionResult(folder.name, str(dataset.root), len(queries), scores, stages)


def _encode_and_index(
    encoder: DenseEncoder,
    dataset: Dataset,
    folder: Path,
    batch_size: int,
    show_progress: bool,
    overwrite: bool,
    stages: dict[str, float | str],
    precision: Precision = "float32",
) -> dict:
    """Encode the corpus into `folder/embeddings` and build a flat `folder/index`, each unless an
    unchanged one is there; returns the index's identity."""
    embeddings, index_dir = folder / "embeddings", folder / "index"
    spec = IndexSpec(type="flat")
    made = read_manifest(embeddings) if embeddings.is_dir() else None
    fresh_embeddings = embedding_identity(encoder, dataset, 1, None, precision)
    encoded = made is not None and not differences(made.identity, fresh_embeddings)
    complete = (embeddings / part_stem(0, 1)).with_suffix(".json").is_file()
    with _stage(stages, "encode", encoded and complete) as fresh:
        if fresh:
            encode_corpus(encoder, dataset, embeddings, batch_size=batch_size, precision=precision,
                          show_progress=show_progress, overwrite=overwrite)  # fmt: skip
    store = EmbeddingStore.open(embeddings)
    index_identity = folder_identity(store, spec.resolved(len(store), store.dimension))
    indexed = read_manifest(index_dir) if index_dir.is_dir() else None
    with _stage(
        stages, "index", indexed is not None and not differences(indexed.identity, index_identity)
    ) as fresh:
        if fresh:
            # the benchmark's folder is its own: an index of other embeddings is replaced
            build_index(store, spec, index_dir, show_progress=show_progress, overwrite=True)
    return index_identity


class _stage:
    """Times a stage, or records that it was reused (`reusable`), as `stages[name]`; yields whether the
    stage must be done."""

    def __init__(self, stages: dict[str, float | str], name: str, reusable: bool):
        self.stages, self.name, self.reusable = stages, name, reusable

    def __enter__(self) -> bool:
        self.start = time.perf_counter()
        if self.reusable:
            log.info("%s: reused (made from the same model, settings and data)", self.name)
        return not self.reusable

    def __exit__(self, *exc: object) -> None:
        self.stages[self.name] = "reused" if self.reusable else round(time.perf_counter() - self.start, 1)


def plot_benchmark(result: BenchmarkResult, output: Path) -> Path:
    """Bars of the first measure per collection and for the mean, BM25 beside the model."""
    plt = pyplot()

    measure = result.measures[0]
    labels = [c.name for c in result.collections] + ["mean"]
    means = result.means()
    figure, axis = plt.subplots(figsize=(1.6 * len(labels) + 2, 3.8))
    width = 0.38
    for offset, system in ((-width / 2, BM25_NAME), (width / 2, result.model)):
        values = [c.scores[system][measure] for c in result.collections] + [means[system][measure]]
        bars = axis.bar(np.arange(len(labels)) + offset, values, width, label=system)
        axis.bar_label(bars, fmt="%.3f", fontsize=8)
    axis.set_xticks(np.arange(len(labels)), labels)
    axis.set_ylabel(measure)
    axis.set_title(f"{result.model} against BM25 ({result.split} split)")
    axis.legend(loc="upper right", fontsize=8)
    axis.margins(y=0.15)
    return save_png(figure, output)
