"""A benchmark run with its defaults works in a folder under the current directory and writes nothing
into the committed results (benchmarks/results), which it replaces only when `--output` says so."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    path.stem
    for path in (ROOT / "benchmarks").glob("*.py")
    if path.stem != "__init__"
    and "def main(" in path.read_text(encoding="utf-8")
    and any(made in path.read_text(encoding="utf-8") for made in ("ArgumentParser(", "rounds_parser("))
)


class _Parsed(Exception):
    """Raised in place of parsing the command line: carries the parser the script built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parsed")
        self.parser = parser


def script_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The argument parser benchmarks/NAME.py's main() builds, taken before it parses anything."""

    def keep(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", keep)
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(_Parsed) as parsed:
        module.main()
    return parsed.value.parser


def path_defaults(parser: argparse.ArgumentParser) -> dict[str, Path]:
    """Each option of `parser` whose default is a path (or a string naming a folder or file)."""
    found = {}
    for action in parser._actions:
        default = action.default
        if isinstance(default, Path) or (
            isinstance(default, str) and "/" in default and action.dest != "model"
        ):
            found[action.option_strings[0] if action.option_strings else action.dest] = Path(default)
    return found


def test_every_benchmark_script_is_found() -> None:
    assert len(SCRIPTS) > 20 and "scale" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmark_writes_under_the_current_directory_and_not_into_the_committed_results(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = (ROOT / "benchmarks" / "results").resolve()
    defaults = path_defaults(script_parser(name, monkeypatch))
    absolute = {option: str(path) for option, path in defaults.items() if path.is_absolute()}
    committed = {
        option: str(path)
        for option, path in defaults.items()
        if (ROOT / path).resolve().is_relative_to(results) or path.resolve().is_relative_to(results)
    }
    assert (absolute, committed) == ({}, {}), f"benchmarks/{name}.py's defaults"
