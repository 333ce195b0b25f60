"""Options several sub-commands share, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from densekit.limits import MAX_RUN_DEPTH
from densekit.models.config import Pooling

if TYPE_CHECKING:
    from densekit.models.encoder import DenseEncoder
    from densekit.models.modules.route import Route

ModelArg = Annotated[
    str, typer.Argument(help="A model folder (Hugging Face, sentence-transformers or densekit) or a hub id.")
]
DataDirArg = Annotated[Path, typer.Argument(help="A BEIR or MS MARCO-style collection folder.")]
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
        "onnx int8 (dynamic quantisation).",
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
        help="torch, or onnx: ONNX Runtime on the CPU, exported at start and checked against torch "
        "(docs/performance.md).",
    ),
]
MmapIndexOpt = Annotated[
    bool, typer.Option("--mmap-index", help="Memory-map the index file, not read it in (docs/scale.md).")
]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Draw progress bars.")]
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


def load_encoder(
    model: str,
    device: str,
    pooling: str | None,
    normalize: bool | None,
    query_max_length: int | None,
    passage_max_length: int | None,
    query_prefix: str | None,
    passage_prefix: str | None,
    trust_remote_code: bool,
    module: Path | None = None,
) -> DenseEncoder:
    """Load `model` (with `module` on it) with the command line's overrides and move it to `device`."""
    from densekit.encoding.device import resolve_device
    from densekit.models.encoder import DenseEncoder

    encoder = DenseEncoder.load(
        model,
        trust_remote_code=trust_remote_code,
        module=module,
        pooling=pooling,
        normalize=normalize,
        query_max_length=query_max_length,
        passage_max_length=passage_max_length,
        query_prefix=query_prefix,
        passage_prefix=passage_prefix,
    )
    return encoder.to(resolve_device(device))


def load_route(
    model: str, device: str, module: Path | None, domain: object, **overrides: object
) -> Route | None:
    """The route when `model` is a route folder, else None. A route names its base, modules and settings,
    so `module` and encoder `overrides` are refused with one; `domain` (a fixed route's) is refused
    without one."""
    from densekit.encoding.device import resolve_device
    from densekit.models.modules.route import Route, is_route_folder

    if not is_route_folder(model):
        if domain:
            raise ValueError("--domain chooses a module through a route: give a route folder as MODEL")
        return None
    given = [f"--{name.replace('_', '-')}" for name, value in overrides.items() if value is not None]
    if module is not None or given:
        named = ", ".join([*(["--module"] if module is not None else []), *given])
        raise ValueError(
            f"{model} is a route folder: it names its base, modules and settings; {named} do not apply"
        )
    route = Route.load(model, resolve_device(device))
    check_route_domains(model, route, domain)
    return route


def check_route_domains(model: str, route: Route, domain: object) -> None:
    """Refuse `--domain` values a fixed route does not route (and has no fallback for), listing its
    domains, before any work."""
    given = [domain] if isinstance(domain, str) else list(domain or [])  # type: ignore[call-overload]
    spec = route.spec
    if spec.type != "fixed" or spec.fallback is not None:
        return
    unknown = [name for name in given if name not in spec.domains]
    if unknown:
        raise ValueError(
            f"--domain {unknown[0]!r}: the route {model} routes the domains {', '.join(spec.domains)} "
            "(and has no fallback for others)"
        )
