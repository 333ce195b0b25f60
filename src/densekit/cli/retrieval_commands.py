"""Sub-commands of the retrieval pipeline: bm25, encode, index, search."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import annotated_types
import typer

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
from densekit.index.spec import IndexSpec, IndexType, SpecError
from densekit.io.outputs import check_file_output, command_identity
from densekit.models.config import EncoderOptions

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
    """A spec's error as the command line names it: by its option."""
    return ValueError(f"{err.option} {err.value}: {err.reason}")


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
        raise ValueError("--maxp-stride needs --maxp")
    dataset = Dataset.open(data_dir)  # a mistyped folder or model is refused before torch is imported
    check_model_inputs(model, encoder_options)
    from densekit.encoding.corpus import Shard, encode_corpus
    from densekit.encoding.onnx_backend import use_backend
    from densekit.encoding.passages import MaxPSettings

    part = Shard.parse(shard)
    encoder, _ = load_model(model, device, encoder_options)
    torch_precision = use_backend(encoder, backend, precision, ["passage"])
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


def index(
    embeddings: Annotated[Path, typer.Argument(help="A folder written by `densekit encode`.")],
    output: OutputOpt,
    index_type: Annotated[IndexType, typer.Option("--type", help="flat (exact), hnsw or ivfpq.")] = "flat",
    hnsw_m: Annotated[int, typer.Option(help="HNSW neighbours per node.", **_bounds("hnsw_m"))] = 32,
    ef_construction: Annotated[
        int, typer.Option(help="HNSW build candidate list.", **_bounds("ef_construction"))
    ] = 200,
    ef_search: Annotated[
        int, typer.Option(help="HNSW search candidate list (saved as the default).", **_bounds("ef_search"))
    ] = 256,
    nlist: Annotated[
        int | None, typer.Option(help="IVF lists (default 4·sqrt(n), capped).", **_bounds("nlist"))
    ] = None,
    nprobe: Annotated[
        int, typer.Option(help="IVF lists probed (saved as the default).", **_bounds("nprobe"))
    ] = 32,
    pq_m: Annotated[
        int | None, typer.Option(help="PQ sub-quantisers (default dimension/4).", **_bounds("pq_m"))
    ] = None,
    pq_bits: Annotated[
        int | None,
        typer.Option(help="PQ bits per code (default 8, less for small corpora).", **_bounds("pq_bits")),
    ] = None,
    backend: Annotated[
        str, typer.Option("--backend", help="faiss (a local file) or milvus (a Milvus collection).")
    ] = "faiss",
    uri: Annotated[
        str | None,
        typer.Option(
            "--uri",
            help="milvus: a Milvus server's URI, or for Milvus Lite a path ending in .db (recorded absolute; "
            "new, empty or a Milvus Lite database).",
        ),
    ] = None,
    collection: Annotated[
        str | None,
        typer.Option(
            "--collection",
            help="milvus: the collection, a letter or '_' then letters, digits and '_' (default: OUTPUT's "
            "name).",
        ),
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
            min=0.0, max=1.0,
            help="Save the smallest --nprobe (ivfpq, re-ranking with the exact vectors if it must) or "
            "--ef-search (hnsw) whose recall@10 against exact search meets this on the held-out queries.",
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
    """Build a Faiss index (inner product) from saved embeddings and save it, or, with --backend milvus,
    write them into a Milvus collection that the saved index folder names (docs/serving.md).

    An hnsw or ivfpq index's recall@10 and @100 against exact search are measured on held-out queries and
    saved in its manifest; with --target-recall the search setting meeting it is saved as the default of
    `search`, `mine` and `serve` (docs/scale.md).

    OUTPUT must be new, an empty folder or an index folder densekit made (which is replaced).
    """
    from densekit.encoding.store import EmbeddingStore
    from densekit.index import build_index
    from densekit.index.recall import RecallSettings
    from densekit.io.artefact import read_manifest

    _check_recall_options(backend, index_type, target_recall, queries, model)
    if backend == "milvus":
        from densekit.index.milvus_index import build_milvus_index, default_collection

        if uri is None:
            raise ValueError("--backend milvus needs --uri (a Milvus URI, or a file path for Milvus Lite)")
        if index_type != "flat":
            raise ValueError(f"--type {index_type}: the Milvus backend searches exactly (flat) only")
        name = collection or default_collection(output)
        try:
            build_milvus_index(EmbeddingStore.open(embeddings), output, uri, name, overwrite, progress)
        except SpecError as err:
            raise _option_error(err) from None
        log.info("wrote %s (Milvus collection %r at %s)", output, name, uri)
        return
    if backend != "faiss":
        raise ValueError(f"--backend {backend}: use faiss or milvus")
    if uri is not None or collection is not None:
        raise ValueError("--uri and --collection are for --backend milvus")
    try:
        spec = IndexSpec.checked(
            type=index_type, hnsw_m=hnsw_m, ef_construction=ef_construction, ef_search=ef_search,
            nlist=nlist, nprobe=nprobe, pq_m=pq_m, pq_bits=pq_bits,
        )  # fmt: skip
        store = EmbeddingStore.open(embeddings)
        recall = RecallSettings(target=target_recall, queries=recall_queries)
        if queries is not None and model is not None:
            recall = _encoded_queries(recall, queries, model, store)
        build_index(store, spec, output, show_progress=progress, check_memory=memory_check, recall=recall)
    except SpecError as err:
        raise _option_error(err) from None
    measured = read_manifest(output).about.get("recall")  # type: ignore[union-attr]
    log.info("wrote %s%s", output, _recall_words(measured))


def _check_recall_options(
    backend: str, index_type: str, target_recall: float | None, queries: Path | None, model: str | None
) -> None:
    """Refuse recall options that would do nothing: Milvus and flat indexes search exactly, so there is no
    recall to measure or target (and no reason to encode --queries)."""
    if target_recall is not None and target_recall <= 0:
        raise ValueError(f"--target-recall {target_recall}: give a recall above 0, at most 1")
    if (queries is None) != (model is None):
        raise ValueError("--queries and --model go together: the queries are encoded by the model that "
                         "encoded EMBEDDINGS")  # fmt: skip
    given = [name for name, value in (("--target-recall", target_recall), ("--queries", queries))
             if value is not None]  # fmt: skip
    exact = "--backend milvus" if backend == "milvus" else "--type flat" if index_type == "flat" else None
    if given and exact is not None:
        raise ValueError(f"{' and '.join(given)}: an index of {exact} searches exactly (recall 1); these "
                         "options are for --type hnsw or ivfpq")  # fmt: skip


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
        raise ValueError(f"--queries {queries}: holds no queries")
    encoder, _ = load_model(model, "auto", EncoderOptions())
    if store.identity["model"]["weights"] != encoder.passage_fingerprint():
        raise ValueError(f"--model {model}: {store.folder} was encoded by other model weights; give the "
                         "model that encoded it")  # fmt: skip
    encoder.eval()
    vectors = embed_texts(encoder, list(texts.values()), "query")
    source = f"{len(texts)} queries of {queries}, encoded by {model}"
    return replace(recall, vectors=vectors, source=source, digest=path_fingerprint(queries))


def _recall_words(measured: dict[str, Any] | None) -> str:
    """What the index's output line says of its recall (nothing for a Milvus or unmeasured index)."""
    if not measured or measured.get("exact"):
        return " (flat: exact search)" if measured else ""
    settings = ", ".join(f"{name} {value}" for name, value in measured["parameters"].items())
    found = ", ".join(f"{key} {value:.4f}" for key, value in measured.items()
                      if key.startswith("recall@") and value is not None)  # fmt: skip
    target = f", meeting --target-recall {measured['target']}" if measured.get("target") is not None else ""
    return f" ({found} against exact search on {measured['held_out']}; {settings}{target})"


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
    from densekit.encoding.onnx_backend import use_backend
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
    app.command("index")(index)
    app.command("search")(search)
