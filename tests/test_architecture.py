"""The package's shape stays as drawn (docs/design.md): floors that import only downward, no import
cycle, one root for densekit's errors, and "how to add" examples that are true."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import densekit
from densekit.errors import DensekitError

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter's own dependency
    import tomli as tomllib

cli_main = importlib.import_module("densekit.cli.main")  # the module; `densekit.cli.main` is a function

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")


def design_example(marker: str) -> str:
    """The code block docs/design.md puts under `<!-- example: MARKER -->`."""
    found = re.search(rf"<!-- example: {re.escape(marker)} -->\n```python\n(.*?)```", DESIGN, flags=re.S)
    assert found, f"docs/design.md has no example marked {marker!r}"
    return found.group(1)


def test_no_module_of_densekit_imports_in_a_cycle():
    graph = grimp.build_graph("densekit")
    in_cycles = sorted(
        (importer, imported)
        for importer in graph.modules
        for imported in graph.find_modules_directly_imported_by(importer)
        if graph.chain_exists(importer=imported, imported=importer)
    )
    assert in_cycles == []


def test_the_import_contracts_hold():
    # in a process of its own: import-linter's logging set-up disables every logger already made
    check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_floors_in_the_design_are_the_layers_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (floors,) = [c for c in contracts if c["type"] == "layers" and c["containers"] == ["densekit"]]
    layers = [{name.strip() for name in layer.split("|")} for layer in floors["layers"]]
    table = DESIGN.split("<!-- floors:", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [set(re.findall(r"`([a-z_]+)`", row.split("|")[2])) for row in rows] == layers
    children = {module.name for module in pkgutil.iter_modules(densekit.__path__)}
    assert set().union(*layers) == children  # every package and module of densekit has its floor


def _all_modules() -> list[str]:
    found = pkgutil.walk_packages(densekit.__path__, "densekit.")
    return sorted(info.name for info in found if info.name != "densekit.__main__")


def test_every_error_densekit_defines_derives_from_densekit_error():
    errors = []
    for name in _all_modules():
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name
                    and not attribute.startswith("_")):  # fmt: skip
                errors.append(value)
    assert len(errors) > 15
    assert [error.__qualname__ for error in errors if not issubclass(error, DensekitError)] == []


def test_the_command_line_shows_any_densekit_error_in_one_line_with_status_2(monkeypatch, capsys):
    class Refused(DensekitError):
        """An error of densekit's that is no ValueError, RuntimeError or OSError."""

    def refuse() -> None:
        raise Refused("the thing asked for is refused")

    monkeypatch.setattr(cli_main, "app", refuse)
    with pytest.raises(SystemExit) as exit_status:
        cli_main.main()
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.strip() == "error: the thing asked for is refused"


def test_every_kind_strategy_and_objective_has_its_row_in_its_doc():
    from densekit.models.modules.kind import MODULE_KINDS
    from densekit.pretraining.tasks import TASKS
    from densekit.routing.strategies import STRATEGIES

    modules_doc, routing_doc, pretraining_doc = (
        (ROOT / "docs" / name).read_text(encoding="utf-8")
        for name in ("modules.md", "routing.md", "pretraining.md")
    )
    assert [name for name in MODULE_KINDS if f"\n| `{name}` (" not in modules_doc] == []
    assert [name for name in STRATEGIES if f"\n| {name} |" not in routing_doc] == []
    assert [name for name in TASKS if f"\n| `{name}` |" not in pretraining_doc] == []


REGISTRY_PACKAGES = {  # each extension point's package of one file a piece, and the package above it
    "densekit.models.modules.kinds": "densekit.models.modules",
    "densekit.routing.strategies": "densekit.routing",
    "densekit.pretraining.objectives": "densekit.pretraining",
    "densekit.index.backends": "densekit.index",
}


def test_a_new_file_in_a_registry_package_needs_no_edit_of_the_import_contracts():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = {contract["containers"][0]: contract for contract in contracts if contract["type"] == "layers"}
    independent = {name for c in contracts if c["type"] == "independence" for name in c["modules"]}
    for package, parent in REGISTRY_PACKAGES.items():
        named = {n.strip() for layer in layers[parent]["layers"] for n in layer.split("|")}
        assert package.rsplit(".", 1)[1] in named, package  # the package is one layer, its files inside it
        assert not any("." in name for name in named), parent  # no layer names a file of the package
    assert independent == {
        "densekit.models.modules.kinds.*",
        "densekit.routing.strategies.*",
        "densekit.index.backends.*",
    }


def test_each_how_to_add_example_is_a_new_file_its_registry_package_would_find():
    # tests/test_extension_points.py runs each as the one new file of a copy of the package
    examples = [
        design_example("new file src/densekit/models/modules/kinds/ln_tuning.py"),
        design_example("new file src/densekit/routing/strategies/mixture.py"),
        design_example("new file src/densekit/pretraining/objectives/cropping.py"),
    ]
    paths = re.findall(r"<!-- example: new file (\S+) -->", DESIGN)
    assert len(paths) == len(examples)
    for path, code in zip(paths, examples, strict=True):
        assert not (ROOT / path).exists(), path
        assert ".".join(Path(path).parent.parts[1:]) in REGISTRY_PACKAGES, path
        compile(code, path, "exec")


def test_no_registered_piece_is_tested_by_its_name_outside_its_own_file():
    from densekit.models.modules.kind import MODULE_KINDS
    from densekit.pretraining.tasks import TASKS
    from densekit.routing.strategies import STRATEGIES

    names = "|".join(re.escape(name) for name in [*MODULE_KINDS, *STRATEGIES, *TASKS])
    compared = re.compile(rf"""(==|!=|\bin)\s*[(\[{{]?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    tested = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "src").rglob("*.py"))
              if not any(part in path.parts for part in ("kinds", "strategies", "objectives"))
              for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
              if compared.search(line) and not line.lstrip().startswith("for ")]  # fmt: skip
    assert tested == []


def test_the_index_backend_example_imports_as_a_backend_file_may():
    """The example, run as one new backend file by tests/test_extension_index.py, keeps the contracts its
    place would hold it to: nothing from another backend, nothing above the floor of `index`."""
    example = design_example("a new file src/densekit/index/backends/numpy_index.py")
    imported = {
        node.module
        for node in ast.walk(ast.parse(example))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("densekit.")
    }
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (floors,) = [c for c in contracts if c["type"] == "layers" and c["containers"] == ["densekit"]]
    floor = {name.strip(): level for level, layer in enumerate(floors["layers"]) for name in layer.split("|")}
    assert "densekit.index.base" in imported
    assert [name for name in imported if name.startswith("densekit.index.backends")] == []
    assert [name for name in imported if floor[name.split(".")[1]] < floor["index"]] == []
