"""`densekit serve`."""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from densekit.cli.options import BackendOpt, DeviceOpt, MmapIndexOpt, ModelArg, ModuleOpt

log = logging.getLogger("densekit")
API_KEY_VARIABLE = "DENSEKIT_API_KEY"


def read_api_key(api_key_file: Path | None) -> str | None:
    """The token from `api_key_file` (its first line) or the DENSEKIT_API_KEY variable, or None."""
    if api_key_file is not None:
        lines = api_key_file.read_text(encoding="utf-8").splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"{api_key_file}:1: empty: write the token on the first line")
        return key
    key = os.environ.get(API_KEY_VARIABLE, "").strip()
    return key or None


def _module_and_index(text: str) -> tuple[Path, Path]:
    """`MODULE_DIR=INDEX_DIR` as two paths."""
    module_dir, sep, index_dir = text.partition("=")
    if not sep or not module_dir or not index_dir:
        raise ValueError(f"--module-index {text}: give MODULE_DIR=INDEX_DIR")
    return Path(module_dir), Path(index_dir)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    model: ModelArg,
    index_dir: Annotated[Path, typer.Argument(help="A folder written by `densekit index`.")],
    corpus: Annotated[
        Path | None,
        typer.Option(
            "--corpus", help="The collection the index was built from: hits then carry their texts."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="The port to listen on.")] = 8000,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            "--api-key-file", help=f"A file whose first line is the bearer token (or set {API_KEY_VARIABLE})."
        ),
    ] = None,
    module: ModuleOpt = None,
    module_index: Annotated[
        list[str] | None,
        typer.Option(
            "--module-index",
            help="Serve another module of MODEL too, as MODULE_DIR=INDEX_DIR (its own index); repeatable. "
            "Requests choose it by the module's name.",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    mmap_index: MmapIndexOpt = False,
    backend: BackendOpt = "torch",
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            help="auto: the fastest measured to keep quality here (bf16 on a GPU with it or a CPU with "
            "AVX512-BF16 or AMX, else float32; float32 with --backend onnx); or float32, bf16, fp16 (GPU), "
            "int8 (--backend onnx).",
        ),
    ] = "auto",
    max_batch: Annotated[int, typer.Option(min=1, help="Texts encoded together at most.")] = 64,
    max_wait_ms: Annotated[
        float, typer.Option(min=0, help="How long a text waits for others to share its batch.")
    ] = 5.0,
    encode_batch: Annotated[
        int, typer.Option(min=1, help="Texts run through the model at a time, sorted by length.")
    ] = 16,
    max_k: Annotated[int, typer.Option(min=1, help="Most hits a query may ask for.")] = 1000,
    max_queries: Annotated[
        int, typer.Option(min=1, help="Most queries (or /v1/embeddings inputs) in one request.")
    ] = 64,
    max_query_chars: Annotated[int, typer.Option(min=1, help="Longest /search query, in characters.")] = 2000,
    max_input_chars: Annotated[
        int, typer.Option(min=1, help="Longest /v1/embeddings input (a passage, say), in characters.")
    ] = 100_000,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Largest request body.")] = 1_000_000,
    max_queued: Annotated[
        int, typer.Option(min=1, help="Texts that may wait to be encoded; past it, 429 with Retry-After.")
    ] = 1024,
    request_timeout: Annotated[
        float,
        typer.Option(min=0, help="Seconds a request may wait for its answer; past it, 503 (0: no limit)."),
    ] = 30.0,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The name /v1/embeddings answers to (default: MODEL as given)."),
    ] = None,
    open_metrics: Annotated[
        bool, typer.Option("--open-metrics", help="Serve /metrics without the token (for a scraper).")
    ] = False,
) -> None:
    """Serve MODEL and INDEX_DIR over HTTP: POST /search, OpenAI's POST /v1/embeddings and GET /v1/models,
    GET /documents/{id}, /info, /metrics (Prometheus), /health, a search page at / and the API's docs at
    /docs (docs/serving.md).

    Everything is loaded and checked before the port opens. Without a token (--api-key-file or
    DENSEKIT_API_KEY) it serves only on a loopback address. Ctrl-C or SIGTERM finishes the requests in
    flight, then exits.
    """
    import uvicorn

    from densekit.encoding.device import autocast, fastest_precision
    from densekit.encoding.onnx_backend import use_backend
    from densekit.retrieval.retriever import Retriever
    from densekit.serving.app import Batching, Limits, create_app

    if max_queued < max_queries:
        raise ValueError(
            f"--max-queued {max_queued} is below --max-queries {max_queries}: a request of more texts than "
            "the queue holds would be refused as busy however long it waited"
        )
    api_key = read_api_key(api_key_file)
    if api_key is None and not _is_loopback(host):
        raise ValueError(
            f"--host {host} is reachable from other machines: give a token with --api-key-file or "
            f"{API_KEY_VARIABLE}"
        )
    limits = Limits(max_query_chars=max_query_chars, max_input_chars=max_input_chars, max_k=max_k,
                    max_queries=max_queries, max_body_bytes=max_body_bytes, max_queued=max_queued,
                    request_timeout_s=request_timeout or None)  # fmt: skip
    extra = [_module_and_index(text) for text in module_index or []]
    retrievers = [
        Retriever.open(model, index_dir, corpus, module, device, show_progress=True, mmap_index=mmap_index)
    ]
    if retrievers[0].route is not None and extra:
        raise ValueError(f"{model} is a route: it serves its modules itself; --module-index does not apply")
    encoder = retrievers[0].encoder
    for module_dir, extra_index in extra:
        encoder.load_module(module_dir)  # shares the base; activated while its retriever is checked
        retrievers.append(
            Retriever.over(encoder, extra_index, corpus, show_progress=True, mmap_index=mmap_index)
        )
    encoder.activate(retrievers[0].module)
    if backend == "onnx" and (retrievers[0].route is not None or extra):
        raise ValueError(f"--backend {backend} serves one model and its index: not a route or --module-index")
    reason = f"--precision {precision}"
    if precision == "auto":
        chosen = ("float32", "--backend onnx") if backend == "onnx" else fastest_precision(encoder.device)
        precision, reason = chosen[0], f"auto: {chosen[1]}"
    query_precision = use_backend(encoder, backend, precision)
    autocast(encoder.device, query_precision)  # fp16 on a CPU is refused now, not at the first request
    batching = Batching(max_batch=max_batch, max_wait_ms=max_wait_ms, encode_batch=encode_batch)
    app = create_app(retrievers, api_key, limits, batching, query_precision,
                     served_model_name or model, open_metrics, reason)  # fmt: skip
    log.info("serving %s over %s on http://%s:%d (token %s; %s at %s: %s)", model, index_dir, host, port,
             "required" if api_key else "not required", backend, precision, reason)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""
    app.command("serve")(serve)
