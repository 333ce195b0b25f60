"""What an artefact promises: the manifest that says densekit made it, from what, and with which bytes.

A folder densekit makes (embeddings, an index, a model, a checkpoint, a training or recipe run)
holds `densekit-artefact.json`; a file it makes (a run, mined examples, scores) has a hidden
`.<name>.densekit.json` beside it. A manifest records the artefact's `kind`, its `identity` (the
model's weights, the settings and the inputs' content that made it, compared before it is reused),
`about` (paths and names, for people, never compared) and `checksums` of its files, checked on load.
A `README.md` anywhere in a folder is documentation: never checksummed, never checked, and a person's
own is kept when densekit replaces the folder (`densekit.io.readme`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from densekit.diagnostics import DataError, Problem
from densekit.io.atomic import atomic_dir, check_replaceable, write_text_atomic
from densekit.io.fingerprint import digest_of, file_digest, tree_checksums
from densekit.io.readme import holds_only_user_readme, is_card, keep_user_readme
from densekit.io.write_errors import named_os_error
from densekit.version import __version__

MANIFEST = "densekit-artefact.json"


def _error(path: Path, message: str) -> Exception:
    return DataError([Problem(path, None, message)])


@dataclass
class Manifest:
    """What made an artefact and a checksum of each of its files."""

    kind: str
    identity: dict[str, Any]
    checksums: dict[str, str] = field(default_factory=dict)
    about: dict[str, Any] = field(default_factory=dict)
    densekit: str = ""
    created: str = ""

    def to_json(self) -> str:
        """The manifest as the JSON it is saved as."""
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"


def new_manifest(
    kind: str, identity: dict[str, Any], checksums: dict[str, str] | None = None, about: dict | None = None
) -> Manifest:
    """A manifest stamped with densekit's version and the time."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Manifest(kind, _plain(identity), checksums or {}, _plain(about or {}), __version__, now)


def _plain(value: Any) -> Any:
    """`value` as JSON gives it back, so a saved identity compares equal to a fresh one."""
    return json.loads(json.dumps(value))


def _parse(path: Path) -> Manifest:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return Manifest(**raw)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as err:
        raise _error(path, f"not a readable densekit manifest: {err}") from None


def read_manifest(folder: Path | str) -> Manifest | None:
    """The manifest of a folder densekit made, or None when the folder has none."""
    path = Path(folder) / MANIFEST
    return _parse(path) if path.is_file() else None


def open_artefact(folder: Path | str, kind: str, what: str) -> Manifest:
    """The manifest of `folder`, a folder densekit made as a `kind` (`what` names such a folder in words:
    "index folder"); `DataError` naming the folder when there is none, or it is not densekit's, or it
    is of another kind. Its files' checksums are the caller's to check (`verify`), when it reads them."""
    folder = Path(folder)
    if not folder.is_dir():
        raise _error(folder, f"{what} not found")
    manifest = read_manifest(folder)
    if manifest is None or manifest.kind != kind:
        held = "no densekit manifest" if manifest is None else f"it holds {manifest.kind}"
        article = "an" if what[:1] in "aeiou" else "a"
        raise _error(folder, f"not {article} {what} of densekit's ({held})")
    return manifest


def sidecar(path: Path | str) -> Path:
    """Where the manifest of a file output lives."""
    path = Path(path)
    return path.with_name(f".{path.name}.densekit.json")


def read_file_manifest(path: Path | str) -> Manifest | None:
    """The manifest of a file densekit made whose bytes are still those it wrote, else None."""
    path = Path(path)
    side = sidecar(path)
    if not (side.is_file() and path.is_file()):
        return None
    manifest = _parse(side)
    return manifest if manifest.checksums.get(path.name) == file_digest(path) else None


def write_file_manifest(
    path: Path | str, kind: str, identity: dict[str, Any], about: dict | None = None
) -> Manifest:
    """Record that densekit wrote `path` (after it was written), with its checksum. When the record
    cannot be written (a full disk), `path` is removed: a file without it would be refused as not
    densekit's, and the error names `path`."""
    path = Path(path)
    manifest = new_manifest(kind, identity, {path.name: file_digest(path)}, about)
    try:
        write_text_atomic(sidecar(path), manifest.to_json())
    except OSError as err:
        path.unlink(missing_ok=True)
        named = named_os_error(err, path, inside=sidecar(path))
        if named is None:
            raise
        raise named from err
    return manifest


