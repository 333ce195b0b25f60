"""Problems found in input files, each naming the file, the line and what is wrong (every package
reports through these, so this module depends on none of them but the errors' root)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from densekit.errors import DensekitError

log = logging.getLogger("densekit")

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input file; `line` is 1-based, or None for the whole file."""

    path: Path
    line: int | None
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else f"{self.path}"
        return f"{where}: {self.severity}: {self.message}"


class DataError(DensekitError, ValueError):
    """Raised for input that cannot be read as asked; carries every error found, one a line."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        shown = "\n".join(str(p) for p in problems[:20])
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(shown + more)


@dataclass
class Diagnostics:
    """Where readers report problems.

    By default the first error raises `DataError` at once and warnings are logged as they come. With
    `collect=True` (as `densekit validate` uses) errors and warnings are gathered so that one pass
    reports all of them, up to `max_errors_per_file` errors a file; past that the file is abandoned with
    a note saying so.
    """

    collect: bool = False
    max_errors_per_file: int = 50
    problems: list[Problem] = field(default_factory=list)
    _errors_per_file: dict[Path, int] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)

    def error(self, path: Path, line: int | None, message: str) -> None:
        """Report an error: raise now, or record it when collecting."""
        problem = Problem(Path(path), line, message, "error")
        if not self.collect:
            raise DataError([problem])
        count = self._errors_per_file.get(problem.path, 0) + 1
        self._errors_per_file[problem.path] = count
        self.problems.append(problem)
        if count >= self.max_errors_per_file:
            self.problems.append(
                Problem(problem.path, None, f"stopped reading after {count} errors", "error")
            )
            raise _TooManyErrors(problem.path)

    def warn(self, path: Path, line: int | None, message: str) -> None:
        """Record a warning when collecting; log it otherwise, once however often a file is read."""
        problem = Problem(Path(path), line, message, "warning")
        if self.collect:
            self.problems.append(problem)
        elif str(problem) not in self._logged:
            self._logged.add(str(problem))
            log.warning(str(problem))

    @property
    def errors(self) -> list[Problem]:
        """The errors recorded so far."""
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        """The warnings recorded so far."""
        return [p for p in self.problems if p.severity == "warning"]

    def raise_if_errors(self) -> None:
        """Raise `DataError` with every recorded error, if there is any."""
        if self.errors:
            raise DataError(self.errors)


class _TooManyErrors(Exception):
    """Internal: a collecting reader gives up on one file."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path
