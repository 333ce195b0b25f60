"""Sub-commands that judge retrievers: benchmark, compare, fuse, diagnose-negatives."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from densekit.cli.options import (
    COLLECTION_HELP,
    BackendOpt,
    BatchOpt,
    DepthOpt,
    DeviceOpt,
    ModelArg,
    ModuleOpt,
    OverwriteOpt,
    PrecisionOpt,
    ProgressOpt,
    SplitOpt,
    collections,
    load_model,
    with_encoder_options,
)
from densekit.data.trec import RUN_KIND, read_qrels, read_run, write_run
from densekit.diagnostics import Diagnostics
from densekit.errors import InputError, SettingError
from densekit.evaluation.measures import SCORES_KIND, parse_measures
from densekit.io.outputs import check_file_output, command_identity, write_output_text
from densekit.limits import DEFAULT_TRIALS, MAX_RUN_DEPTH, MAX_TRIALS
from densekit.models.config import EncoderOptions
from densekit.plots import PLOT_KIND

log = logging.getLogger("densekit")
console = Console(soft_wrap=True)
MeasureOpt = Annotated[
    list[str] | None, typer.Option("--measure", "-m", help="An ir_measures name, e.g. nDCG@10 (repeatable).")
]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Write the plot (PNG) here.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the figures as JSON here.")]


def _model_label(model: str, module: Path | None, dimensions: int | None = None) -> str:
    """A short name for a model in tables: its folder's name (its parent's when that is `model`), its
    module's and the dimensions its vectors are cut to."""
    path = Path(model)
    name = path.parent.name if path.name == "model" and path.parent.name else path.name
    name = f"{name} + {module.name}" if module is not None else name
    return f"{name} ({dimensions} dimensions)" if dimensions is not None else name