def is_artefact(folder: Path | str, kind: str) -> bool:
    """True when `folder` is one densekit made as a `kind`."""
    manifest = read_manifest(folder) if Path(folder).is_dir() else None
    return manifest is not None and manifest.kind == kind


def check_artefact_dir(path: Path | str, kind: str) -> None:
    """Raise now, before any work, if `artefact_dir(path, kind)` would refuse `path`."""
    check_replaceable(Path(path), _replaceable(kind))


def _replaceable(kind: str) -> Callable[[Path], bool]:
    """What `artefact_dir` may replace: a `kind` folder densekit made, or a folder holding only a
    README of a person's own (which is kept)."""
    return lambda existing: is_artefact(existing, kind) or holds_only_user_readme(existing)


@contextlib.contextmanager
def artefact_dir(
    path: Path | str,
    kind: str,
    identity: dict[str, Any],
    about: dict | None = None,
    digests: dict[str, str] | None = None,
    may_replace: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Write a `kind` folder atomically, with its manifest and checksums.

    Only an empty folder, one densekit made as the same kind, or one holding only a person's README is
    ever replaced (a person's README is kept), and, given `may_replace`, only one it allows (or raises
    to refuse); anything else at `path` is refused before any work and again at the final rename.
    READMEs are left out of the checksums. `digests`, which the caller may fill inside the block, holds
    checksums of files it computed as it wrote them (`write_digested`); the others are read back.
    """
    digests = {} if digests is None else digests
    allowed = may_replace or (lambda existing: True)
    densekit_made = _replaceable(kind)

    def replaceable(existing: Path) -> bool:
        return densekit_made(existing) and allowed(existing)

    with atomic_dir(path, may_replace=replaceable) as tmp:
        yield tmp
        checksums = tree_checksums(tmp, skip={MANIFEST, *digests}) | digests
        checksums = {name: digest for name, digest in sorted(checksums.items()) if not is_card(name)}
        manifest = new_manifest(kind, identity, checksums, about)
        (tmp / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
        keep_user_readme(Path(path), tmp)


def write_folder_manifest(
    folder: Path | str, kind: str, identity: dict[str, Any], about: dict | None = None
) -> Manifest:
    """Mark a folder densekit fills over time (a run, an embedding folder) as its own; no checksums."""
    manifest = new_manifest(kind, identity, None, about)
    write_text_atomic(Path(folder) / MANIFEST, manifest.to_json())
    return manifest


def verify(folder: Path | str, manifest: Manifest | None = None) -> Manifest:
    """Check every file a folder's manifest lists against its checksum (but a README, which a manifest
    written before READMEs were left out may list); `DataError` names the first that is missing or
    changed."""
    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    if manifest is None:
        raise _error(folder, f"no {MANIFEST}: not made by this version of densekit")
    for name, expected in manifest.checksums.items():
        if is_card(name):
            continue
        path = folder / name
        if not path.is_file():
            raise _error(path, "missing: the folder is incomplete")
        if file_digest(path) != expected:
            raise _error(
                path,
                "its checksum differs from the one saved when it was written: the file is damaged or "
                "was changed; make it again",
            )
    return manifest


def differences(saved: Any, fresh: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested mappings (the whole path for others)."""
    if isinstance(saved, dict) and isinstance(fresh, dict):
        found = []
        for key in sorted(set(saved) | set(fresh), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in saved or key not in fresh:
                found.append(name)
            else:
                found.extend(differences(saved[key], fresh[key], name))
        return found
    return [] if _plain(saved) == _plain(fresh) else [prefix or "(value)"]


def path_fingerprint(path: Path | str) -> str:
    """A file's digest, a folder's (of its files but densekit's manifest, which holds a time), or, for
    a name that is not on disk (a hub id), the name itself."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    if path.is_dir():
        return digest_of(tree_checksums(path, skip={MANIFEST}))
    return f"name:{path}"
