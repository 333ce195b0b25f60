"""A folder's `README.md`: documentation, so never part of an artefact's checksums, and either the card
densekit wrote (it carries `CARD_MARK`) or a person's own, which densekit never overwrites.

This module imports nothing of densekit's, so that the artefact writer (which leaves cards out of its
checksums and keeps a person's README when it replaces a folder) and the card writer share it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CARD_FILE = "README.md"
CARD_MARK = (
    "<!-- densekit model card: written from densekit-artefact.json; delete this line to keep your edits -->"
)
MARK_WITHIN = 1 << 20  # densekit's mark sits near the top: a README is read that far for it


def is_card(relative: str) -> bool:
    """True for a folder entry (a path relative to the folder, `/`-separated) that is a README at any
    depth (the folder's own card, or the card of a model a checkpoint holds)."""
    return relative.rsplit("/", 1)[-1] == CARD_FILE


def is_densekit_card(folder: Path | str) -> bool:
    """True when `folder/README.md` is a card densekit wrote (and nobody took its mark out)."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return False
    try:
        with path.open("rb") as handle:
            return CARD_MARK.encode() in handle.read(MARK_WITHIN)
    except OSError:
        return False


def user_readme(folder: Path | str) -> Path | None:
    """`folder/README.md` when it is a file of a person's own (not a link, not densekit's card)."""
    path = Path(folder) / CARD_FILE
    if path.is_symlink() or not path.is_file() or is_densekit_card(folder):
        return None
    return path


def holds_only_user_readme(folder: Path) -> bool:
    """True when `folder` holds a README of a person's own and nothing else (a model folder whose
    run's `--overwrite` kept only that): a writer may fill it, keeping the README."""
    return user_readme(folder) is not None and [child.name for child in folder.iterdir()] == [CARD_FILE]


def keep_user_readme(old: Path, new: Path) -> None:
    """Copy a README of a person's own from `old`, the folder being replaced, into `new`, the folder
    about to take its place (over anything written there under that name)."""
    readme = user_readme(old) if old.is_dir() else None
    if readme is not None:
        shutil.copyfile(readme, new / CARD_FILE)
