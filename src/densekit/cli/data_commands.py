"""Sub-commands about data: validate, split-queries, slice, pseudo-queries, evaluate."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from densekit.cli.options import COLLECTION_HELP, DataDirArg, OverwriteOpt, collections
from densekit.data.trec import read_qrels, read_run
from densekit.data.validate import validate_dataset
from densekit.diagnostics import Diagnostics
from densekit.errors import InputError, SettingError
from densekit.evaluation import DEFAULT_MEASURES, PER_QUERY_KIND, SCORES_KIND, evaluate, evaluate_per_query
from densekit.io.outputs import check_file_output, command_identity, write_output_text
from densekit.limits import MAX_PER_DOCUMENT

if TYPE_CHECKING:
    from densekit.data.pseudo_queries import PseudoQuerySettings

console = Console(soft_wrap=True)


def validate(
    data_dir: DataDirArg,
    split: Annotated[
        list[str] | None, typer.Option("--split", help="Check only these qrels splits (repeatable).")
    ] = None,
) -> None:
    """Check every file of a collection and report each problem with its file and line.

    Exits 1 when there is an error; warnings (such as empty texts) alone leave it at 0.
    """
    report = validate_dataset(data_dir, split or None)
    for problem in report.problems:
        colour = "red" if problem.severity == "error" else "yellow"
        console.print(f"[{colour}]{escape(str(problem))}[/]")
    judged = ", ".join(f"{s}: {n}" for s, n in report.judgements.items()) or "none"
    console.print(f"{report.documents} documents, {report.queries} queries, judgements {judged}")
    errors = sum(p.severity == "error" for p in report.problems)
    warnings = len(report.problems) - errors
    if errors:
        console.print(f"[bold red]{errors} errors[/], {warnings} warnings")
        raise typer.Exit(1)
    console.print(f"[bold green]ok[/] ({warnings} warnings)")


def evaluate_command(
    qrels: Annotated[Path, typer.Argument(help="Judgements: BEIR three-column TSV or TREC four-column.")],
    run: Annotated[Path, typer.Argument(help="A TREC run file.")],
    measure: Annotated[
        list[str] | None,
        typer.Option("--measure", "-m", help="An ir_measures name, e.g. nDCG@10 (repeatable)."),
    ] = None,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Write the aggregates here, keyed by measure name.")
    ] = None,
    per_query: Annotated[
        Path | None, typer.Option("--per-query", help="Write `query measure value` lines here ('-': stdout).")
    ] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Score a run against judgements with ir_measures (nDCG@10, RR@10, R@100, R@1000, AP by default)."""
    inputs = [qrels, run]
    names = measure or list(DEFAULT_MEASURES)
    identity = command_identity("evaluate", {"measures": names}, inputs)
    for output, kind in ((json_file, SCORES_KIND), (per_query, PER_QUERY_KIND)):
        if output is not None and str(output) != "-":
            check_file_output(output, kind, inputs, identity, overwrite)
    diagnostics = Diagnostics()
    judgements = read_qrels(qrels, diagnostics)
    ranked = read_run(run, diagnostics)
    shared = set(ranked) & set(judgements)
    if not shared:
        raise InputError(f"{run} and {qrels} share no query ids")
    unjudged = len(set(ranked) - shared)
    scores = evaluate(judgements, ranked, names)
    table = Table("measure", "value", title=f"{run.name}: {len(judgements)} judged queries")
    for name, value in scores.items():
        table.add_row(name, f"{value:.4f}")
    console.print(table)
    if unjudged:
        console.print(f"[yellow]{unjudged} queries of the run have no judgements and are not counted[/]")
    unanswered = len(set(judgements) - shared)
    if unanswered:
        console.print(f"[yellow]{unanswered} judged queries have no results in the run and count as 0[/]")
    if json_file is not None:
        text = json.dumps(scores, indent=2) + "\n"
        write_output_text(json_file, SCORES_KIND, text, identity, inputs, overwrite)
    if per_query is not None:
        lines = "".join(f"{q}\t{m}\t{v:.6f}\n" for q, m, v in evaluate_per_query(judgements, ranked, names))
        if str(per_query) == "-":
            sys.stdout.write(lines)
        else:
            write_output_text(per_query, PER_QUERY_KIND, lines, identity, inputs, overwrite)


