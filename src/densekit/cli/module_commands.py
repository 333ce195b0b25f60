"""`densekit modules ...`: what to do with a trained module besides encoding with it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from densekit.cli.options import DeviceOpt, OverwriteOpt, collections
from densekit.errors import SettingError

log = logging.getLogger("densekit")

modules_app = typer.Typer(
    help="Work with parameter-efficient modules (docs/modules.md, docs/routing.md).", no_args_is_help=True
)


@modules_app.command("merge")
def merge(
    module: Annotated[Path, typer.Argument(help="A module folder (it names its base).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The full model folder to write.")],
    overwrite: OverwriteOpt = False,
) -> None:
    """Fold a module into its base: a full model folder that transformers and sentence-transformers load,
    with the module's embeddings. Kinds that change the base's own weights fold (LoRA, IA3, BitFit, a
    sparse difference...: docs/modules.md says which); one that adds layers or inputs is refused."""
    from densekit.io.outputs import check_artefact_output
    from densekit.models.encoder import MODEL_KIND, DenseEncoder
    from densekit.models.merge import merged_encoder

    encoder = DenseEncoder.load(module)
    merged = merged_encoder(encoder, encoder.own)
    check_artefact_output(output, MODEL_KIND, merged.identity(), [module], overwrite)
    merged.save(output)
    log.info("wrote %s: %s with module %s folded in", output, encoder.source, encoder.own)


ModulesArg = Annotated[
    list[Path], typer.Argument(help="Module folders of one base (each names it), two or more.")
]


def _check_output(output: Path, inputs: list[Path]) -> None:
    """Refuse, before anything is loaded, an output that is one of the inputs or holds one, or lies in a
    collection folder."""
    from densekit.io.outputs import check_not_in_collection, check_not_input

    check_not_input(output, inputs)
    check_not_in_collection(output)


def _check_module_folder(output: Path, encoder, name: str, inputs: list[Path], overwrite: bool) -> None:
    """Refuse an output folder holding a module densekit made from other modules or settings, unless
    `overwrite`; the identity is the one `EncoderModule.save` records for the module called `name`."""
    from densekit.io.outputs import check_artefact_output
    from densekit.models.modules.module import MODULE_KIND

    module = encoder.module_named(name)
    identity = {"base": module.base["fingerprint"], "module": module.fingerprint(),
                "settings": encoder.config.model_dump()}  # fmt: skip
    check_artefact_output(output, MODULE_KIND, identity, inputs, overwrite)


def _load_modules(folders: list[Path]):
    """Two or more modules on their base (see `load_modules`)."""
    from densekit.routing.route import load_modules

    if len(folders) < 2:
        raise SettingError("give two or more module folders")
    return load_modules(folders)


@modules_app.command("route")
def route(
    modules: ModulesArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The route folder to write.")],
    domain: Annotated[
        list[str], typer.Option("--domain", help="DOMAIN=MODULE_NAME: queries of DOMAIN go to that module.")
    ],
    fallback: Annotated[
        str | None, typer.Option(help="Module name (or 'base') for a domain not listed; default: an error.")
    ] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Write a fixed route: each query's domain (`densekit search --domain`) picks its module. The modules
    must leave passages to the base (towers: query), so one index of the base's passages serves them all.
    A domain is given once; OUTPUT holding a route of other modules or domains is replaced only with
    --overwrite."""
    from densekit.io.outputs import check_artefact_output
    from densekit.routing.route import ROUTE_KIND, Route
    from densekit.routing.strategies import RouteSpec
    from densekit.routing.strategy import BASE

    _check_output(output, modules)
    pairs = {}
    for item in domain:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise SettingError(f"--domain {item!r} is not DOMAIN=MODULE_NAME")
        if key in pairs:
            raise SettingError(f"--domain {key} given twice ({key}={pairs[key]}, {item}): give a domain once")
        pairs[key] = value
    encoder, names = _load_modules(modules)
    unknown = sorted({*pairs.values(), *([fallback] if fallback else [])} - {*names, BASE})
    if unknown:
        raise SettingError(
            f"--domain/--fallback name {', '.join(map(repr, unknown))}: no module of that name was given "
            f"(the modules: {', '.join(names)}; or {BASE!r} for the base alone)"
        )
    spec = RouteSpec(type="fixed", modules=names, domains=pairs, fallback=fallback)
    made = Route(encoder, spec)
    check_artefact_output(output, ROUTE_KIND, {"route": made.fingerprint()}, modules, overwrite)
    made.save(output, dict(zip(names, modules, strict=True)))
    log.info("wrote %s: domains %s", output, ", ".join(f"{k} -> {v}" for k, v in pairs.items()))


