"""A local folder laid out as a Hugging Face dataset (`hf:<folder>`): the configs its card declares,
checked before anything is read or hashed, and the digest of the files `datasets` may read from it.

`datasets` takes a local folder's configs from the YAML header of its `README.md` (`configs:`, each
with `data_files` patterns relative to the folder). densekit keys its copy of the folder by the
folder's files, so a pattern naming a file it would not digest (outside the folder, a URL, a hidden
file, which `datasets` reads only when a pattern names it) would leave the copy stale when that file
changes: such patterns are refused. The card is read here, without importing `datasets`, so a folder
that is no dataset is refused before its files are hashed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from densekit.errors import DensekitError
from densekit.io.fingerprint import file_digest

CARD = "README.md"
_CARD_BYTES = 1 << 20  # the YAML header must end within the card's first MiB
_NEEDED = ("corpus", "queries")


class LocalDatasetError(DensekitError, ValueError):
    """A local folder that is not a dataset densekit can read, or whose card names files it cannot key."""


def check_dataset_folder(name: str, folder: Path, needed: tuple[str, ...] = _NEEDED) -> None:
    """Refuse `folder` unless its card declares the `needed` configs (BEIR's and MTEB's `corpus` and
    `queries`), and refuse any config whose files lie outside it or are hidden."""
    configs = card_configs(name, folder)
    missing = [config for config in needed if config not in configs]
    if missing:
        listed = ", ".join(configs) or f"none: no {CARD} with a YAML header listing them"
        raise LocalDatasetError(
            f"{name}: not in the BEIR or MTEB layout: it has no {' or '.join(missing)} config "
            f"(its configs: {listed})"
        )
    for config_name, config in configs.items():
        for pattern in _patterns(config):
            problem = _pattern_problem(pattern)
            if problem is not None:
                raise LocalDatasetError(
                    f"{name}: config {config_name!r} reads {pattern!r}, {problem}; densekit keys its copy by "
                    "the folder's own files, so it would not see that file change: move it into the folder"
                )


def card_configs(name: str, folder: Path) -> dict[str, dict[str, Any]]:
    """The configs the card of `folder` declares, by name in the card's order; none without a card."""
    card = folder / CARD
    if not card.is_file():
        return {}
    with card.open("rb") as handle:
        head = handle.read(_CARD_BYTES).decode("utf-8", errors="replace")
    lines = head.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    end = next((i for i, line in enumerate(lines[1:], start=1) if line.strip() == "---"), None)
    if end is None:
        raise LocalDatasetError(f"{name}: {card}: its YAML header has no closing --- in its first MiB")
    try:
        header = yaml.safe_load("\n".join(lines[1:end])) or {}
    except yaml.YAMLError as err:
        message = f"its YAML header cannot be read: {_first_line(err)}"
        raise LocalDatasetError(f"{name}: {card}: {message}") from None
    listed = header.get("configs", []) if isinstance(header, dict) else []
    if not isinstance(listed, list):
        raise LocalDatasetError(f"{name}: {card}: configs must be a list")
    configs = {}
    for config in listed:
        if isinstance(config, dict):
            configs[str(config.get("config_name", "default"))] = config
    return configs


def _patterns(config: dict[str, Any]) -> Iterator[str]:
    """Every path pattern a config names: its `data_dir` and its `data_files` (a pattern, a list of
    them, or splits with a `path` each)."""
    if isinstance(config.get("data_dir"), str):
        yield config["data_dir"]
    yield from _strings(config.get("data_files"))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        yield from _strings(value.get("path")) if "path" in value else _strings(list(value.values()))
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _pattern_problem(pattern: str) -> str | None:
    """Why `datasets` would read files for `pattern` that the folder's digest leaves out, or None."""
    if "://" in pattern or pattern.startswith(("~", "/")) or os.path.isabs(pattern):
        return "which is not in the folder"
    parts = PurePosixPath(pattern.replace("\\", "/")).parts
    if ".." in parts:
        return "which is outside the folder"
    if any(part.startswith(".") for part in parts):
        return "a hidden file"
    return None


def folder_digests(folder: Path) -> dict[str, str]:
    """The digest of every file `datasets` may read from `folder` unasked-for patterns aside (hidden
    files and folders left out, as it leaves them), by relative path; folders linked into it are
    followed, as `datasets` follows them (once each: a link back up is not walked again)."""
    digests: dict[str, str] = {}
    seen: set[str] = set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for file in sorted(f for f in files if not f.startswith(".")):
            path = Path(root) / file
            if path.is_file():
                digests[path.relative_to(folder).as_posix()] = file_digest(path)
    return digests


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
