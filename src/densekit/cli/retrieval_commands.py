"""Sub-commands of the retrieval pipeline: bm25, encode, index, search."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import annotated_types
import click
import typer
from typer.core import TyperCommand

from densekit.cli.options import (
    BackendOpt,
    BatchOpt,
    DataDirArg,
    DepthOpt,
    DeviceOpt,
    MmapIndexOpt,
    ModelArg,
    OverwriteOpt,
    PrecisionOpt,
    ProgressOpt,
    RemoteCodeOpt,
    SplitOpt,
    TorchPrecisionOpt,
    check_index_folder,
    check_model_inputs,
    load_model,
    with_encoder_options,
)
from densekit.data.dataset import Dataset
from densekit.data.trec import RUN_KIND, write_run
from densekit.errors import InputError, SettingError
from densekit.index.spec import IndexSpec, SpecError
from densekit.io.outputs import check_file_output, command_identity
from densekit.models.config import EncoderOptions

if TYPE_CHECKING:
    from densekit.index.base import SearchIndex

log = logging.getLogger("densekit")
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Where to write the result.")]


def _bounds(field: str) -> dict[str, Any]:
    """IndexSpec's bounds on an integer `field`, as typer's `min` and `max`, so that the command line
    refuses what the spec would."""
    bounds: dict[str, Any] = {}
    for rule in IndexSpec.model_fields[field].metadata:
        if isinstance(rule, annotated_types.Gt):
            bounds["min"] = rule.gt + 1
        elif isinstance(rule, annotated_types.Ge):
            bounds["min"] = rule.ge
        elif isinstance(rule, annotated_types.Lt):
            bounds["max"] = rule.lt - 1
        elif isinstance(rule, annotated_types.Le):
            bounds["max"] = rule.le
    return bounds


def _option_error(err: SpecError) -> ValueError:
    """A spec's error as the command line names it: by its option (and the value given, if any)."""
    given = "" if err.value is None else f" {err.value}"
    return ValueError(f"{err.option}{given}: {err.reason}")