@modules_app.command("average")
def average(
    modules: ModulesArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The module folder to write.")],
    weights: Annotated[str, typer.Option(help="One weight per module, comma-separated, summing to 1.")],
    name: Annotated[str, typer.Option(help="The averaged module's name.")] = "averaged",
    overwrite: OverwriteOpt = False,
) -> None:
    """Average modules by their parameters into one module (LoRA: the weighted average of their weight
    changes, exactly; other kinds: of each tensor, same settings only). OUTPUT holding a module of
    other weights is replaced only with --overwrite, and is never one of the modules."""
    from densekit.models.averaging import average_modules

    _check_output(output, modules)
    encoder, names = _load_modules(modules)
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise SettingError(f"--weights {weights!r} is not a comma-separated list of numbers") from None
    average_modules(encoder, names, values, name)
    _check_module_folder(output, encoder, name, modules, overwrite)
    encoder.save(output, module=name)
    log.info("wrote %s: %s", output, " + ".join(f"{w:g} x {n}" for w, n in zip(values, names, strict=True)))


@modules_app.command("generate")
def generate(
    hypernetwork: Annotated[Path, typer.Argument(help="A trained hypernetwork's folder.")],
    domain: Annotated[str, typer.Option(help="The domain whose module to write.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The module folder to write.")],
    overwrite: OverwriteOpt = False,
) -> None:
    """Write the module a hypernetwork generates for one of its domains: an ordinary LoRA module folder
    (query-only) that every command takes with --module; one of another module is replaced only with
    --overwrite."""
    from densekit.routing.hypernetwork import LoraHypernetwork

    _check_output(output, [hypernetwork])
    network = LoraHypernetwork.load(hypernetwork)
    network.module_for(domain)
    _check_module_folder(output, network.encoder, domain, [hypernetwork], overwrite)
    network.encoder.save(output, module=domain)
    log.info("wrote %s: the module of domain %r", output, domain)


@modules_app.command("diagnose")
def diagnose(
    route_dir: Annotated[Path, typer.Argument(help="A route folder.")],
    data_dirs: Annotated[
        list[Path],
        typer.Argument(help="Collections whose queries are routed (folders or names).", callback=collections),
    ],
    split: Annotated[str, typer.Option(help="The split whose queries are used.")] = "test",
    domain: Annotated[
        list[str] | None,
        typer.Option("--domain", help="Each collection's domain, in order (a fixed route needs them)."),
    ] = None,
    json_output: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the heat map (PNG).")] = None,
    device: DeviceOpt = "auto",
    overwrite: OverwriteOpt = False,
) -> None:
    """How a route uses its modules on each collection's queries: mean weight and top-choice share per
    module, the weights' entropy, and collapse (a module taking nearly every query, or none)."""
    from rich.console import Console
    from rich.table import Table

    from densekit.data.dataset import Dataset
    from densekit.device import resolve_device
    from densekit.evaluation.routing import plot_usage, route_usage
    from densekit.io.outputs import check_file_output, command_identity, write_output_text
    from densekit.plots import PLOT_KIND
    from densekit.routing.route import Route

    if domain and len(domain) != len(data_dirs):
        raise SettingError(f"{len(domain)} --domain values for {len(data_dirs)} collections")
    inputs = [route_dir, *data_dirs]
    identity = command_identity("modules diagnose", {"split": split, "domains": domain}, inputs)
    for path, kind in ((json_output, "routing report"), (plot, PLOT_KIND)):
        if path is not None:
            check_file_output(path, kind, inputs, identity, overwrite)
    route = Route.load(route_dir, resolve_device(device))
    collections = {}
    for i, data_dir in enumerate(data_dirs):
        queries, _ = Dataset.open(data_dir).split_queries(split)
        name = domain[i] if domain else Path(data_dir).name
        collections[name] = (list(queries.values()), domain[i] if domain else None)
    report = route_usage(route, collections)
    table = Table(title=f"{report['route']} route over {', '.join(report['modules'])} ({split} queries)")
    table.add_column("collection")
    for module in report["modules"]:
        table.add_column(f"{module}: weight / top", justify="right")
    table.add_column("entropy", justify="right")
    for name, row in report["collections"].items():
        cells = [f"{row['mean_weight'][m]:.2f} / {row['top_share'][m]:.0%}" for m in report["modules"]]
        table.add_row(name, *cells, f"{row['entropy']:.2f} of {report['max_entropy']:.2f}")
    console = Console()
    console.print(table)
    for finding in report["collapse"]:
        console.print(f"collapse: {finding}")
    if json_output is not None:
        import json

        text = json.dumps(report, indent=2) + "\n"
        write_output_text(json_output, "routing report", text, identity, inputs, overwrite)
    if plot is not None:
        plot_usage(report, plot, identity)


def register(app: typer.Typer) -> None:
    """Add the `modules` command group to `app`."""
    app.add_typer(modules_app, name="modules")