def split_queries(
    data_dir: Annotated[
        Path, typer.Argument(help=f"A BEIR collection folder, {COLLECTION_HELP}.", callback=collections)
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The new collection folder.")],
    take: Annotated[int, typer.Option("--take", min=1, help="Queries to put in the fit split.")],
    split: Annotated[str, typer.Option("--split", help="The qrels split whose queries are split.")] = "test",
    seed: Annotated[int, typer.Option(help="Seed of the draw.")] = 0,
    overwrite: OverwriteOpt = False,
) -> None:
    """Split a split's judged queries for few-shot work: OUTPUT is a collection whose `fit` split holds
    TAKE of them, drawn with SEED, and whose `held-out` split holds the rest; its corpus and queries
    are links to DATA_DIR's files, so an index of DATA_DIR's corpus searches it."""
    from densekit.data.query_split import FIT, HELD_OUT, split_judged_queries

    made = split_judged_queries(data_dir, split, take, seed, output, overwrite)
    state = "already there, unchanged" if made.reused else "written"
    console.print(f"{output}: {FIT} {made.fit} queries, {HELD_OUT} {made.held_out} ({state})")


def slice_command(
    data_dir: Annotated[
        Path, typer.Argument(help=f"The collection to slice, {COLLECTION_HELP}.", callback=collections)
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The slice's collection folder.")],
    size: Annotated[int, typer.Option("--size", min=1, help="Documents in the slice.")],
    split: Annotated[
        list[str] | None,
        typer.Option(
            "--split", help="Keep this split's judged documents and queries (repeatable; default: all)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the draw of the unjudged documents.")] = 0,
    overwrite: OverwriteOpt = False,
) -> None:
    """Cut a SIZE-document slice of a collection that keeps every document judged in the chosen splits
    (with their queries and judgements) and draws the others with SEED. Slices of one seed are nested:
    a smaller one is part of a larger one, so slices of several sizes share their queries. OUTPUT
    records what it was cut from; the same slice there is reused."""
    from densekit.data.slices import slice_collection

    made = slice_collection(data_dir, size, output, split or None, seed, overwrite)
    state = "already there, unchanged" if made.reused else "written"
    console.print(
        f"{output}: {made.documents} documents ({made.judged} judged), {made.queries} queries ({state})"
    )


def pseudo_queries(
    data_dir: DataDirArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The training file to write (JSONL).")],
    method: Annotated[
        str,
        typer.Option(
            help="span (a crop of the text), title, lead (the first sentence), or keywords (distinct "
            "words drawn by tf-idf)."
        ),
    ] = "span",
    words: Annotated[
        str, typer.Option(help="span and keywords: query lengths in words, as min-max.")
    ] = "8-24",
    per_document: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_PER_DOCUMENT,
            help=f"span and keywords: queries per document (1 to {MAX_PER_DOCUMENT}).",
        ),
    ] = 1,
    max_documents: Annotated[
        int | None, typer.Option(min=1, help="Draw from this many documents, chosen at random.")
    ] = None,
    domain: Annotated[
        str | None, typer.Option(help="The collection's domain, written into every example (routing).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the crops and the draw.")] = 0,
    overwrite: OverwriteOpt = False,
) -> None:
    """Make training examples from the corpus alone: each pseudo-query (a span of a document, its title,
    its first sentence or keywords drawn from it) has its document as the one positive. Add negatives
    with `densekit mine --examples OUTPUT`. Writes the file atomically as the queries are drawn, and a
    report of what each document gave beside it; a file made from other settings is replaced only with
    --overwrite."""
    from densekit.data.dataset import Dataset
    from densekit.data.pseudo_queries import write_pseudo_queries

    options = {"method": method, "per_document": per_document, "words": words,
               "max_documents": max_documents, "seed": seed, "domain": domain}  # fmt: skip
    settings = pseudo_query_settings(options)
    summary = write_pseudo_queries(Dataset.open(data_dir), settings, output, overwrite)
    skipped = ", ".join(f"{n} {why}" for why, n in summary["documents_without_query"].items()) or "none"
    console.print(
        f"{output}: {summary['queries']} pseudo-queries from {summary['documents']} documents "
        f"(documents without one: {skipped})"
    )


# How each setting of a pseudo-query error is named on the command line, and what it allows.
_PSEUDO_QUERY_OPTIONS = {
    "method": ("--method", "use span, title, lead or keywords"),
    "per_document": ("--per-document", f"from 1 to {MAX_PER_DOCUMENT}"),
    "max_documents": ("--max-documents", "give 1 or more"),
    "domain": ("--domain", "give a name of at least one character"),
    "min_words": ("--words", "give min-max, each 1 or more"),
    "max_words": ("--words", "give min-max, each 1 or more"),
}


def pseudo_query_settings(options: dict) -> PseudoQuerySettings:
    """`pseudo-queries`' options as settings; an invalid one is a `ValueError` naming the option and what
    it allows, in one line."""
    from pydantic import ValidationError

    from densekit.data.pseudo_queries import PseudoQuerySettings

    words = options["words"]
    low, sep, high = words.partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        raise SettingError(f"--words {words!r} is not of the form min-max, e.g. 8-24")
    fields = {k: v for k, v in options.items() if k != "words"}
    fields.update(min_words=int(low), max_words=int(high))
    if fields["min_words"] > fields["max_words"]:
        raise SettingError(f"--words {words}: the shortest length is above the longest")
    if fields["method"] in ("title", "lead") and fields["per_document"] != 1:
        raise SettingError(f"--per-document {fields['per_document']}: for span and keywords only")
    try:
        return PseudoQuerySettings(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "method"
        option, allowed = _PSEUDO_QUERY_OPTIONS.get(field, (f"--{field.replace('_', '-')}", first["msg"]))
        value = words if option == "--words" else fields.get(field)
        raise SettingError(f"{option} {value!r}: {allowed}") from None


def register(app: typer.Typer) -> None:
    """Add these sub-commands to `app`."""
    app.command("validate")(validate)
    app.command("split-queries")(split_queries)
    app.command("slice")(slice_command)
    app.command("pseudo-queries")(pseudo_queries)
    app.command("evaluate")(evaluate_command)
