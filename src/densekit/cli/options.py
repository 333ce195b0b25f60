"""Options several sub-commands share, declared once."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from densekit.errors import SettingError
from densekit.limits import MAX_RUN_DEPTH
from densekit.models.config import EncoderOptions, Pooling

if TYPE_CHECKING:
    from densekit.models.encoder import DenseEncoder
    from densekit.routing.route import Route

ModelArg = Annotated[
    str, typer.Argument(help="A model folder (Hugging Face, sentence-transformers or densekit) or a hub id.")
]


def collections(value: Path | list[Path] | None) -> Path | list[Path] | None:
    """A collection argument's callback: a name (`irds:<ir_datasets id>`, `hf:<Hugging Face dataset>`)
    becomes its cached BEIR folder as the arguments are read, so every command reads, and records as
    its input, a folder (docs/data.md); a path stays as it is."""
    from densekit.data.named import resolve_collection

    if isinstance(value, list):
        return [resolve_collection(item) for item in value]
    return None if value is None else resolve_collection(value)


COLLECTION_HELP = "or a collection's name: irds:<ir_datasets id>, hf:<Hugging Face dataset> (docs/data.md)"
DataDirArg = Annotated[
    Path,
    typer.Argument(
        help=f"A BEIR or MS MARCO-style collection folder, {COLLECTION_HELP}.", callback=collections
    ),
]
SplitOpt = Annotated[str, typer.Option("--split", help="The qrels split whose queries are searched.")]
DepthOpt = Annotated[
    int,
    typer.Option(
        "--k", min=1, max=MAX_RUN_DEPTH, help=f"Documents retrieved per query (1 to {MAX_RUN_DEPTH:,})."
    ),
]
BatchOpt = Annotated[int, typer.Option("--batch-size", min=1, help="Texts encoded per batch.")]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto (a GPU if torch sees one), cpu, cuda, cuda:1...")
]
PrecisionOpt = Annotated[
    str,
    typer.Option(
        "--precision",
        help="float32; with --backend torch bf16/fp16 mixed precision (fp16 on a GPU only); with --backend "
        "onnx int8 (dynamic quantisation); with --backend openvino bf16 or int8 (calibrated on the corpus "
        "by encode).",
    ),
]
TorchPrecisionOpt = Annotated[
    str,
    typer.Option("--precision", help="float32, or bf16/fp16 mixed precision (fp16 on a GPU only)."),
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        help="torch, onnx (ONNX Runtime) or openvino (OpenVINO): on the CPU, exported at start and "
        "checked against torch (docs/performance.md).",
    ),
]
MmapIndexOpt = Annotated[
    bool, typer.Option("--mmap-index", help="Memory-map the index file, not read it in (docs/scale.md).")
]
ProgressOpt = Annotated[
    bool,
    typer.Option(
        "--progress/--no-progress",
        help="Show progress on standard error: a bar on a terminal, else a plain line (done/total, rate, "
        "ETA) at the start, every DENSEKIT_PROGRESS_INTERVAL seconds (30) and at the end.",
    ),
]
PoolingOpt = Annotated[Pooling | None, typer.Option("--pooling", help="Override the model's pooling.")]
NormalizeOpt = Annotated[
    bool | None, typer.Option("--normalize/--no-normalize", help="Override the model's L2 normalisation.")
]
QueryLengthOpt = Annotated[
    int | None, typer.Option("--query-max-length", min=1, help="Override the query token limit.")
]
PassageLengthOpt = Annotated[
    int | None, typer.Option("--passage-max-length", min=1, help="Override the passage token limit.")
]
QueryPrefixOpt = Annotated[
    str | None, typer.Option("--query-prefix", help="Override the text put before queries.")
]
PassagePrefixOpt = Annotated[
    str | None, typer.Option("--passage-prefix", help="Override the text put before passages.")
]
DimensionsOpt = Annotated[
    int | None,
    typer.Option(
        "--dimensions",
        min=1,
        help="Keep the first N dimensions of each vector, normalised again where the model normalises: at "
        "most its width, and one it was trained for where it records Matryoshka training (docs/training.md).",
    ),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an output densekit made by another command or from other settings or inputs (never "
        "anything else); the same command with the same settings may write it again without.",
    ),
]
ModuleOpt = Annotated[
    Path | None,
    typer.Option(
        "--module", help="A module folder to put on the model (docs/modules.md); MODEL must be its base."
    ),
]
RemoteCodeOpt = Annotated[
    bool, typer.Option("--trust-remote-code", help="Run code shipped with the model (off unless asked).")
]


# The options of `EncoderOptions`, by its field names, in its order.
_ENCODER_OPTIONS: dict[str, Any] = {
    "pooling": PoolingOpt, "normalize": NormalizeOpt, "query_max_length": QueryLengthOpt,
    "passage_max_length": PassageLengthOpt, "query_prefix": QueryPrefixOpt,
    "passage_prefix": PassagePrefixOpt, "dimensions": DimensionsOpt, "module": ModuleOpt,
    "trust_remote_code": RemoteCodeOpt,
}  # fmt: skip


def with_encoder_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the options that say how an encoder is loaded (`EncoderOptions`' fields, declared
    here once) in place of its `encoder_options: EncoderOptions` parameter, which it is then given as
    one object. typer has no option groups; this is one."""
    signature = inspect.signature(command, eval_str=True)
    defaults = EncoderOptions()
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name != "encoder_options":
            parameters.append(parameter)
            continue
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters += [
            inspect.Parameter(name, kind, default=getattr(defaults, name), annotation=annotation)
            for name, annotation in _ENCODER_OPTIONS.items()
        ]

    @functools.wraps(command)
    def run(**given: Any) -> None:
        options = EncoderOptions(**{name: given.pop(name) for name in _ENCODER_OPTIONS})
        command(**given, encoder_options=options)

    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return run


