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

from densekit.cli.options import ModelArg, check_index_folder, check_model_name, load_model
from densekit.cli.serve_options import API_KEY_VARIABLE, Access, Served, with_serve_options
from densekit.errors import InputError, SettingError, StateError
from densekit.models.config import EncoderOptions
from densekit.serving.settings import Batching, ConnectionLimits, Limits

if TYPE_CHECKING:
    from densekit.models.encoder import DenseEncoder
    from densekit.retrieval.retriever import Retriever

log = logging.getLogger("densekit")
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
            raise InputError(f"{api_key_file}:1: empty: write the token on the first line")
        _check_token(key, f"{api_key_file}:1")
        return key
    if API_KEY_VARIABLE not in os.environ:
        return None
    key = os.environ[API_KEY_VARIABLE].strip()
    if not key:
        raise SettingError(f"{API_KEY_VARIABLE} is set but blank: set it to the token, or unset it to serve "
                         "without one (on a loopback address only)")  # fmt: skip
    _check_token(key, API_KEY_VARIABLE)
    return key


def _check_token(key: str, where: str) -> None:
    if not _TOKEN.fullmatch(key):
        raise SettingError(
            f"{where}: the token holds characters other than printable ASCII, which an HTTP header cannot "
            "carry as they are: use letters, digits and punctuation (e.g. `openssl rand -hex 24`)"
        )


def allowed_hosts(host: str, names: list[str]) -> list[str]:
    """The names a request's Host header may give besides IP addresses and localhost: `--host` (when it
    is a name) and each `--allowed-host`, checked to be host names (or "*", any)."""
    for name in names:
        if not _HOST_NAME.fullmatch(name):
            raise SettingError(
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
        raise SettingError(
            f"--host {host} --port {port}: cannot listen there ({reason}): stop what holds it or choose "
            "another --port"
        ) from None
    return sock


def _module_and_index(text: str) -> tuple[Path, Path]:
    """`MODULE_DIR=INDEX_DIR` as two paths."""
    module_dir, sep, index_dir = text.partition("=")
    if not sep or not module_dir or not index_dir:
        raise SettingError(f"--module-index {text}: give MODULE_DIR=INDEX_DIR")
    return Path(module_dir), Path(index_dir)


# The --precision values each --backend takes; auto is chosen once the model is loaded (`_precision`).
# OpenVINO's int8 is calibrated on a corpus's texts, which queries have none of (`runtimes.needs_calibration`)
_PRECISIONS = {
    "torch": ("auto", "float32", "bf16", "fp16"),
    "onnx": ("auto", "float32", "int8"),
    "openvino": ("auto", "float32", "bf16"),
}


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
        raise SettingError(f"--backend {backend}: expected torch, onnx or openvino")
    if precision in _PRECISIONS[backend]:
        return
    if backend == "openvino" and precision == "int8":
        raise SettingError(
            "--backend openvino --precision int8 is calibrated on a corpus's texts, and serve encodes "
            "queries: use bf16 or float32, or --backend onnx --precision int8"
        )
    if backend != "torch":
        runs = " or ".join(name for name in _PRECISIONS[backend] if name != "auto")
        raise SettingError(f"--backend {backend} runs {runs}, not {precision}")
    if precision == "int8":
        raise SettingError("--precision int8 runs through ONNX Runtime: add --backend onnx")
    raise SettingError(
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
        raise StateError(f"the service did not start on {host}:{port}: see the log above")


@with_serve_options
def serve(
    model: ModelArg,
    index_dir: Annotated[Path, typer.Argument(help="A folder written by `densekit index`.")],
    served: Served,
    access: Access,
    batching: Batching,
    limits: Limits,
    connections: ConnectionLimits,
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
    host, port, backend = access.host, access.port, served.backend
    api_key = read_api_key(access.api_key_file)
    if api_key is None and not _is_loopback(host):
        raise SettingError(
            f"--host {host} is reachable from other machines: give a token with --api-key-file or "
            f"{API_KEY_VARIABLE}"
        )
    hosts = allowed_hosts(host, access.allowed_host)
    if backend != "torch" and served.module_index:
        raise SettingError(
            f"--backend {backend} serves one model and its index: not a route or --module-index"
        )
    # before torch loads: its idle OpenMP threads sleep rather than spin beside the event loop
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (docs/performance.md, "Serving")
    with claim_port(host, port) as sock:  # before torch and the model load: a port in use fails at once
        extra = check_before_loading(model, index_dir, served.corpus, served.module, served.module_index,
                                     backend, served.precision)  # fmt: skip
        from densekit.serving.app import create_app

        options = EncoderOptions(module=served.module, dimensions=served.dimensions)
        retrievers = _retrievers(model, index_dir, served.corpus, options, extra, served.device,
                                 served.mmap_index)  # fmt: skip
        if backend != "torch" and retrievers[0].route is not None:
            raise SettingError(f"--backend {backend} serves one model and its index: not a route")
        query_precision, precision, reason = _precision(retrievers[0].encoder, backend, served.precision)
        app = create_app(retrievers, api_key, limits, batching, query_precision,
                         served.served_model_name or model, access.open_metrics, reason, hosts)  # fmt: skip
        _enable_faulthandler()
        log.info("serving %s over %s on http://%s:%d (token %s; %s at %s: %s)", model, index_dir, host, port,
                 "required" if api_key else "not required", backend, precision, reason)  # fmt: skip
        _serve_on(app, sock, host, port, connections)


def _retrievers(
    model: str,
    index_dir: Path,
    corpus: Path | None,
    options: EncoderOptions,
    extra: list[tuple[Path, Path]],
    device: str,
    mmap_index: bool,
) -> list[Retriever]:
    """The retriever of MODEL, loaded with `options` (its module, its `--dimensions`), over `index_dir`,
    and one per `--module-index` pair (module folder, index folder) sharing its encoder, each encoding
    with its module; each index must hold vectors as the encoder makes them with it
    (`retrieval.dense.check_compatible`)."""
    from densekit.retrieval.retriever import Retriever

    encoder, route = load_model(model, device, options)
    if route is None:
        encoder.eval()
    retrievers = [
        Retriever.over(encoder, index_dir, corpus, show_progress=True, route=route, mmap_index=mmap_index)
    ]
    if retrievers[0].route is not None and extra:
        raise SettingError(f"{model} is a route: it serves its modules itself; --module-index does not apply")
    for module_dir, extra_index in extra:
        name = encoder.load_module(module_dir).name  # shares the base
        retrievers.append(Retriever.over(encoder, extra_index, corpus, show_progress=True,
                                         mmap_index=mmap_index, module=name))  # fmt: skip
    return retrievers


def _precision(encoder: DenseEncoder, backend: str, precision: str) -> tuple[str, str, str]:
    """Put `encoder` on `backend` at `precision` (auto: the fastest measured to keep quality here), and
    return the precision torch's autocast uses, the precision chosen and why."""
    from densekit.device import autocast, fastest_precision
    from densekit.encoding.runtimes import use_backend

    reason = f"--precision {precision}"
    if precision == "auto":
        exported = ("float32", f"--backend {backend}")
        chosen = exported if backend != "torch" else fastest_precision(encoder.device)
        precision, reason = chosen[0], f"auto: {chosen[1]}"
    query_precision = use_backend(encoder, backend, precision)
    autocast(encoder.device, query_precision)  # fp16 on a CPU is refused now, not at the first request
    return query_precision, precision, reason


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""
    app.command("serve")(serve)