def short_names(paths: list[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell them apart (`bm25.trec`, `a/run.trec`...)."""
    resolved = [p.resolve() for p in paths]
    for depth in range(1, max(len(p.parts) for p in resolved) + 1):
        names = [Path(*p.parts[-depth:]).as_posix() for p in resolved]
        if len(set(names)) == len(names):
            return names
    return [p.as_posix() for p in resolved]


def run_labels(paths: list[Path], names: list[str] | None) -> list[str]:
    """What tables and figures call each run: `names` (one per run, each once) when given; else a run's
    path from the current folder when it lies under it (`bench-round1/scifact/dense.trec`, which tells
    the folders of a recipe's runs apart), else the shortest trailing part of its path that tells it
    from the others."""
    if names:
        if len(names) != len(paths):
            raise SettingError(
                f"--name given {len(names)} times for {len(paths)} runs: give one per run, in order"
            )
        repeated = next((name for name in names if names.count(name) > 1), None)
        if repeated is not None:
            raise SettingError(f"--name {repeated!r} is given twice: name each run differently")
        return list(names)
    here = Path.cwd().resolve()
    suffixes = short_names(paths)
    labels = [
        p.resolve().relative_to(here).as_posix() if p.resolve().is_relative_to(here) else suffix
        for p, suffix in zip(paths, suffixes, strict=True)
    ]
    return labels if len(set(labels)) == len(labels) else [p.resolve().as_posix() for p in paths]


@with_encoder_options
def benchmark(
    model: ModelArg,
    data_dirs: Annotated[
        list[Path],
        typer.Argument(
            help=f"Collections: BEIR or MS MARCO-style folders, {COLLECTION_HELP}.", callback=collections
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The benchmark folder.")] = Path("benchmark"),
    split: SplitOpt = "test",
    measure: MeasureOpt = None,
    name: Annotated[str | None, typer.Option("--name", help="The model's name in the table.")] = None,
    k: DepthOpt = 1000,
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    backend: BackendOpt = "torch",
    precision: PrecisionOpt = "float32",
    encoder_options: EncoderOptions = EncoderOptions(),
    domain: Annotated[
        list[str] | None,
        typer.Option(
            "--domain",
            help="With a route as MODEL: each collection's domain, in order "
            "(default: the collections' folder names).",
        ),
    ] = None,
    index: Annotated[
        list[Path] | None,
        typer.Option(
            "--index",
            help="Each collection's index, in order, instead of encoding its corpus: an index of the "
            "passages MODEL makes (the base's, for a route or a query-only module).",
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """BM25 and MODEL on each collection's split: one table (results.md, results.json) with a row per
    collection and the mean, and a bar chart (results.png). MODEL may be a route folder
    (docs/routing.md): its queries are routed over an index of the base's passages.

    Every stage (BM25 run, embeddings, index, dense run) is kept and reused while the model, its
    settings and the collection are unchanged, so a killed benchmark resumes and a second one of the
    same model encodes nothing. With --backend or --precision, both the corpus and the queries are
    encoded that way, and every stage records it.
    """
    from densekit.encoding.runtimes import use_backend
    from densekit.evaluation.benchmark import BENCHMARK_MEASURES, BenchmarkOptions, run_benchmark

    measures = measure or list(BENCHMARK_MEASURES)
    parse_measures(measures)
    given_backend = None if backend == "torch" else backend
    encoder, route = load_model(model, device, encoder_options, domain, backend=given_backend)
    torch_precision = use_backend(encoder, backend, precision)
    label = _model_label(model, encoder_options.module, encoder_options.dimensions)
    options = BenchmarkOptions(split, measures, k, batch_size, progress, overwrite, torch_precision)
    result = run_benchmark(
        encoder, name or label, data_dirs, output, options, route, domain or None, index or None
    )
    table = Table("collection", "queries", *[f"{s} {m}" for m in result.measures for s in result.systems])
    means = result.means()
    for row in [*((c.name, str(c.queries), c.scores) for c in result.collections), ("mean", "", means)]:
        table.add_row(
            row[0], row[1], *[f"{row[2][s][m]:.4f}" for m in result.measures for s in result.systems]
        )
    console.print(table)
    log.info("wrote %s (results.md, results.json, results.png)", output)


def compare(
    qrels: Annotated[Path, typer.Argument(help="Judgements: BEIR three-column TSV or TREC four-column.")],
    runs: Annotated[
        list[Path], typer.Argument(help="Two or more TREC runs; the others are tested against the first.")
    ],
    measure: MeasureOpt = None,
    trials: Annotated[
        int,
        typer.Option(
            min=100, max=MAX_TRIALS, help=f"Sign flips of the randomisation test (100 to {MAX_TRIALS:,})."
        ),
    ] = DEFAULT_TRIALS,
    seed: Annotated[int, typer.Option(help="Seed of the randomisation test.")] = 0,
    json_file: JsonOpt = None,
    plot: PlotOpt = None,
    overwrite: OverwriteOpt = False,
    name: Annotated[
        list[str] | None,
        typer.Option(
            "--name",
            help="What to call each run in the table, the JSON and the plot: once per run, in order "
            "(default: its path from the current folder, else the end of its path that tells it apart).",
        ),
    ] = None,
) -> None:
    """Compare runs query by query: each run against the first, per measure, with a paired t-test and
    a paired randomisation test (two-sided), Holm-corrected across the runs; wins, losses, and a plot of
    the per-query differences (sorted bars). Run names are shown whole, wrapped where the terminal is
    narrow."""
    from densekit.evaluation.compare import compare_runs, plot_differences

    if len(runs) < 2:
        raise SettingError("give at least two runs to compare")
    inputs = [qrels, *runs]
    measures = measure or ["nDCG@10"]
    identity = command_identity("compare", {"measures": measures, "trials": trials, "seed": seed}, inputs)
    for path, kind in ((json_file, SCORES_KIND), (plot, PLOT_KIND)):
        if path is not None:
            check_file_output(path, kind, inputs, identity, overwrite)
    parse_measures(measures)
    diagnostics = Diagnostics()
    judgements = read_qrels(qrels, diagnostics)
    if len({p.resolve() for p in runs}) != len(runs):
        raise SettingError("a run is given twice")
    names = run_labels(runs, name)
    loaded = {label: read_run(path, diagnostics) for label, path in zip(names, runs, strict=True)}
    for label, run in loaded.items():
        if not set(run) & set(judgements):
            raise InputError(f"{label} and {qrels} share no query ids")
    comparisons = compare_runs(judgements, loaded, measures, trials, seed)
    for comparison in comparisons:
        table = Table(
            title=f"{comparison.measure} over {len(judgements)} judged queries; p Holm-corrected over "
            f"{len(comparison.arms)} comparison(s) with the first run",
        )
        # the run's name is folded over lines where the table is narrow, never cut (rich's default)
        table.add_column("run", overflow="fold")
        headings = (comparison.measure, "difference", "better", "worse", "p (t-test)", "p (randomisation)")
        for heading in headings:
            table.add_column(heading, overflow="fold")
        table.add_row(comparison.control, f"{comparison.control_mean:.4f}", "", "", "", "", "")
        for arm in comparison.arms:
            table.add_row(
                arm.name, f"{arm.mean:.4f}", f"{arm.test.mean_difference:+.4f}", str(arm.test.better),
                str(arm.test.worse), f"{arm.p_t_test_holm:.4g}", f"{arm.p_randomisation_holm:.4g}",
            )  # fmt: skip
        console.print(table)
    if json_file is not None:
        text = json.dumps([c.to_json() for c in comparisons], indent=2) + "\n"
        write_output_text(json_file, SCORES_KIND, text, identity, inputs, overwrite)
    if plot is not None:
        plot_differences(comparisons, plot, record=True, identity=identity)
        log.info("wrote %s", plot)


def fuse(
    runs: Annotated[list[Path], typer.Argument(help="Two or more TREC runs of the same queries.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The fused run.")],
    method: Annotated[str, typer.Option("--method", help="rrf (reciprocal rank) or linear.")] = "rrf",
    weights: Annotated[
        str | None, typer.Option("--weights", help="One weight per run, comma-separated (default: all 1).")
    ] = None,
    k: Annotated[int | None, typer.Option("--k", min=0, help="rrf: the rank constant (default 60).")] = None,
    normalisation: Annotated[
        str | None,
        typer.Option("--normalisation", help="linear: minmax (the default) or zscore, per query and run."),
    ] = None,
    depth: Annotated[
        int, typer.Option("--depth", min=1, max=MAX_RUN_DEPTH, help="Documents kept per query.")
    ] = 1000,
    overwrite: OverwriteOpt = False,
) -> None:
    """Fuse runs into one: reciprocal rank fusion (sum of w/(k + rank)) or a weighted sum of scores
    normalised per query (a document a run missed takes that run's lowest normalised score)."""
    from densekit.evaluation.fusion import check_fusion_settings, fuse_runs

    check_fusion_settings(method, k, normalisation)  # before reading any run
    parsed = _fusion_weights(weights, len(runs))
    settings = {"method": method, "weights": parsed, "k": k, "normalisation": normalisation, "depth": depth}
    identity = command_identity("fuse", settings, runs)
    check_file_output(output, RUN_KIND, runs, identity, overwrite)
    diagnostics = Diagnostics()
    fused = fuse_runs([read_run(path, diagnostics) for path in runs], method, parsed, k, normalisation, depth)
    write_run(output, fused, tag=method, inputs=runs, identity=identity, overwrite=overwrite)
    log.info("wrote %s (%d queries)", output, len(fused))


def _fusion_weights(weights: str | None, runs: int) -> list[float] | None:
    """`--weights` as numbers, refused unless one per run, each finite and zero or more, one above 0."""
    from densekit.evaluation.fusion import check_weights

    if weights is None:
        return None
    try:
        parsed = [float(w) for w in weights.split(",")]
    except ValueError:
        raise SettingError(f"--weights {weights}: give numbers separated by commas, e.g. 0.3,0.7") from None
    check_weights(parsed, runs, f"--weights {weights}")
    return parsed


def diagnose_negatives_command(
    examples: Annotated[
        list[Path], typer.Argument(help="Training examples files (JSONL); with several, one point each.")
    ],
    model: Annotated[str, typer.Argument(help="The model whose dense top k is the reference.")],
    index_dir: Annotated[Path, typer.Argument(help="That model's index of the corpus.")],
    depth: Annotated[
        int, typer.Option("--depth", min=1, max=MAX_RUN_DEPTH, help="The dense top k looked in.")
    ] = 200,
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    module: ModuleOpt = None,
    json_file: JsonOpt = None,
    plot: PlotOpt = None,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """ANCE's diagnostic: the share of training negatives the model itself ranks in its dense top k,
    and their mean score margin below the positive, for each examples file (BM25, mined, ANCE
    versions), with a plot across them."""
    from densekit.index import SearchIndex
    from densekit.mining.diagnose import diagnose_negatives, plot_negatives

    inputs = [*examples, index_dir, model, *([module] if module else [])]
    identity = command_identity("diagnose-negatives", {"depth": depth}, inputs)
    for path, kind in ((json_file, SCORES_KIND), (plot, PLOT_KIND)):
        if path is not None:
            check_file_output(path, kind, inputs, identity, overwrite)
    encoder, _ = load_model(model, device, EncoderOptions(module=module))
    searcher = SearchIndex.load(index_dir)
    reports = [
        replace(diagnose_negatives(path, encoder, searcher, depth, batch_size, progress), name=name)
        for path, name in zip(examples, short_names(examples), strict=True)
    ]
    table = Table("examples", "queries", "negatives", f"in dense top {depth}", "mean margin")
    for report in reports:
        table.add_row(
            report.name, str(report.examples), str(report.negatives),
            f"{report.in_top_k} ({100 * report.share_in_top_k:.1f}%)", f"{report.mean_margin:.4f}",
        )  # fmt: skip
    console.print(table)
    if json_file is not None:
        text = json.dumps([r.to_json() for r in reports], indent=2) + "\n"
        write_output_text(json_file, SCORES_KIND, text, identity, inputs, overwrite)
    if plot is not None:
        plot_negatives(reports, plot, record=True, identity=identity)
        log.info("wrote %s", plot)


def register(app: typer.Typer) -> None:
    """Add these sub-commands to `app`."""
    app.command("benchmark")(benchmark)
    app.command("compare")(compare)
    app.command("fuse")(fuse)
    app.command("diagnose-negatives")(diagnose_negatives_command)
