"""Checks shared by every reader of id-keyed entries (documents, queries): ids and empty texts."""

from __future__ import annotations

from pathlib import Path

from densekit.data.records import id_problem
from densekit.diagnostics import Diagnostics


class EntryChecker:
    """Tracks ids seen in one file to report duplicates, and counts empty texts for one warning."""

    def __init__(self, path: Path, diagnostics: Diagnostics, noun: str):
        self.path = path
        self.diagnostics = diagnostics
        self.noun = noun
        self.first_line: dict[str, int] = {}
        self.empty_lines: list[int] = []

    def check_id(self, value: object, lineno: int) -> str | None:
        """The id as a string if it is valid and new; otherwise report the error and return None."""
        problem = id_problem(value)
        if problem is not None:
            self.diagnostics.error(self.path, lineno, problem)
            return None
        entry_id = str(value)
        first = self.first_line.get(entry_id)
        if first is not None:
            self.diagnostics.error(self.path, lineno, f"duplicate id {entry_id!r} (first on line {first})")
            return None
        self.first_line[entry_id] = lineno
        return entry_id

    def note_text(self, text: str, lineno: int) -> None:
        """Remember a line whose text is empty or only whitespace."""
        if not text.strip():
            self.empty_lines.append(lineno)

    def finish(self) -> None:
        """Report empty texts as one warning with their count and lines."""
        if self.empty_lines:
            shown = ", ".join(str(n) for n in self.empty_lines[:10])
            more = ", ..." if len(self.empty_lines) > 10 else ""
            self.diagnostics.warn(
                self.path,
                None,
                f"{len(self.empty_lines)} {self.noun} with empty text (lines {shown}{more})",
            )

    @property
    def ids(self) -> set[str]:
        """Every id read so far."""
        return set(self.first_line)
