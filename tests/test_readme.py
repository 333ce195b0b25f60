"""The README's two commands stay true: CI runs the test command exactly as written there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
    quickstart, tests = readme_commands()
    assert quickstart.endswith("densekit quickstart")
    assert "pytest" in tests and "ruff check" in tests and "lint-imports" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines
