"""Running `densekit` in the test's process as the installed command runs it, and checking that a
refusal is one line."""

from __future__ import annotations

import sys

from densekit.cli.main import main


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run `densekit ARGS`: its exit code, and what it printed on stderr and on stdout, line breaks kept
    (a one-line error must be one line)."""
    capsys.readouterr()
    argv = sys.argv
    sys.argv = ["densekit", *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    finally:
        sys.argv = argv
    printed = capsys.readouterr()
    return code, printed.err, printed.out


def assert_refused(code: int, err: str, *expected: str) -> None:
    """Exit status 2, one line, no traceback, every `expected` fragment in it."""
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in expected:
        assert fragment in err, err


def flat(err: str) -> str:
    """typer's usage error without its box and line breaks."""
    return " ".join(err.replace("│", " ").split()) + " "
