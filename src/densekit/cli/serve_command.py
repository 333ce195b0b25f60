"""`densekit serve`."""

from __future__ import annotations

import faulthandler
import ipaddress
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from densekit.cli.options import (
    BackendOpt,
    DeviceOpt,
    MmapIndexOpt,
    ModelArg,
    ModuleOpt,
    check_index_folder,
    check_model_name,
)

if TYPE_CHECKING:
    from densekit.models.encoder import DenseEncoder
    from densekit.retrieval.retriever import Retriever
    from densekit.serving.connections import ConnectionLimits

log = logging.getLogger("densekit")
API_KEY_VARIABLE = "DENSEKIT_API_KEY"
# What a token may hold: printable ASCII. An HTTP header carries bytes that servers read as Latin-1, so a
# token of other characters could never match the one sent (and clients cannot send it).
_TOKEN = re.compile(r"[\x20-\x7e]+")
# A host name as --allowed-host takes it: letters, digits, dots, hyphens and underscores, or "*".
_HOST_NAME = re.compile(r"\*|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")


def read_api_key(api_key_file: Path | None) -> str | None:
    """The token from `api_key_file` (its first line) or the DENSEKIT_API_KEY variable, or None where
    neither is given; a blank one, or one of other characters than printable ASCII, is refused."""
    if api_key_file is not None:
        lines = api_key_file.read_text(encoding="utf-8").splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"{api_key_file}:1: empty: write the token on the first line")
        _check_token(key, f"{api_key_file}:1")
        return key
    if API_KEY_VARIABLE not in os.environ:
        return None
    key = os.environ[API_KEY_VARIABLE].strip()
    if not key:
        raise ValueError(f"{API_KEY_VARIABLE} is set but blank: set it to the token, or unset it to serve "
                         "without one (on a loopback address only)")  # fmt: skip
    _check_token(key, API_KEY_VARIABLE)
    return key


def _check_token(key: str, where: str) -> None:
    if not _TOKEN.fullmatch(key):
        raise ValueError(
            f"{where}: the token holds characters other than printable ASCII, which an HTTP header cannot "
            "carry as they are: use letters, digits and punctuation (e.g. `openssl rand -hex 24`)"
        )


def allowed_hosts(host: str, names: list[str]) -> list[str]:
    """The names a request's Host header may give besides IP addresses and localhost: `--host` (when it
    is a name) and each `--allowed-host`, checked to be host names (or "*", any)."""
    for name in names:
        if not _HOST_NAME.fullmatch(name):
            raise ValueError(
                f"--allowed-host {name!r}: give a host name (e.g. search.example.com), without scheme, port "
                "or path, or * for any"
            )
    return [name.lower() for name in (host, *names)]


def claim_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (not yet listening), so that a port in use is an error before
    anything is loaded, and stays ours while the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    # TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on the connections of
    # a socket whose protocol says TCP, and with it on, a response's body, written after its headers,
    # waits for the client's delayed acknowledgement (40 ms on Linux)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: not over a listener
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        reason = err.strerror or str(err)
        raise ValueError(
            f"--host {host} --port {port}: cannot listen there ({reason}): stop what holds it or choose "
            "another --port"
        ) from None
    return sock


def _module_and_index(text: str) -> tuple[Path, Path]:
    """`MODULE_DIR=INDEX_DIR` as two paths."""
    module_dir, sep, index_dir = text.partition("=")
    if not sep or not module_dir or not index_dir:
        raise ValueError(f"--module-index {text}: give MODULE_DIR=INDEX_DIR")
    return Path(module_dir), Path(index_dir)


# The --precision values each --backend takes; auto is chosen once the model is loaded (`_precision`).
_PRECISIONS = {"torch": ("auto", "float32", "bf16", "fp16"), "onnx": ("auto", "float32", "int8")}


def check_before_loading(
    model: str,
    index_dir: Path,
    corpus: Path | None,
    module: Path | None,
    module_index: list[str],
    backend: str,
    precision: str,
) -> list[tuple[Path, Path]]:
    """Refuse, in one line and before torch is imported, a MODEL that is neither a folder nor a hub id,
    an index, corpus or module folder that is missing or of another kind, and a --backend or --precision
    densekit has not; return the --module-index pairs. What needs the model (its route, its index's
    match, fp16 on a CPU) is checked once it is loaded."""
    check_model_name(model)
    check_index_folder(index_dir)
    if corpus is not None:
        from densekit.data.dataset import Dataset

        Dataset.open(corpus)
    pairs = [_module_and_index(text) for text in module_index]
    for module_dir in ([module] if module is not None else []) + [pair[0] for pair in pairs]:
        if not module_dir.is_dir():
            from densekit.diagnostics import DataError, Problem

            raise DataError([Problem(module_dir, None, "module folder not found")])
    for _, extra_index in pairs:
        check_index_folder(extra_index)
    _check_precision(backend, precision)
    return pairs


