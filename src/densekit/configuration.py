"""YAML configuration files validated by pydantic, with `dotted.key=value` overrides.

An invalid key is blamed on where its value came from: the file, with the line of the key, or the
command-line override that set it (`command-line override optim.batchsize=3: Extra inputs are not
permitted`).

Every YAML densekit reads (configs, recipes, override values, a recipe run's markers) goes through one
bounded loader: PyYAML builds aliases by reference, so a few lines of nested aliases stand for 10^9
values, which blow up only when something walks them. Before anything is built, a document is refused
when it is larger than `MAX_YAML_BYTES`, nests deeper than `MAX_YAML_DEPTH`, holds more than
`MAX_YAML_ALIASES` aliases or an alias inside the node it names, or expands to more than
`MAX_YAML_VALUES` values. The largest recipe shipped (recipes/multi-domain.yaml) is 10 KB with 967 values,
11 aliases and a depth of 8: the limits leave a hundred times that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from densekit.diagnostics import DataError, Problem
from densekit.errors import DensekitError, SettingError

ConfigT = TypeVar("ConfigT", bound=BaseModel)
Key = tuple[str, ...]
COMMAND_LINE = Path("<command line>")
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 100
MAX_YAML_ALIASES = 1_000


class YamlProblem(DensekitError):
    """What is wrong with a YAML text, at a line (from 1) or none."""

    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line, self.message = line, message


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded while it composes: nesting depth, the number of nodes and of
    aliases, and no alias inside the node it names (PyYAML itself has no such limits)."""

    def __init__(self, text: str):
        super().__init__(text)
        self._depth, self._nodes, self._aliases = 0, 0, 0
        self._open: set[str] = set()  # anchors of the nodes being composed

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        """Compose one node, refusing it past the limits."""
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise YamlProblem(line, f"more than {MAX_YAML_ALIASES} aliases")
            if event.anchor in self._open:
                message = f"alias *{event.anchor} is inside the node it names (a recursive alias)"
                raise YamlProblem(line, message)
            return super().compose_node(parent, index)
        self._depth, self._nodes = self._depth + 1, self._nodes + 1
        if self._depth > MAX_YAML_DEPTH:
            raise YamlProblem(line, f"nested more than {MAX_YAML_DEPTH} deep")
        if self._nodes > MAX_YAML_VALUES:
            raise YamlProblem(line, f"holds more than {MAX_YAML_VALUES} values")
        anchor = event.anchor
        if anchor is not None:
            self._open.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.discard(anchor)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expansion(node: yaml.Node, sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """The values and depth `node` expands to, aliases followed; raises `YamlProblem` at the first node
    past the limits. Each node is measured once (`sizes`), so a bomb costs its text, not its expansion;
    the recursion is as deep as the text nests, as an alias names a node composed before it."""
    if id(node) in sizes:
        return sizes[id(node)]
    values, depth = 1, 1
    for child in _children(node):
        child_values, child_depth = _check_expansion(child, sizes)
        values, depth = values + child_values, max(depth, child_depth + 1)
    line = node.start_mark.line + 1
    if values > MAX_YAML_VALUES:
        raise YamlProblem(line, f"aliases expand to more than {MAX_YAML_VALUES} values")
    if depth > MAX_YAML_DEPTH:
        raise YamlProblem(line, f"aliases nest it more than {MAX_YAML_DEPTH} deep")
    sizes[id(node)] = (values, depth)
    return values, depth


def _yaml_error(text: str, err: yaml.YAMLError) -> YamlProblem:
    """PyYAML's error (several lines, quoting the text) as one line at its line."""
    if isinstance(err, yaml.reader.ReaderError):
        line = text.count("\n", 0, err.position) + 1
        reason = f"unacceptable character #x{err.character:04x}: {err.reason}"
        return YamlProblem(line, f"malformed YAML: {reason}")
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    reason = "; ".join(str(p) for p in parts if p) or "unreadable"
    return YamlProblem(mark.line + 1 if mark else None, f"malformed YAML: {reason}")


def compose_yaml(text: str) -> tuple[yaml.Node | None, _BoundedLoader]:
    """The node tree of one YAML document, checked against the limits, and the loader that composed it
    (to construct it); raises `YamlProblem`."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlProblem(None, f"larger than {MAX_YAML_BYTES >> 20} MiB: no config or recipe is that large")
    try:
        loader = _BoundedLoader(text)  # the reader refuses unprintable characters here
    except yaml.YAMLError as err:
        raise _yaml_error(text, err) from None
    try:
        root = loader.get_single_node()
        if root is not None:
            _check_expansion(root, {})
    except yaml.YAMLError as err:
        loader.dispose()
        raise _yaml_error(text, err) from None
    except YamlProblem:
        loader.dispose()
        raise
    return root, loader


def parse_yaml(text: str) -> Any:
    """One YAML document's value (None when empty), through the bounded loader; raises `YamlProblem`."""
    root, loader = compose_yaml(text)
    try:
        return None if root is None else loader.construct_document(root)
    except yaml.YAMLError as err:
        raise _yaml_error(text, err) from None
    finally:
        loader.dispose()


def read_yaml_text(path: Path) -> str:
    """The text of a YAML file, refused (naming the file, and the line of a bad byte) when missing,
    larger than `MAX_YAML_BYTES` or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise DataError([Problem(path, None, "file not found")])
    with path.open("rb") as handle:
        raw = handle.read(MAX_YAML_BYTES + 1)
    if len(raw) > MAX_YAML_BYTES:
        message = f"larger than {MAX_YAML_BYTES >> 20} MiB: no config or recipe is that large"
        raise DataError([Problem(path, None, message)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        message = f"not valid UTF-8: byte 0x{raw[err.start]:02x}"
        raise DataError([Problem(path, line, message)]) from None


def _file_yaml(path: Path) -> tuple[yaml.Node | None, _BoundedLoader]:
    """The checked node tree of a YAML file; problems name the file and line."""
    try:
        return compose_yaml(read_yaml_text(path))
    except YamlProblem as problem:
        raise DataError([Problem(Path(path), problem.line, problem.message)]) from None


def yaml_value(text: str, source: str) -> Any:
    """A YAML value given outside a file (a command-line override's, say), through the bounded loader;
    a problem raises `ValueError` naming `source`."""
    try:
        return parse_yaml(text)
    except YamlProblem as problem:
        message = problem.message
        if message.startswith("malformed YAML: "):
            message = f"malformed YAML value ({message.removeprefix('malformed YAML: ')})"
        raise SettingError(f"{source}: {message}") from None


class ConfigError(DataError):
    """Invalid values of a config, each line naming where the value came from: the file and its line,
    or the command-line override that set it."""

    def __init__(self, problems: list[Problem], lines: list[str]):
        super().__init__(problems)
        self.lines = lines

    def __str__(self) -> str:
        more = f"\n... and {len(self.lines) - 20} more" if len(self.lines) > 20 else ""
        return "\n".join(self.lines[:20]) + more


def split_override(override: str) -> tuple[Key, str]:
    """The dotted key of `key.sub=value` and its raw value."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise SettingError(f"override {override!r} is not of the form key.sub=value")
    parts = tuple(key.split("."))
    if not all(parts):
        raise SettingError(f"override {override!r}: an empty part in the key (give it as key.sub=value)")
    return parts, raw


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` entries in a nested dict; values are read as YAML (`3`, `true`, `[1, 2]`)."""
    for override in overrides:
        parts, raw = split_override(override)
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SettingError(f"command-line override {override}: {part!r} is not a section")
            node = child
        node[parts[-1]] = yaml_value(raw, f"command-line override {override}") if raw else ""
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from `path`, with errors naming the file and line; a key given twice in one
    mapping is an error (YAML would keep the last silently). The document is bounded (see the module's
    docstring) before anything is built."""
    path = Path(path)
    root, loader = _file_yaml(path)
    _key_lines_of(path, root)  # before the constructor, which folds `<<` merges into the nodes
    try:
        tree = {} if root is None else loader.construct_document(root)
    except yaml.YAMLError as err:
        problem = _yaml_error("", err)
        raise DataError([Problem(path, problem.line, problem.message)]) from None
    finally:
        loader.dispose()
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise DataError([Problem(path, None, "expected a mapping of sections")])
    return tree


def key_lines(path: Path) -> dict[Key, int]:
    """The line (from 1) of every key of a YAML file, by its dotted path; list items by their index.
    A key given twice in one mapping raises `DataError` naming both lines."""
    root, loader = _file_yaml(path)
    loader.dispose()
    return _key_lines_of(path, root)


def _key_lines_of(path: Path, root: yaml.Node | None) -> dict[Key, int]:
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
        given = {split_override(o)[0]: o for o in overrides}  # the last override of a key is the one used
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
