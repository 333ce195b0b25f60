"""The `densekit` command."""

from densekit.cli.main import app, main

__all__ = ["app", "main"]
