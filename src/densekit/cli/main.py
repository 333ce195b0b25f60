"""The `densekit` command: its sub-commands, logging and how errors are shown."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import typer
from rich.logging import RichHandler
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from densekit.cli import (
    data_commands,
    evaluation_commands,
    import_command,
    module_commands,
    quickstart_command,
    recipe_command,
    retrieval_commands,
    rotate_command,
    serve_command,
    train_commands,
)
from densekit.diagnostics import DataError
from densekit.errors import DensekitError
from densekit.progress import stderr_console


class _Commands(TyperGroup):
    """densekit's command group, whose help shows a flag (`--verbose`, `--overwrite`, `--help`) as taking no
    value: typer's help labels every option with its type, `<bool>` for a flag, as if it took one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _label_flags_as_flags(self)


def _label_flags_as_flags(command: TyperCommand | TyperGroup) -> None:
    """Give every flag of `command` and of the commands under it an empty type label."""
    help_option = command.get_help_option(command.context_class(command))
    for option in [*command.params, help_option]:
        if getattr(option, "is_flag", False) and option.metavar is None:
            option.metavar = ""
    for subcommand in getattr(command, "commands", {}).values():
        _label_flags_as_flags(subcommand)


app = typer.Typer(
    cls=_Commands,
    name="densekit",
    help="Train, index, evaluate and serve dense text retrievers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def configure(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debugging detail."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log warnings and errors only."),
) -> None:
    """Set up logging for every sub-command."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    handler = RichHandler(console=stderr_console, show_path=False, show_time=False)
    handler.setLevel(level)  # also for libraries that set their own loggers' levels when imported
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler], force=True)
    # transformers (imported later, by the commands that load a model) reads this for its bars; a
    # command that imports nothing of it starts in a fraction of the time
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    for noisy in ("transformers", "httpx", "urllib3", "huggingface_hub", "faiss", "bm25s"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


data_commands.register(app)
retrieval_commands.register(app)
import_command.register(app)
quickstart_command.register(app)
train_commands.register(app)
recipe_command.register(app)
module_commands.register(app)
rotate_command.register(app)
evaluation_commands.register(app)
serve_command.register(app)


def main() -> None:
    """Run the command line, turning densekit's errors (`DensekitError`) and the libraries' refusals of
    bad input (ValueError, RuntimeError, OSError) into a message and exit status 2."""
    try:
        app()
    except DataError as err:  # each problem line already says "error"
        stderr_console.print(f"[red]{escape(str(err))}[/]", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (DensekitError, ValueError, RuntimeError, OSError) as err:
        stderr_console.print(f"[bold red]error:[/] {escape(_one_line(err))}", highlight=False, soft_wrap=True)
        sys.exit(2)


def _one_line(err: Exception) -> str:
    """An error as one line; an OS error names its path (and the second path of a rename)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        target = f" -> {err.filename2}" if err.filename2 is not None else ""
        return f"{err.filename}{target}: {err.strerror}"
    return str(err)
