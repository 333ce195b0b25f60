"""YAML configuration files validated by pydantic, with `dotted.key=value` overrides.

An invalid key is blamed on where its value came from: the file, with the line of the key, or the
command-line override that set it (`command-line override optim.batchsize=3: Extra inputs are not
permitted`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from densekit.diagnostics import DataError, Problem

ConfigT = TypeVar("ConfigT", bound=BaseModel)
Key = tuple[str, ...]
COMMAND_LINE = Path("<command line>")


class ConfigError(DataError):
    """Invalid values of a config, each line naming where the value came from: the file and its line,
    or the command-line override that set it."""

    def __init__(self, problems: list[Problem], lines: list[str]):
        super().__init__(problems)
        self.lines = lines

    def __str__(self) -> str:
        more = f"\n... and {len(self.lines) - 20} more" if len(self.lines) > 20 else ""
        return "\n".join(self.lines[:20]) + more


def _split_override(override: str) -> tuple[Key, str]:
    """The dotted key of `key.sub=value` and its raw value."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form key.sub=value")
    return tuple(key.split(".")), raw


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` entries in a nested dict; values are read as YAML (`3`, `true`, `[1, 2]`)."""
    for override in overrides:
        parts, raw = _split_override(override)
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"command-line override {override}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as err:
            reason = getattr(err, "problem", None) or "unreadable"
            raise ValueError(f"command-line override {override}: malformed YAML value ({reason})") from None
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from `path`, with errors naming the file and line; a key given twice in one
    mapping is an error (YAML would keep the last silently)."""
    path = Path(path)
    if not path.is_file():
        raise DataError([Problem(path, None, "file not found")])
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise DataError([Problem(path, mark.line + 1 if mark else None, f"malformed YAML: {err}")]) from None
    if not isinstance(tree, dict):
        raise DataError([Problem(path, None, "expected a mapping of sections")])
    key_lines(path)
    return tree


def key_lines(path: Path) -> dict[Key, int]:
    """The line (from 1) of every key of a YAML file, by its dotted path; list items by their index.
    A key given twice in one mapping raises `DataError` naming both lines."""
    lines: dict[Key, int] = {}

    def walk(node: yaml.Node, key: Key) -> None:
        if isinstance(node, yaml.MappingNode):
            for name, value in node.value:
                child, line = (*key, str(name.value)), name.start_mark.line + 1
                if child in lines and name.value != "<<":  # `<<` merges anchors, it sets no key
                    problem = f"{'.'.join(child)} given twice (first on line {lines[child]})"
                    raise DataError([Problem(Path(path), line, problem)])
                lines[child] = line
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for position, item in enumerate(node.value):
                lines[(*key, str(position))] = item.start_mark.line + 1
                walk(item, (*key, str(position)))

    root = yaml.compose(Path(path).read_text(encoding="utf-8"))
    if root is not None:
        walk(root, ())
    return lines


def validate_config(
    tree: dict[str, Any],
    model: type[ConfigT],
    source: Path | str,
    overrides: Sequence[str] = (),
    lines: Mapping[Key, int] | None = None,
) -> ConfigT:
    """`tree` as `model`, with each invalid or unknown key named: as a command-line override when one
    of `overrides` set it, otherwise as a key of `source`, on its line from `lines` (see `key_lines`)
    or its closest section's."""
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        lines = lines or {}
        given = {_split_override(o)[0]: o for o in overrides}  # the last override of a key is the one used
        problems, shown = [], []
        for e in err.errors():
            loc: Key = tuple(str(p) for p in e["loc"])  # empty for a check across sections
            key = ".".join(loc)
            setters = [k for k in given if loc[: len(k)] == k]
            if setters:
                setter = max(setters, key=len)  # the deepest override that set this value
                rest = ".".join(loc[len(setter) :])
                message = f"command-line override {given[setter]}: {rest + ': ' if rest else ''}{e['msg']}"
                problems.append(Problem(COMMAND_LINE, None, message))
                shown.append(message)
                continue
            within = [o for k, o in given.items() if k[: len(loc)] == loc]  # overrides inside this key
            message = f"{key}: {e['msg']}" if key else e["msg"]
            if within:
                message += f" (with command-line override {', '.join(within)})"
            line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
            problem = Problem(Path(source), line, message)
            problems.append(problem)
            shown.append(str(problem))
        raise ConfigError(problems, shown) from None


def load_config(path: Path | None, model: type[ConfigT], overrides: list[str] | None = None) -> ConfigT:
    """Read `path` (or start empty), apply overrides, validate."""
    tree = read_yaml(path) if path is not None else {}
    lines = key_lines(path) if path is not None else {}
    overrides = overrides or []
    return validate_config(apply_overrides(tree, overrides), model, path or COMMAND_LINE, overrides, lines)


def dump_config(config: BaseModel) -> str:
    """A config as YAML, every default written out."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