def _check_precision(backend: str, precision: str) -> None:
    """Refuse a --backend densekit has not, and a --precision it does not run."""
    if backend not in _PRECISIONS:
        raise ValueError(f"--backend {backend}: expected torch or onnx")
    if precision in _PRECISIONS[backend]:
        return
    if backend == "onnx":
        raise ValueError(f"--backend onnx runs float32 or int8, not {precision}")
    if precision == "int8":
        raise ValueError("--precision int8 runs through ONNX Runtime: add --backend onnx")
    raise ValueError(
        f"--precision {precision}: expected auto, float32, bf16, fp16 or (with --backend onnx) int8"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _enable_faulthandler() -> None:
    """Have a fatal signal (SIGBUS from a mapped index truncated under a search, say) print the
    tracebacks of every thread on the process's standard error before it dies."""
    if sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__)  # sys.stderr may be a stream without a file descriptor


def _serve_on(app: object, sock: socket.socket, host: str, port: int, limits: ConnectionLimits) -> None:
    """Serve `app` on the bound socket until Ctrl-C or SIGTERM, letting requests in flight finish."""
    from densekit.serving.http_server import Server, server_config

    server = Server(server_config(app, host, port, limits))
    server.run(sockets=[sock])
    if not server.started:
        raise RuntimeError(f"the service did not start on {host}:{port}: see the log above")


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
        float,
        typer.Option(
            min=0,
            help="How long a text waits for others to share its batch while the "
            "service is under concurrent load (a client alone does not wait).",
        ),
    ] = 5.0,
    encode_batch: Annotated[
        int,
        typer.Option(
            min=1,
            help="Most texts run through the model at a time, sorted by length "
            "(fewer where the padding would cost more than another pass).",
        ),
    ] = 32,
    encode_workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Batches encoded at once, each on a thread of its own: one "
            "encoded while the next is gathered (default: 2 on a CPU, 1 on a GPU or "
            "with --backend onnx).",
        ),
    ] = None,
    max_k: Annotated[int, typer.Option(min=1, help="Most hits a query may ask for.")] = 1000,
    max_hits: Annotated[
        int, typer.Option(min=1, help="Most hits one /search request may ask for: its queries times k.")
    ] = 10_000,
    max_queries: Annotated[
        int, typer.Option(min=1, help="Most queries (or /v1/embeddings inputs) in one request.")
    ] = 64,
    max_query_chars: Annotated[int, typer.Option(min=1, help="Longest /search query, in characters.")] = 2000,
    max_input_chars: Annotated[
        int, typer.Option(min=1, help="Longest /v1/embeddings input (a passage, say), in characters.")
    ] = 100_000,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Largest request body.")] = 1_000_000,
    max_text_chars: Annotated[
        int,
        typer.Option(
            min=0,
            help="Most characters of document titles and texts in one /search answer; "
            "past it, lower-ranked hits come without them, counted in texts_left_out "
            "(GET /documents/{id} gives one).",
        ),
    ] = 1_000_000,
    max_queued: Annotated[
        int, typer.Option(min=1, help="Texts that may wait to be encoded; past it, 429 with Retry-After.")
    ] = 1024,
    request_timeout: Annotated[
        float,
        typer.Option(min=0, help="Seconds a request may wait for its answer; past it, 503 (0: no limit)."),
    ] = 30.0,
    header_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a request's line and headers may take to "
            "arrive, from its first byte; past it, 408 and the connection closed.",
        ),
    ] = 10.0,
    body_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a request's body may take to arrive, from "
            "its headers; past it, 408 and the connection closed.",
        ),
    ] = 30.0,
    idle_timeout: Annotated[
        float, typer.Option(min=0, help="Seconds a connection may stay open with no request under way.")
    ] = 5.0,
    max_connections: Annotated[
        int,
        typer.Option(
            min=1,
            help="Connections open at once (lowered to fit `ulimit -n`); past it, the "
            "one waiting longest for a request is closed.",
        ),
    ] = 1000,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The name /v1/embeddings answers to (default: MODEL as given)."),
    ] = None,
    open_metrics: Annotated[
        bool, typer.Option("--open-metrics", help="Serve /metrics without the token (for a scraper).")
    ] = False,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host",
            help="A name requests may give as Host besides localhost, IP addresses and --host (a reverse "
            "proxy's, say); repeatable; * allows any. Other names get 403 (against DNS rebinding).",
        ),
    ] = None,
) -> None:
    """Serve MODEL and INDEX_DIR over HTTP: POST /search, OpenAI's POST /v1/embeddings and GET /v1/models,
    GET /documents/{id}, /info, /metrics (Prometheus), /health, a search page at / and the API's docs at
    /docs (docs/serving.md).

    Paths, options and the token are checked before torch is imported, the rest once loaded, before the
    port opens; a port in use is an error before anything loads. Without a token (--api-key-file or
    DENSEKIT_API_KEY) it serves only on a loopback address. A request whose Host header is not an IP
    address, localhost, --host or an --allowed-host gets 403.
    Ctrl-C or SIGTERM finishes the requests in flight, then exits.
    """
    for flag, seconds in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout),
                          ("--idle-timeout", idle_timeout)):  # fmt: skip
        if seconds <= 0:
            raise ValueError(f"{flag} {seconds:g}: give a number of seconds above 0")
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
    hosts = allowed_hosts(host, allowed_host or [])
    if backend == "onnx" and module_index:
        raise ValueError(f"--backend {backend} serves one model and its index: not a route or --module-index")
    # before torch loads: its idle OpenMP threads sleep rather than spin beside the event loop
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (docs/performance.md, "Serving")
    with claim_port(host, port) as sock:  # before torch and the model load: a port in use fails at once
        extra = check_before_loading(model, index_dir, corpus, module, module_index or [], backend, precision)
        from densekit.serving.app import Batching, Limits, create_app
        from densekit.serving.connections import ConnectionLimits

        limits = Limits(max_query_chars=max_query_chars, max_input_chars=max_input_chars, max_k=max_k,
                        max_queries=max_queries, max_hits=max_hits, max_body_bytes=max_body_bytes,
                        max_text_chars=max_text_chars, max_queued=max_queued,
                        request_timeout_s=request_timeout or None)  # fmt: skip
        connections = ConnectionLimits(header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                                       idle_timeout_s=idle_timeout,
                                       max_connections=max_connections)  # fmt: skip
        retrievers = _retrievers(model, index_dir, corpus, module, extra, device, mmap_index)
        if backend == "onnx" and retrievers[0].route is not None:
            raise ValueError(f"--backend {backend} serves one model and its index: not a route")
        query_precision, precision, reason = _precision(retrievers[0].encoder, backend, precision)
        batching = Batching(max_batch=max_batch, max_wait_ms=max_wait_ms, encode_batch=encode_batch,
                            workers=encode_workers)  # fmt: skip
        app = create_app(retrievers, api_key, limits, batching, query_precision,
                         served_model_name or model, open_metrics, reason, hosts)  # fmt: skip
        _enable_faulthandler()
        log.info("serving %s over %s on http://%s:%d (token %s; %s at %s: %s)", model, index_dir, host, port,
                 "required" if api_key else "not required", backend, precision, reason)  # fmt: skip
        _serve_on(app, sock, host, port, connections)


def _retrievers(
    model: str,
    index_dir: Path,
    corpus: Path | None,
    module: Path | None,
    extra: list[tuple[Path, Path]],
    device: str,
    mmap_index: bool,
) -> list[Retriever]:
    """The retriever of MODEL (with `module`) over `index_dir`, and one per `--module-index` pair (module
    folder, index folder) sharing its encoder, the first module active."""
    from densekit.retrieval.retriever import Retriever

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
    return retrievers


def _precision(encoder: DenseEncoder, backend: str, precision: str) -> tuple[str, str, str]:
    """Put `encoder` on `backend` at `precision` (auto: the fastest measured to keep quality here), and
    return the precision torch's autocast uses, the precision chosen and why."""
    from densekit.device import autocast, fastest_precision
    from densekit.encoding.onnx_backend import use_backend

    reason = f"--precision {precision}"
    if precision == "auto":
        chosen = ("float32", "--backend onnx") if backend == "onnx" else fastest_precision(encoder.device)
        precision, reason = chosen[0], f"auto: {chosen[1]}"
    query_precision = use_backend(encoder, backend, precision)
    autocast(encoder.device, query_precision)  # fp16 on a CPU is refused now, not at the first request
    return query_precision, precision, reason


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""
    app.command("serve")(serve)
