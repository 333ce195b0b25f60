"""The floors hold when the code runs, not only in the import graph: import-linter reads the imports the
source writes, and cannot see what importing a package runs through the package above it (the root is
its contract's container). Each import here runs in a fresh interpreter, whose `sys.modules` then says
what it really loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
(CONTRACT,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"]
               if c["type"] == "layers" and c["containers"] == ["densekit"]]  # fmt: skip
# What neither the ground floor nor the command line's entry may load: the HTTP client's library, the
# index library and the model library, each seconds of start-up and none needed to answer `--help`.
HEAVY = ("httpx", "faiss", "torch")


def _floors() -> dict[str, tuple[int, bool]]:
    """Each package of the contract: its floor (0 the lowest) and whether its floor's packages are
    independent (`a | b`) or may import each other (`a : b`)."""
    floors = {}
    for height, layer in enumerate(reversed(CONTRACT["layers"])):
        independent = ":" not in layer
        for name in re.split(r"[|:]", layer):
            floors[name.strip().strip("()")] = (height, independent)
    return floors


FLOORS = _floors()
GROUND = min(FLOORS, key=lambda name: FLOORS[name][0])
ENTRY_MODULE, ENTRY_FUNCTION = PYPROJECT["project"]["scripts"]["densekit"].split(":")


def loaded_by(statements: str) -> list[str]:
    """The modules a fresh interpreter holds after running `statements`."""
    code = f"{statements}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [name for name in HEAVY if name in modules]


def test_the_ground_floor_loads_no_heavy_library():
    assert _heavy(loaded_by(f"import densekit.{GROUND}")) == []


def test_the_command_lines_entry_loads_no_heavy_library_nor_does_its_help():
    assert _heavy(loaded_by(f"from {ENTRY_MODULE} import {ENTRY_FUNCTION}")) == []
    helped = f"import sys\nsys.argv = ['densekit', '--help']\nfrom {ENTRY_MODULE} import {ENTRY_FUNCTION}\n"
    helped += f"try:\n    {ENTRY_FUNCTION}()\nexcept SystemExit:\n    pass"
    assert _heavy(loaded_by(helped)) == []


def test_the_root_loads_the_client_only_when_asked_for_it():
    assert "httpx" not in loaded_by("import densekit")
    asked = loaded_by("import densekit\nassert densekit.Client.__module__ == 'densekit.client'")
    assert "httpx" in asked


# `__main__` is left out: importing it runs the command line (its floor is the entry's, tested above)
@pytest.mark.parametrize("package", sorted(set(FLOORS) - {"__main__"}))
def test_each_floor_loads_only_the_floors_below_it(package: str):
    height, independent = FLOORS[package]
    loaded = {name.split(".")[1] for name in loaded_by(f"import densekit.{package}")
              if name.startswith("densekit.")}  # fmt: skip
    unknown = sorted(loaded - set(FLOORS))
    assert unknown == [], f"densekit.{package} loads packages of no floor: {unknown}"
    above = sorted(
        name for name in loaded - {package}
        if FLOORS[name][0] > height or (FLOORS[name][0] == height and independent)
    )  # fmt: skip
    assert above == [], f"densekit.{package} (floor {height}) loads floors above or beside it: {above}"
