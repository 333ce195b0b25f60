"""Where a command may write: the rules every command checks before it starts its work.

- Inputs are never outputs: an output may not be one of the command's inputs, nor a folder holding
  one, nor an existing file inside an input folder.
- Nothing is written into a collection folder (one holding a corpus or queries file) under a name the
  collection reads as its own (`corpus.jsonl`, `queries.jsonl`, `queries.<split>.tsv`, `qrels.<split>.tsv`
  ...), nor into its `qrels` folder (every file there is a split), whether or not it is an input.
- A file output (a run, mined examples, scores) is written only where there is nothing yet or a file
  densekit wrote there of the same kind and not changed since; such a file is made whole each time,
  so nothing stale survives in it. A file densekit made by another command or from other settings or
  inputs (its manifest's identity differs) is replaced only with `overwrite`; the same command with the
  same settings may write it again.
- A folder output (embeddings, a training run, a recipe run) is written only where there is nothing,
  an empty folder, or a folder densekit made of the same kind. If that folder holds another run (other
  model, settings or input data), it is refused, naming what differs, unless `overwrite` is given;
  `overwrite` then removes only what densekit made in it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

from densekit.errors import DensekitError
from densekit.io.artefact import (
    MANIFEST,
    differences,
    read_file_manifest,
    read_manifest,
    sidecar,
    write_file_manifest,
)
from densekit.io.atomic import TEMPORARY, atomic_file
from densekit.io.lock import LOCK_NAME, check_not_held

FolderState = Literal["new", "matching"]
# The files that make a folder a collection (`densekit.data.dataset`), the names it reads as its own,
# and the folder of its judgements.
_PLAIN_COLLECTION_FILES = ("corpus.jsonl", "queries.jsonl", "collection.tsv", "queries.tsv")
COLLECTION_FILES = (*_PLAIN_COLLECTION_FILES, *(f"{name}.gz" for name in _PLAIN_COLLECTION_FILES))
COLLECTION_NAMES = (*COLLECTION_FILES, "queries.*.tsv", "qrels.*.tsv", "queries.*.tsv.gz", "qrels.*.tsv.gz")
QRELS_FOLDER = "qrels"


class OutputError(DensekitError, ValueError):
    """An output path that the command refuses to write; the message names it and says why."""


def _resolved(path: Path | str) -> Path:
    return Path(path).expanduser().resolve()


def check_not_input(output: Path | str, inputs: Iterable[Path | str]) -> None:
    """Refuse an output that is an input, holds an input, or would replace a file inside an input."""
    target = _resolved(output)
    for given in inputs:
        if given is None or not Path(given).exists():
            continue
        source = _resolved(given)
        if target == source:
            raise OutputError(f"{output} is an input of this command; write the output elsewhere")
        if source.is_relative_to(target):
            raise OutputError(f"{output} holds {given}, an input of this command; write the output elsewhere")
        if source.is_dir() and target.is_relative_to(source) and target.exists():
            raise OutputError(
                f"{output} already exists inside {given}, an input of this command; "
                "write the output elsewhere"
            )


def is_collection(folder: Path) -> bool:
    """True when `folder` holds a collection's corpus or queries (a file or a link to one)."""
    return any((folder / name).exists() or (folder / name).is_symlink() for name in COLLECTION_FILES)


def check_not_in_collection(output: Path | str) -> None:
    """Refuse an output inside a collection folder under a name the collection reads as its own, or
    inside its `qrels` folder."""
    target = _resolved(output)
    parent = target.parent
    if parent.name == QRELS_FOLDER and is_collection(parent.parent):
        folder, what = parent.parent, f"every file in {parent} is one of its splits' judgements"
    elif is_collection(parent) and any(fnmatch.fnmatchcase(target.name, p) for p in COLLECTION_NAMES):
        folder, what = parent, f"{target.name} is one of its own files"
    else:
        return
    raise OutputError(f"{output}: {folder} is a collection folder and {what}; write the output elsewhere")


def command_identity(command: str, settings: dict[str, Any], inputs: Iterable[Path | str | None]) -> dict:
    """The identity a command's file output records: the command, its settings, and where its inputs
    are (a path made absolute, a hub id as given)."""
    where = [str(_resolved(p)) if Path(p).exists() else str(p) for p in inputs if p is not None]
    return {"command": command, "settings": settings, "inputs": where}