def bm25(
    data_dir: DataDirArg,
    output: OutputOpt,
    split: SplitOpt = "test",
    k: DepthOpt = 1000,
    k1: Annotated[float, typer.Option(help="BM25 term-frequency saturation.")] = 0.9,
    b: Annotated[float, typer.Option(help="BM25 length normalisation.")] = 0.4,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Rank the corpus with BM25 (title + text, English stemmer and stop words) for a split's queries."""
    from densekit.retrieval.bm25 import BM25Config, BM25Index

    identity = command_identity("bm25", {"split": split, "k": k, "k1": k1, "b": b}, [data_dir])
    check_file_output(output, RUN_KIND, [data_dir], identity, overwrite)
    dataset = Dataset.open(data_dir)
    queries, _ = dataset.split_queries(split)
    index = BM25Index.of_dataset(dataset, BM25Config(k1=k1, b=b), progress)
    write_run(output, index.search(queries, k), tag="bm25", inputs=[data_dir], identity=identity,
              overwrite=overwrite)  # fmt: skip
    log.info("wrote %s (%d queries)", output, len(queries))


@with_encoder_options
def encode(
    model: ModelArg,
    data_dir: DataDirArg,
    output: OutputOpt,
    shard: Annotated[
        str, typer.Option(help="Encode part i of n equal slices of the corpus, as i/n.")
    ] = "0/1",
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    backend: BackendOpt = "torch",
    precision: PrecisionOpt = "float32",
    chunk_size: Annotated[int, typer.Option(min=1, help="Rows between resumable save points.")] = 4096,
    maxp: Annotated[
        bool, typer.Option(help="Split long documents into passages and index each (MaxP); default FirstP.")
    ] = False,
    maxp_stride: Annotated[
        int | None, typer.Option(min=1, help="MaxP: tokens between passage starts.")
    ] = None,
    encoder_options: EncoderOptions = EncoderOptions(),
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Encode the corpus (or one shard) into float32 embeddings beside their ids; resumes if killed.

    Long documents are truncated to the passage length (FirstP) unless --maxp cuts them into passages,
    each indexed on its own; `search` then scores a document by its best passage. An output folder
    holding embeddings of another model, setting or corpus is refused unless --overwrite.
    """
    if maxp_stride is not None and not maxp:
        raise SettingError("--maxp-stride needs --maxp")
    dataset = Dataset.open(data_dir)  # a mistyped folder or model is refused before torch is imported
    check_model_inputs(model, encoder_options)
    from densekit.encoding.corpus import Shard, encode_corpus, use_corpus_backend
    from densekit.encoding.passages import MaxPSettings

    part = Shard.parse(shard)
    encoder, _ = load_model(model, device, encoder_options)
    torch_precision = use_corpus_backend(encoder, backend, precision, dataset)
    meta = encode_corpus(
        encoder,
        dataset,
        output,
        part,
        batch_size,
        torch_precision,
        chunk_size,
        progress,  # type: ignore[arg-type]
        MaxPSettings(stride=maxp_stride) if maxp else None,
        overwrite,
    )
    log.info("wrote %s", meta)


SETTINGS_PANEL = "Backend settings"
# The options of the backends' specs, each a field (`--hnsw-m` for `hnsw_m`), declared here once with its
# type and bounds; None is "not given", the spec's default. The backend building the index takes those
# its spec has and refuses any other given, naming it (`with_index_settings`); what each means is its
# spec's to say (`IndexCommand`).
_INDEX_SETTINGS: dict[str, Any] = {
    **{field: Annotated[int | None, typer.Option(rich_help_panel=SETTINGS_PANEL, **_bounds(field))]
       for field in ("hnsw_m", "ef_construction", "ef_search", "nlist", "nprobe", "pq_m", "pq_bits")},
    "uri": Annotated[str | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "collection": Annotated[str | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "rescore": Annotated[int | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "rescore_with": Annotated[str | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "binary_index": Annotated[str | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "code_bits": Annotated[int | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "ivf_centroids": Annotated[str | None, typer.Option(rich_help_panel=SETTINGS_PANEL)],
    "setting": Annotated[list[str] | None, typer.Option(
        help="NAME=VALUE: a setting of the backend's spec that has no option of its own (repeatable; "
        "below).", rich_help_panel=SETTINGS_PANEL)],
}  # fmt: skip


def with_index_settings(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the options of the backends' specs (`_INDEX_SETTINGS`, declared once) in place of
    its `settings: dict` parameter, which it is then given as one dict of those given, by field name
    (`--setting NAME=VALUE` adds others)."""
    signature = inspect.signature(command, eval_str=True)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name != "settings":
            parameters.append(parameter)
            continue
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters += [inspect.Parameter(name, kind, default=None, annotation=annotation)
                       for name, annotation in _INDEX_SETTINGS.items()]  # fmt: skip

    @functools.wraps(command)
    def run(**given: Any) -> None:
        values = {name: given.pop(name) for name in _INDEX_SETTINGS}
        named = dict(_setting_value(text) for text in values.pop("setting") or [])
        settings = {name: value for name, value in values.items() if value is not None}
        command(**given, settings={**named, **settings})

    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return run


def _setting_value(text: str) -> tuple[str, str]:
    """`--setting NAME=VALUE` as (NAME, VALUE), the backend's spec reading VALUE as its field's type."""
    name, equals, value = text.partition("=")
    if not equals or not name.strip():
        raise SettingError(f"--setting {text}: give NAME=VALUE, NAME a setting of the backend's spec")
    return name.strip().replace("-", "_"), value


class IndexCommand(TyperCommand):
    """`densekit index`, whose help says what each registered backend's spec says of itself: each
    setting's option its description (per backend, where several have it), and at the end each backend,
    the types it builds and its settings without an option of their own. Read from the registry when
    the help is shown (which imports every backend), so that running a command imports none."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from densekit.index.base import registered_backends

        backends = registered_backends().values()
        for option in self.params:
            fields = {backend.backend: backend.spec_class.model_fields for backend in backends}
            described = {name: _field_words(found[option.name]) for name, found in fields.items()
                         if option.name in found and option.name != "type"}  # fmt: skip
            if len(described) == 1:
                option.help = next(iter(described.values()))
            elif described:
                option.help = "; ".join(f"{name}: {words}" for name, words in described.items())
        paragraphs = ["Backends (--backend NAME) and the types they build (--type TYPE, the default first):"]
        for backend in backends:
            types = ", ".join(name + " (exact)" * (name in backend.exact_types) for name in backend.types)
            about = " ".join((backend.spec_class.__doc__ or "").strip().split("\n\n")[0].split())
            lines = [f"{backend.backend}: {types}. {about}"]
            lines += [f"  --setting {field}=VALUE: {_field_words(info)}"
                      for field, info in backend.spec_class.model_fields.items()
                      if field != "type" and field not in _INDEX_SETTINGS]  # fmt: skip
            paragraphs.append("\n".join(lines))
        self.epilog = "\n\n".join(paragraphs)
        super().format_help(ctx, formatter)


def _field_words(info: Any) -> str:
    """A spec field's description, with its default where it has one to show."""
    default = info.get_default(call_default_factory=True)
    shown = " (needed)" if info.is_required() else "" if default is None else f" (default {default})"
    return f"{info.description or ''}{shown}"


@with_index_settings
def index(
    embeddings: Annotated[Path, typer.Argument(help="A folder written by `densekit encode`.")],
    output: OutputOpt,
    settings: dict[str, Any],
    index_type: Annotated[
        str | None,
        typer.Option("--type", help="flat (exact; the default), hnsw, ivfpq, binary or int8 (binary or "
                                    "one-byte codes, --rescore), or another backend's type (below)."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="faiss (a local file; the default), milvus (a Milvus collection), or "
                                       "another (below); by default the one building --type."),
    ] = None,
    memory_check: Annotated[
        bool,
        typer.Option(
            "--memory-check/--no-memory-check",
            help="Refuse, before any work, an index needing more memory than is available (docs/scale.md).",
        ),
    ] = True,
    target_recall: Annotated[
        float | None,
        typer.Option(
            help="Save the smallest --nprobe (ivfpq, re-ranking with the exact vectors if it must), "
            "--ef-search (hnsw) or --rescore (binary, int8) whose recall@10 against exact search meets this "
            "on the held-out queries.",
        ),
    ] = None,
    recall_queries: Annotated[
        int,
        typer.Option(min=1, help="Held-out queries (the collection's own vectors) recall is measured on."),
    ] = 1000,
    queries: Annotated[
        Path | None,
        typer.Option(
            help="Measure recall on these queries (a BEIR queries.jsonl) encoded by --model instead.",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="With --queries: the model that encoded EMBEDDINGS, to encode them.")
    ] = None,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Build an index of saved embeddings (inner product) and save it: by default a Faiss index; with
    --type binary or int8 the vectors' codes, rescored against a copy on disk (docs/scale.md); with
    --backend milvus, the vectors written into a Milvus collection that the saved index folder names
    (docs/serving.md).

    An approximate index's recall@10 and @100 against exact search are measured on held-out queries and
    saved in its manifest; with --target-recall the search setting meeting it is saved as the default of
    `search`, `mine` and `serve` (docs/scale.md).

    OUTPUT must be new, an empty folder or an index folder densekit made: of the same embeddings and
    settings, or of others with --overwrite (which is replaced).
    """
    from densekit.encoding.store import EmbeddingStore
    from densekit.index.base import META_FILE
    from densekit.index.recall import RecallSettings
    from densekit.index.registry import backend_for, build_index
    from densekit.io.artefact import read_manifest

    try:
        chosen = backend_for(index_type, backend)
        spec = chosen.spec_of({**settings, "type": index_type or chosen.types[0]})
    except SpecError as err:
        raise _option_error(err) from None
    _check_recall_options(chosen, spec.type, backend is not None, target_recall, queries, model)  # type: ignore[attr-defined]
    try:
        store = EmbeddingStore.open(embeddings)
        recall = RecallSettings(target=target_recall, queries=recall_queries)
        if queries is not None and model is not None:
            recall = _encoded_queries(recall, queries, model, store)
        build_index(store, spec, output, show_progress=progress, check_memory=memory_check, recall=recall,
                    overwrite=overwrite)  # fmt: skip
    except SpecError as err:
        raise _option_error(err) from None
    meta = json.loads((output / META_FILE).read_text(encoding="utf-8"))
    log.info("wrote %s%s", output, chosen.summary(meta, read_manifest(output).about))  # type: ignore[union-attr]


def _check_recall_options(
    backend: type[SearchIndex], index_type: str, named: bool, target_recall: float | None,
    queries: Path | None, model: str | None,
) -> None:  # fmt: skip
    """Refuse recall options that would do nothing: an exact index (a flat one, Milvus) has no recall to
    measure or target (and no reason to encode --queries). `named`: the backend was given by name."""
    if target_recall is not None and not 0 < target_recall <= 1:
        number = "" if math.isfinite(target_recall) else " not a finite number;"
        raise SettingError(f"--target-recall {target_recall}:{number} give a recall above 0, at most 1")
    if (queries is None) != (model is None):
        raise SettingError("--queries and --model go together: the queries are encoded by the model that "
                         "encoded EMBEDDINGS")  # fmt: skip
    given = [name for name, value in (("--target-recall", target_recall), ("--queries", queries))
             if value is not None]  # fmt: skip
    if given and index_type in backend.exact_types:
        from densekit.index.base import registered_backends
        from densekit.index.registry import one_of

        every_type_exact = set(backend.types) == set(backend.exact_types)
        exact = f"--backend {backend.backend}" if named and every_type_exact else f"--type {index_type}"
        approximate = [name for found in registered_backends().values() for name in found.types
                       if name not in found.exact_types]  # fmt: skip
        raise SettingError(f"{' and '.join(given)}: an index of {exact} searches exactly (recall 1); these "
                         f"options are for --type {one_of(approximate)}")  # fmt: skip


def _encoded_queries(recall: Any, queries: Path, model: str, store: Any) -> Any:
    """`recall` with the vectors of the `queries` file, encoded by `model`, which must be the model that
    made `store`'s vectors."""
    from dataclasses import replace

    from densekit.data.jsonl import read_jsonl_queries
    from densekit.diagnostics import Diagnostics
    from densekit.encoding.embed import embed_texts
    from densekit.io.artefact import path_fingerprint

    texts = read_jsonl_queries(queries, Diagnostics())
    if not texts:
        raise InputError(f"--queries {queries}: holds no queries")
    encoder, _ = load_model(model, "auto", EncoderOptions())
    if store.identity["model"]["weights"] != encoder.passage_fingerprint():
        raise InputError(f"--model {model}: {store.folder} was encoded by other model weights; give the "
                         "model that encoded it")  # fmt: skip
    encoder.eval()
    vectors = embed_texts(encoder, list(texts.values()), "query")
    source = f"{len(texts)} queries of {queries}, encoded by {model}"
    return replace(recall, vectors=vectors, source=source, digest=path_fingerprint(queries))


@with_encoder_options
def search(
    model: ModelArg,
    index_dir: Annotated[Path, typer.Argument(help="A folder written by `densekit index`.")],
    data_dir: DataDirArg,
    output: OutputOpt,
    split: SplitOpt = "test",
    k: DepthOpt = 1000,
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    backend: BackendOpt = "torch",
    precision: PrecisionOpt = "float32",
    gpu_index: Annotated[
        bool, typer.Option("--gpu-index", help="Search the index on the GPUs faiss sees.")
    ] = False,
    mmap_index: MmapIndexOpt = False,
    ef_search: Annotated[
        int | None, typer.Option(help="HNSW: override the saved candidate list.", **_bounds("ef_search"))
    ] = None,
    nprobe: Annotated[
        int | None, typer.Option(help="IVF: override the saved lists probed.", **_bounds("nprobe"))
    ] = None,
    encoder_options: EncoderOptions = EncoderOptions(),
    domain: Annotated[
        str | None,
        typer.Option(
            help="The collection's domain, which a fixed route (MODEL a route folder) maps to a module."
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Encode a split's queries and write their top k documents from the index as a TREC run. MODEL may be
    a route folder (docs/routing.md): queries are then routed among its modules, over an index of the
    base's passages."""
    module = encoder_options.module
    inputs = [index_dir, data_dir, model, *([module] if module else [])]
    settings = {"split": split, "k": k, "backend": backend, "precision": precision, "ef_search": ef_search,
                "nprobe": nprobe, **encoder_options.overrides(), "domain": domain}  # fmt: skip
    identity = command_identity("search", settings, inputs)
    check_file_output(output, RUN_KIND, inputs, identity, overwrite)
    check_model_inputs(model, encoder_options)
    check_index_folder(index_dir)
    dataset = Dataset.open(data_dir)
    from densekit.encoding.runtimes import use_backend
    from densekit.index import SearchIndex
    from densekit.retrieval.retriever import Retriever

    queries, _ = dataset.split_queries(split)
    encoder, route = load_model(
        model, device, encoder_options, domain, backend=None if backend == "torch" else backend
    )
    torch_precision = use_backend(encoder, backend, precision, ["query"])
    searcher = SearchIndex.load(index_dir, gpu=gpu_index, mmap=mmap_index)
    try:
        searcher.set_search_parameters(ef_search=ef_search, nprobe=nprobe)
    except SpecError as err:
        raise _option_error(err) from None
    retriever = Retriever(encoder, searcher, dataset=dataset, route=route)
    run = retriever.search_run(
        queries,
        k,
        batch_size,
        torch_precision,
        show_progress=progress,
        domain=domain,  # type: ignore[arg-type]
    )
    write_run(output, run, tag="densekit", inputs=inputs, identity=identity, overwrite=overwrite)
    log.info("wrote %s (%d queries)", output, len(queries))


def rerank(
    model: Annotated[
        str,
        typer.Argument(
            help="A cross-encoder folder (or hub id) with its trained head; a plain encoder is refused."
        ),
    ],
    run: Annotated[Path, typer.Argument(help="The TREC run to rerank (BM25, dense, fused...).")],
    data_dir: DataDirArg,
    output: OutputOpt,
    split: SplitOpt = "test",
    depth: Annotated[int, typer.Option("--depth", min=1, help="Documents reranked per query.")] = 100,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Pairs scored per batch.")] = 32,
    max_length: Annotated[int | None, typer.Option("--max-length", min=8, help="Tokens per pair.")] = None,
    device: DeviceOpt = "auto",
    precision: TorchPrecisionOpt = "float32",
    trust_remote_code: RemoteCodeOpt = False,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Rerank each query's top DEPTH documents of RUN with a cross-encoder; the documents below keep
    their order. Equal scores keep the run's order."""
    from densekit.data.trec import read_run
    from densekit.device import autocast, resolve_device
    from densekit.diagnostics import Diagnostics
    from densekit.models.cross_encoder import CrossEncoder
    from densekit.retrieval.rerank import rerank_run

    settings = {"split": split, "depth": depth, "max_length": max_length, "precision": precision}
    identity = command_identity("rerank", settings, [run, data_dir, model])
    check_file_output(output, RUN_KIND, [run, data_dir, model], identity, overwrite)
    target = resolve_device(device)
    autocast(target, precision)  # type: ignore[arg-type]  # refuses fp16 on a CPU before any work
    dataset = Dataset.open(data_dir)
    queries, _ = dataset.split_queries(split)
    first = read_run(run, Diagnostics())
    cross_encoder = CrossEncoder.load(model, max_length, trust_remote_code, require_head=True).to(target)
    corpus = dataset.iter_corpus()
    reranked = rerank_run(
        cross_encoder, first, queries, corpus, depth, batch_size, progress, precision=precision  # type: ignore[arg-type]
    )  # fmt: skip
    write_run(output, reranked, tag="rerank", inputs=[run, data_dir, model], identity=identity,
              overwrite=overwrite)  # fmt: skip
    log.info("wrote %s (%d queries, top %d reranked)", output, len(reranked), depth)


def register(app: typer.Typer) -> None:
    """Add these sub-commands to `app`."""
    app.command("bm25")(bm25)
    app.command("rerank")(rerank)
    app.command("encode")(encode)
    app.command("index", cls=IndexCommand)(index)
    app.command("search")(search)
