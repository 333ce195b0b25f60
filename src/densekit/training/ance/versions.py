"""Versions of ANCE negatives in a shared folder, published atomically.

`OUT/ance/version-<n>/` holds `examples.jsonl` (the training examples with that version's negatives)
and `commit.json` (what made it). A version is written under a hidden temporary name and renamed into
place, and `commit.json` is its last file: a reader lists only folders with that marker, so it never
sees a partial version, even from an inferencer killed halfway.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from densekit.data.examples import TrainingExample, read_examples, write_examples
from densekit.diagnostics import Diagnostics
from densekit.io.artefact import artefact_dir
from densekit.io.atomic import remove_dead_temporaries

ANCE_FOLDER = "ance"
STOP_FILE = "STOP"
KIND = "ANCE negatives"
_VERSION = re.compile(r"^version-(\d{6})$")


class NegativeVersions:
    """The published versions under `OUT/ance`."""

    def __init__(self, output: Path):
        self.root = Path(output) / ANCE_FOLDER
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        """The folder of `version`."""
        return self.root / f"version-{version:06d}"

    def published(self) -> list[int]:
        """Complete versions, oldest first."""
        found = []
        for child in self.root.iterdir():
            match = _VERSION.match(child.name)
            if match and (child / "commit.json").is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest complete version, if any."""
        versions = self.published()
        return versions[-1] if versions else None

    def publish(self, version: int, examples: list[TrainingExample], meta: dict[str, Any]) -> Path:
        """Write `version` atomically; the commit marker is written last."""
        with artefact_dir(self.path(version), KIND, {"version": version}) as tmp:
            write_examples(tmp / "examples.jsonl", examples)
            (tmp / "commit.json").write_text(
                json.dumps({"version": version, **meta}, indent=2), encoding="utf-8"
            )
        return self.path(version)

    def load(self, version: int) -> tuple[list[TrainingExample], dict[str, Any]]:
        """The examples and commit record of a complete version."""
        folder = self.path(version)
        meta = json.loads((folder / "commit.json").read_text(encoding="utf-8"))
        return read_examples(folder / "examples.jsonl", Diagnostics()), meta

    def remove_partial(self) -> int:
        """Delete what a killed publisher left behind; returns how many folders."""
        return len(remove_dead_temporaries(self.root))

    @property
    def stop_file(self) -> Path:
        """Created by the trainer when it ends, telling inferencers to stop."""
        return self.root / STOP_FILE
