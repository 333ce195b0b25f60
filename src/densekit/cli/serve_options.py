"""`densekit serve`'s options in groups, each declared once and given to the command as one object, as
`options.with_encoder_options` gives an encoder's: what is served (`Served`), where and to whom
(`Access`), how texts are batched, what a request may ask and what a connection may take (the service's
own `Batching`, `Limits` and `ConnectionLimits`, their defaults read from them)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from densekit.cli.options import BackendOpt, DeviceOpt, DimensionsOpt, MmapIndexOpt, ModuleOpt
from densekit.errors import SettingError
from densekit.serving.settings import Batching, ConnectionLimits, Limits

API_KEY_VARIABLE = "DENSEKIT_API_KEY"


@dataclass(frozen=True)
class OptionGroup:
    """Options a command takes as one object: each of `options` (a parameter name, its typer type and its
    default) becomes a parameter of the command in place of its `parameter`, and `make` builds the
    object from their values, refusing (a ValueError) what the options alone cannot."""

    parameter: str
    options: dict[str, tuple[Any, Any]]
    make: Callable[..., object]


def with_option_groups(*groups: OptionGroup) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command with each group's options in place of its parameter, which it is given as one object.
    typer has no option groups; these are some."""

    def grouped(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        by_parameter = {group.parameter: group for group in groups}
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters = []
        for parameter in signature.parameters.values():
            group = by_parameter.get(parameter.name)
            if group is None:
                parameters.append(parameter)
                continue
            parameters += [inspect.Parameter(name, kind, default=default, annotation=annotation)
                           for name, (annotation, default) in group.options.items()]  # fmt: skip

        @functools.wraps(command)
        def run(**given: Any) -> None:
            for group in groups:
                given[group.parameter] = group.make(**{name: given.pop(name) for name in group.options})
            command(**given)

        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
        return run

    return grouped


@dataclass(frozen=True)
class Served:
    """What `serve` serves besides MODEL and INDEX_DIR, and how it encodes (`dimensions`: the width its
    vectors are cut to, which its indexes must hold)."""

    corpus: Path | None
    module: Path | None
    module_index: list[str]
    dimensions: int | None
    device: str
    mmap_index: bool
    backend: str
    precision: str
    served_model_name: str | None


@dataclass(frozen=True)
class Access:
    """Where `serve` listens and who may call it."""

    host: str
    port: int
    api_key_file: Path | None
    allowed_host: list[str]
    open_metrics: bool


def _option(kind: Any, default: Any, help: str, *names: str, **bounds: Any) -> tuple[Any, Any]:
    """An option of type `kind` with its `default`, `help`, flag `names` (default: the parameter's) and
    typer's `bounds` (min, max)."""
    return Annotated[kind, typer.Option(*names, help=help, **bounds)], default


def _default(settings: type[Any], field: str) -> Any:
    """The default of a field of the service's settings (`Limits`, `Batching`, `ConnectionLimits`)."""
    return settings.model_fields[field].default


SERVED = OptionGroup("served", {
    "corpus": _option(Path | None, None, "The collection the index was built from: hits then carry their "
                      "texts.", "--corpus"),
    "module": (ModuleOpt, None),
    "module_index": _option(list[str] | None, None, "Serve another module of MODEL too, as "
                            "MODULE_DIR=INDEX_DIR (its own index); repeatable. Requests choose it by the "
                            "module's name.", "--module-index"),
    "dimensions": (DimensionsOpt, None),
    "device": (DeviceOpt, "auto"),
    "mmap_index": (MmapIndexOpt, False),
    "backend": (BackendOpt, "torch"),
    "precision": _option(str, "auto", "auto: the fastest measured to keep quality here (bf16 on a GPU with "
                         "it or a CPU with AVX512-BF16 or AMX, else float32; float32 with --backend onnx or "
                         "openvino); or float32, bf16 (torch, openvino), fp16 (GPU), int8 (--backend onnx).",
                         "--precision"),
    "served_model_name": _option(str | None, None, "The name /v1/embeddings answers to (default: MODEL as "
                                 "given)."),
}, make=lambda module_index, **given: Served(module_index=module_index or [], **given))  # fmt: skip

ACCESS = OptionGroup("access", {
    "host": _option(str, "127.0.0.1", "The address to listen on."),
    "port": _option(int, 8000, "The port to listen on.", min=0, max=65535),
    "api_key_file": _option(Path | None, None, "A file whose first line is the bearer token (or set "
                            f"{API_KEY_VARIABLE}).", "--api-key-file"),
    "allowed_host": _option(list[str] | None, None, "A name requests may give as Host besides localhost, IP "
                            "addresses and --host (a reverse proxy's, say); repeatable; * allows any. Other "
                            "names get 403 (against DNS rebinding).", "--allowed-host"),
    "open_metrics": _option(bool, False, "Serve /metrics without the token (for a scraper).",
                            "--open-metrics"),
}, make=lambda allowed_host, **given: Access(allowed_host=allowed_host or [], **given))  # fmt: skip

BATCHING = OptionGroup("batching", {
    "max_batch": _option(int, _default(Batching, "max_batch"), "Texts encoded together at most.", min=1),
    "max_wait_ms": _option(float, _default(Batching, "max_wait_ms"), "How long a text waits for others to "
                           "share its batch while the service is under concurrent load (a client alone does "
                           "not wait).", min=0),
    "encode_batch": _option(int, _default(Batching, "encode_batch"), "Most texts run through the model at a "
                            "time, sorted by length (fewer where the padding would cost more than another "
                            "pass).", min=1),
    "encode_workers": _option(int | None, _default(Batching, "workers"), "Batches encoded at once, each on a "
                              "thread of its own: one encoded while the next is gathered (default: 2 on a "
                              "CPU, 1 on a GPU or with --backend onnx or openvino).", min=1),
}, make=lambda encode_workers, **given: Batching(workers=encode_workers, **given))  # fmt: skip


def _limits(request_timeout: float, **given: Any) -> Limits:
    """The service's `Limits`, a --request-timeout of 0 meaning none; a --max-queued below --max-queries
    refused."""
    if given["max_queued"] < given["max_queries"]:
        raise SettingError(
            f"--max-queued {given['max_queued']} is below --max-queries {given['max_queries']}: a request of "
            "more texts than the queue holds would be refused as busy however long it waited"
        )
    return Limits(request_timeout_s=request_timeout or None, **given)


LIMITS = OptionGroup("limits", {
    "max_k": _option(int, _default(Limits, "max_k"), "Most hits a query may ask for.", min=1),
    "max_hits": _option(int, _default(Limits, "max_hits"), "Most hits one /search request may ask for: its "
                        "queries times k.", min=1),
    "max_queries": _option(int, _default(Limits, "max_queries"), "Most queries (or /v1/embeddings inputs) in "
                           "one request.", min=1),
    "max_query_chars": _option(int, _default(Limits, "max_query_chars"), "Longest /search query, in "
                               "characters.", min=1),
    "max_input_chars": _option(int, _default(Limits, "max_input_chars"), "Longest /v1/embeddings input (a "
                               "passage, say), in characters.", min=1),
    "max_body_bytes": _option(int, _default(Limits, "max_body_bytes"), "Largest request body.", min=1),
    "max_text_chars": _option(int, _default(Limits, "max_text_chars"), "Most characters of document titles "
                              "and texts in one /search answer; past it, lower-ranked hits come without "
                              "them, counted in texts_left_out (GET /documents/{id} gives one).", min=0),
    "max_queued": _option(int, _default(Limits, "max_queued"), "Texts that may wait to be encoded; past it, "
                          "429 with Retry-After.", min=1),
    "request_timeout": _option(float, _default(Limits, "request_timeout_s"), "Seconds a request may wait for "
                               "its answer; past it, 503 (0: no limit).", min=0),
}, make=_limits)  # fmt: skip


def _connections(header_timeout: float, body_timeout: float, idle_timeout: float,
                 max_connections: int) -> ConnectionLimits:  # fmt: skip
    """The service's `ConnectionLimits`, each time above 0."""
    for flag, seconds in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout),
                          ("--idle-timeout", idle_timeout)):  # fmt: skip
        if seconds <= 0:
            raise SettingError(f"{flag} {seconds:g}: give a number of seconds above 0")
    return ConnectionLimits(header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                            idle_timeout_s=idle_timeout, max_connections=max_connections)  # fmt: skip


CONNECTIONS = OptionGroup("connections", {
    "header_timeout": _option(float, _default(ConnectionLimits, "header_timeout_s"), "Seconds a request's "
                              "line and headers may take to arrive, from its first byte; past it, 408 and "
                              "the connection closed.", min=0),
    "body_timeout": _option(float, _default(ConnectionLimits, "body_timeout_s"), "Seconds a request's body "
                            "may take to arrive, from its headers; past it, 408 and the connection closed.",
                            min=0),
    "idle_timeout": _option(float, _default(ConnectionLimits, "idle_timeout_s"), "Seconds a connection may "
                            "stay open with no request under way.", min=0),
    "max_connections": _option(int, _default(ConnectionLimits, "max_connections"), "Connections open at once "
                               "(lowered to fit `ulimit -n`); past it, the one waiting longest for a request "
                               "is closed.", min=1),
}, make=_connections)  # fmt: skip

with_serve_options = with_option_groups(SERVED, ACCESS, BATCHING, LIMITS, CONNECTIONS)