def load_model(
    model: str, device: str, options: EncoderOptions, domain: object = None, **command_options: object
) -> tuple[DenseEncoder, Route | None]:
    """The encoder MODEL names on `device`, with its route when MODEL is a route folder. A route names its
    base, modules and settings, so `options` and the command's other options that set how it encodes
    (`command_options`, None when not given) are refused with one, naming them; `domain` (a fixed
    route's) is refused without one, and with one when the route does not route it. A mistyped MODEL or
    --module folder is refused before torch is imported."""
    check_model_inputs(model, options)
    from densekit.routing.model_or_route import load_model_or_route
    from densekit.routing.route import is_route_folder

    if domain and not is_route_folder(model):
        raise SettingError("--domain chooses a module through a route: give a route folder as MODEL")
    given = [f"--{name.replace('_', '-')}" for name, value in command_options.items() if value is not None]
    encoder, route = load_model_or_route(model, device, options, given)
    if route is not None:
        check_route_domains(model, route, domain)
    return encoder, route


def check_model_inputs(model: str, options: EncoderOptions) -> None:
    """Refuse a mistyped MODEL (`check_model_name`) or --module folder, before torch is imported."""
    check_model_name(model)
    if options.module is not None and not Path(options.module).is_dir():
        raise SettingError(f"--module {options.module}: module folder not found")


def check_index_folder(folder: Path) -> None:
    """Refuse, before torch is imported, a folder that is not one `densekit index` wrote, as loading it
    would (its files are checked when it loads)."""
    from densekit.index.base import KIND
    from densekit.io.artefact import open_artefact

    open_artefact(folder, KIND, "index folder")


def check_model_name(model: str) -> None:
    """Refuse MODEL, before torch is imported, when it is no local folder, no bundled model and cannot be
    a hub id (a mistyped path); whether the hub has an id is asked when the model loads."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from densekit.models.hub import ModelNotFoundError, resolve_model_path

    if Path(resolve_model_path(model)).exists():
        return
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {model!r}: no such folder, and not a hub id (as sentence-transformers/all-MiniLM-L6-v2 "
            "is)"
        ) from None


def check_route_domains(model: str, route: Route, domain: object) -> None:
    """Refuse `--domain` values a fixed route does not route (and has no fallback for), listing its
    domains, before any work."""
    given = [domain] if isinstance(domain, str) else list(domain or [])  # type: ignore[call-overload]
    spec = route.spec
    if not route.strategy.takes_domains or spec.fallback is not None:
        return
    unknown = [name for name in given if name not in spec.domains]
    if unknown:
        raise SettingError(
            f"--domain {unknown[0]!r}: the route {model} routes the domains {', '.join(spec.domains)} "
            "(and has no fallback for others)"
        )
