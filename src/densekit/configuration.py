"""YAML configuration files validated by pydantic, with `dotted.key=value` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from densekit.data.diagnostics import DataError, Problem

ConfigT = TypeVar("ConfigT", bound=BaseModel)


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` entries in a nested dict; values are read as YAML (`3`, `true`, `[1, 2]`)."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ValueError(f"override {override!r} is not of the form key.sub=value")
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {override!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from `path`, with errors naming the file and line."""
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
    return tree


def validate_config(tree: dict[str, Any], model: type[ConfigT], source: Path | str) -> ConfigT:
    """`tree` as `model`, with each invalid or unknown key named."""
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])  # empty for a check across sections
            problems.append(Problem(Path(source), None, f"{key}: {e['msg']}" if key else e["msg"]))
        raise DataError(problems) from None


def load_config(path: Path | None, model: type[ConfigT], overrides: list[str] | None = None) -> ConfigT:
    """Read `path` (or start empty), apply overrides, validate."""
    tree = read_yaml(path) if path is not None else {}
    return validate_config(apply_overrides(tree, overrides or []), model, path or "<command line>")


def dump_config(config: BaseModel) -> str:
    """A config as YAML, every default written out."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