def check_file_output(
    path: Path | str,
    kind: str,
    inputs: Iterable[Path | str] = (),
    identity: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Check, before the work, that a `kind` file made from `identity` may be written at `path`; returns
    it. A file densekit made from another identity is replaced only with `overwrite`; without an
    `identity` (a writer inside a folder it owns) any file of the kind is."""
    path = Path(path)
    check_not_input(path, inputs)
    check_not_in_collection(path)
    if path.is_dir():
        raise OutputError(f"{path} is a folder; give a file path for the output")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{parent} is a file, so {path} cannot be written")
            break
    if path.exists() or path.is_symlink():
        manifest = read_file_manifest(path)
        if manifest is None:
            raise OutputError(
                f"{path} exists and densekit did not write it (or it was changed since); it is left as "
                "it is: choose another output"
            )
        if manifest.kind != kind:
            raise OutputError(f"{path} holds {manifest.kind}, not {kind}; choose another output")
        changed = differences(manifest.identity, identity) if identity is not None else []
        if changed and not overwrite:
            raise OutputError(
                f"{path} holds {kind} made by another command or settings (differs in: "
                f"{', '.join(changed)}); pass --overwrite to replace it, or choose another output"
            )
    return path


@contextlib.contextmanager
def output_file(
    path: Path | str,
    kind: str,
    identity: dict[str, Any] | None = None,
    inputs: Iterable[Path | str] = (),
    about: dict | None = None,
    mode: str = "w",
    overwrite: bool = False,
) -> Iterator[IO]:
    """Write a `kind` file output atomically and record that densekit wrote it, from `identity` (see
    `check_file_output` for what it may replace)."""
    path = check_file_output(path, kind, inputs, identity, overwrite)
    with atomic_file(path, mode, None if "b" in mode else "utf-8") as handle:
        yield handle
    write_file_manifest(path, kind, identity or {}, about)


def write_output_text(
    path: Path | str,
    kind: str,
    text: str,
    identity: dict | None = None,
    inputs: Iterable = (),
    overwrite: bool = False,
) -> None:
    """Write text as a `kind` file output (see `output_file`)."""
    with output_file(path, kind, identity, inputs, overwrite=overwrite) as handle:
        handle.write(text)


def is_current(path: Path | str, kind: str, identity: dict[str, Any]) -> bool:
    """True when `path` is a `kind` file densekit wrote from this very `identity` and not changed since,
    so a step may reuse it instead of making it again."""
    manifest = read_file_manifest(path)
    return manifest is not None and manifest.kind == kind and not differences(manifest.identity, identity)


def claim_folder(
    path: Path | str,
    kind: str,
    identity: dict[str, Any],
    inputs: Iterable[Path | str] = (),
    overwrite: bool = False,
    owned: Iterable[str] = (),
) -> FolderState:
    """Check, before the work, that `path` may hold this `kind` run; "matching" when it already holds
    this very run (to resume or reuse), "new" when it is empty or absent (or was just cleared by
    `overwrite`). `owned` holds patterns of the entries a `kind` folder holds, removed by `overwrite`."""
    path = Path(path)
    check_not_input(path, inputs)
    check_not_in_collection(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} is a file; give a folder for the output")
    if not path.exists() or is_empty(path):
        return "new"
    manifest = read_manifest(path)
    if manifest is None:
        raise OutputError(
            f"{path} holds files densekit did not make; it is left as it is: choose a new or empty folder"
        )
    if manifest.kind != kind:
        raise OutputError(f"{path} holds {manifest.kind}, not {kind}; choose another folder")
    changed = differences(manifest.identity, identity)
    if not changed:
        return "matching"
    if not overwrite:
        raise OutputError(
            f"{path} holds {kind} made from other settings or inputs (differs in: {', '.join(changed)}); "
            "pass --overwrite to replace it, or choose another folder"
        )
    clear_folder(path, owned)
    return "new"


def check_artefact_output(
    path: Path | str,
    kind: str,
    identity: dict[str, Any],
    inputs: Iterable[Path | str] = (),
    overwrite: bool = False,
) -> None:
    """Check, before it is written, that a `kind` folder written whole (`artefact_dir`, which replaces a
    folder of its kind in one step) may take `path`: new or empty, a `kind` folder densekit made from
    this `identity`, or from another one with `overwrite`; nothing else. Given to `artefact_dir` as its
    `may_replace`, it is checked again at the final rename, where another writer may have been first."""
    path = Path(path)
    check_not_input(path, inputs)
    check_not_in_collection(path)
    if not path.exists() or (path.is_dir() and not path.is_symlink() and is_empty(path)):
        return
    manifest = read_manifest(path) if path.is_dir() and not path.is_symlink() else None
    named = f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"  # an index, a module
    if manifest is None or manifest.kind != kind:
        raise OutputError(f"{path} is not {named} folder densekit made; it is left as it is: choose another")
    changed = differences(manifest.identity, identity)
    if changed and not overwrite:
        raise OutputError(
            f"{path} holds {named} made from other inputs or settings (differs in: {', '.join(changed)}); "
            "pass --overwrite to replace it, or choose another folder"
        )


def is_empty(folder: Path) -> bool:
    """True when `folder` holds nothing but what a densekit writer is making there (its temporaries and
    the locks of what it writes, `densekit.io.lock`)."""
    return all(TEMPORARY.match(child.name) or LOCK_NAME.match(child.name) for child in folder.iterdir())


def clear_folder(path: Path | str, owned: Iterable[str] = ()) -> list[Path]:
    """Remove what densekit made in `path`: entries matching the `owned` patterns, every folder with a
    densekit manifest and every file densekit wrote (with its manifest); anything else stays. Returns
    what went. Locks are left alone, and nothing is removed while another process writes in `path`."""
    path = Path(path)
    check_not_held(path)
    patterns = [*owned, MANIFEST]
    removed = []
    for child in sorted(path.iterdir()):
        if LOCK_NAME.match(child.name):
            continue
        if any(fnmatch.fnmatchcase(child.name, pattern) for pattern in patterns):
            pass
        elif child.is_dir() and not child.is_symlink():
            if read_manifest(child) is None:
                continue
        elif read_file_manifest(child) is None:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            sidecar(child).unlink(missing_ok=True)
            child.unlink(missing_ok=True)
        removed.append(child)
    return removed
