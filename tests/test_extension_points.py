"""Each "how to add" of docs/design.md done as it is written: the piece its example shows becomes the ONE
new file of a copy of densekit's sources, nothing else changes, and with that copy first on PYTHONPATH
the registry's shared tests, the command line (a recipe, and `search` for a routing strategy) and
lint-imports run it. The shared tests and the commands run in one interpreter, one after the other.

"One new file, no other file edited" is checked rather than assumed:

- the copy is `src/densekit` copied whole (without `__pycache__`), with the example written into it;
  after every run it is compared with the checkout file by file (names and bytes), and the one
  difference allowed is the new file;
- each run is a fresh interpreter (one for the tests and commands, one for lint-imports) whose
  `PYTHONPATH` is the copy's folder and that writes no bytecode there; the shared tests are this
  checkout's test files, unedited, whose matrices are the registries, and lint-imports reads this
  checkout's `pyproject.toml`, unedited, and must count every module of the copy, the new one among them;
- nothing names the new module: its package finds it among its files (`import_every_module`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml

from .test_architecture import design_example

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "src" / "densekit"


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under `root` but Python's bytecode, by its path below `root`."""
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}  # fmt: skip


class PackageCopy:
    """`src/densekit` copied to `folder / "src"`, plus the one new file at `path` (below `src/`)."""

    def __init__(self, folder: Path, path: str):
        self.src = folder / "src"
        shutil.copytree(SOURCES, self.src / "densekit", ignore=shutil.ignore_patterns("__pycache__"))
        self.new_file = str(Path(path).relative_to("src/densekit"))
        assert not (SOURCES / self.new_file).exists(), f"{path} is a file of densekit already"
        (self.src / "densekit" / self.new_file).write_text(
            design_example(f"new file {path}"), encoding="utf-8"
        )
        self.check_one_new_file()

    def check_one_new_file(self) -> None:
        """The copy differs from the checkout by the new file alone."""
        checkout, copy = files_of(SOURCES), files_of(self.src / "densekit")
        assert {name for name in checkout.keys() | copy.keys() if checkout.get(name) != copy.get(name)} == {
            self.new_file
        }

    def run(self, *args: str, cwd: Path = ROOT, timeout: int = 1500) -> subprocess.CompletedProcess:
        """`python ARGS` in a fresh interpreter importing densekit from the copy; it must succeed and
        leave the copy as it was."""
        outer = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
        env = {**outer, "PYTHONPATH": str(self.src), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
               "DENSEKIT_PROGRESS_INTERVAL": "600"}  # fmt: skip
        result = subprocess.run(
            [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, f"{args}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        self.check_one_new_file()
        return result

    def check(self, test_file: str, name: str, tmp_path: Path, then: str = "") -> dict[str, str]:
        """In one fresh interpreter importing densekit from the copy: `test_file`'s tests of the piece
        `name` and its check that every registered piece is in the matrices, then the Python `then`, in
        which `densekit(*words)` runs a command as the command line does (one interpreter for all: each
        costs about 10 s of imports here). The outcome of each test, by test function and parameter."""
        report = tmp_path / "shared.xml"
        arguments = [f"tests/{test_file}", "-k", f"{name} or through_the_shared", "-n", "0",
                     "-p", "no:randomly", "-p", "no:cacheprovider", "-q", f"--junitxml={report}"]  # fmt: skip
        tests = f"import sys, pytest\nif pytest.main({arguments!r}):\n    sys.exit(1)\n"
        self.run("-c", tests + COMMAND_LINE + then)
        outcomes = {}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            failed = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = failed[0] if failed else "passed"
        return outcomes

    def lint_imports(self) -> None:
        """import-linter's contracts, from the checkout's pyproject.toml, hold over the copy, every module
        of which it analysed."""
        check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
        said = self.run("-c", check).stdout
        modules = len(list((self.src / "densekit").rglob("*.py")))
        assert f"Analyzed {modules} files" in said, said[-2000:]
        assert "0 broken" in said


# `densekit(*words)`: the command line's entry point run on `words` in the interpreter it is in
COMMAND_LINE = """
from densekit.cli.main import main


def densekit(*words):
    sys.argv = ["densekit", *words]
    try:
        main()
    except SystemExit as done:
        if done.code not in (0, None):
            raise
"""


def run_recipe(path: Path, out: Path) -> str:
    """The `densekit run` of the recipe at `path` into `out`, as `then` code."""
    return f"densekit('run', {str(path)!r}, '--out', {str(out)!r}, '--device', 'cpu', '--no-progress')\n"


def passed(outcomes: dict[str, str], name: str, tests: list[str]) -> None:
    """Each of `tests` ran for the piece `name` and passed, and nothing run failed."""
    assert [case for case, outcome in outcomes.items() if outcome != "passed"] == []
    assert [test for test in tests if f"{test}[{name}]" not in outcomes] == []
    assert any("through_the_shared" in case for case in outcomes)  # every registered piece is in them


# The shared tests each registry's piece must pass (docs/design.md, "What plugs in through a registry")
MODULE_KIND_TESTS = [
    "test_save_then_load_gives_the_same_embeddings_and_the_base_stays_bit_identical",
    "test_training_changes_only_the_module",
    "test_a_killed_module_run_resumes_to_the_same_module",
    "test_merged_modules_equal_the_unmerged_module",
    "test_peft_itself_loads_a_peft_kind_module_folder_to_the_same_states",
]
STRATEGY_TESTS = [
    "test_a_saved_route_loads_to_the_same_routed_vectors_and_refuses_a_changed_module",
    "test_a_route_over_modules_that_add_nothing_gives_the_bases_vectors",
]
OBJECTIVE_TESTS = [
    "test_each_method_exports_its_backbone_alone_with_cls_pooling",
    "test_pretraining_resumes_exactly",
]


def write_yaml(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.timeout(3000)  # the shared tests and a recipe in one new interpreter, then lint-imports
def test_a_module_kind_is_one_new_file(collection, tiny_model: Path, tmp_path: Path):
    copy = PackageCopy(tmp_path / "copy", "src/densekit/models/modules/kinds/ln_tuning.py")
    root, train = collection
    config = {"model": {"path": str(tiny_model), "pooling": "mean"},
              "data": {"path": str(root), "train": str(train), "group_size": 3},
              "modules": {"type": "ln_tuning", "name": "ln"},
              "optim": {"batch_size": 4, "learning_rate": 1e-2, "max_steps": 2},
              "checkpoint": {"every": 2}, "device": "cpu"}  # fmt: skip
    recipe = {"steps": {  # the train step runs `densekit train`'s code with the config as it stands
        "module": {"type": "train", "output": "{out}/module", "config": config},
        "embeddings": {"type": "encode", "model": "{out}/module/model", "data": str(root),
                       "output": "{out}/embeddings"},
    }}  # fmt: skip
    then = run_recipe(write_yaml(tmp_path / "recipe.yaml", recipe), tmp_path / "recipe")
    passed(copy.check("test_modules.py", "ln_tuning", tmp_path, then), "ln_tuning", MODULE_KIND_TESTS)

    model = tmp_path / "recipe" / "module" / "model"
    assert json.loads((model / "densekit-module.json").read_text())["spec"]["type"] == "ln_tuning"
    trained = safetensors.torch.load_file(str(model / "adapter_model.safetensors"))
    assert trained and all("ln_tuning_layers" in key for key in trained)
    assert json.loads((tmp_path / "recipe" / "embeddings" / "densekit-artefact.json").read_text())
    copy.lint_imports()


@pytest.mark.timeout(3000)  # the shared tests, a route, search and a recipe in one interpreter, lint-imports
def test_a_routing_strategy_is_one_new_file(tiny_model: Path, beir_dir: Path, tmp_path: Path):
    from densekit.data import Dataset
    from densekit.data.trec import read_run
    from densekit.diagnostics import Diagnostics
    from densekit.models import DenseEncoder
    from densekit.routing.strategy import routed_vectors

    from .test_modules import put_module
    from .test_routing import base_index

    copy = PackageCopy(tmp_path / "copy", "src/densekit/routing/strategies/mixture.py")
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for seed, name in enumerate("ab"):
        put_module(encoder, "query-lora", name, seed=seed)
        encoder.save(tmp_path / name)
    encoder.own = None
    index = base_index(encoder, beir_dir, tmp_path)
    route, index_folder = str(tmp_path / "route"), str(tmp_path / "index")
    modules = [str(tmp_path / "a"), str(tmp_path / "b")]
    bench = {"type": "benchmark", "model": route, "data": [str(beir_dir)], "indexes": [index_folder], "k": 3,
             "output": "{out}/bench"}  # fmt: skip
    then = (
        "from densekit.routing.route import Route, load_modules\n"
        "from densekit.routing.strategies import RouteSpec\n"
        f"encoder, names = load_modules({modules!r})\n"
        "spec = RouteSpec(type='mixture', modules=names, weights=[0.25, 0.75])\n"
        f"Route(encoder, spec).save({route!r}, dict(zip(names, {modules!r})))\n"
        f"densekit('search', {route!r}, {index_folder!r}, {str(beir_dir)!r}, '--k', '3', "
        f"'-o', {str(tmp_path / 'searched.trec')!r}, '--no-progress', '--device', 'cpu')\n"
        + run_recipe(write_yaml(tmp_path / "recipe.yaml", {"steps": {"bench": bench}}), tmp_path / "recipe")
    )
    passed(copy.check("test_routing.py", "mixture", tmp_path, then), "mixture", STRATEGY_TESTS)
    assert json.loads((tmp_path / "route" / "densekit-route.json").read_text())["spec"] == {
        "type": "mixture", "modules": ["a", "b"], "domains": {}, "fallback": None, "k": None,
        "weights": [0.25, 0.75],
    }  # fmt: skip

    queries = Dataset.open(beir_dir).split_queries("test")[0]
    inputs = encoder.pad(encoder.tokenize(list(queries.values()), "query"))
    with torch.no_grad():
        mixed = routed_vectors(encoder, ["a", "b"], torch.tensor([[0.25, 0.75]] * len(queries)),
                               inputs["input_ids"], inputs["attention_mask"])  # fmt: skip
    expected = index.search_run(mixed.numpy(), list(queries), 3)
    (benchmarked,) = (tmp_path / "recipe" / "bench").glob("*/dense.trec")
    for path in (tmp_path / "searched.trec", benchmarked):
        run = read_run(path, Diagnostics())
        assert {q: list(ranked) for q, ranked in run.items()} == {q: list(r) for q, r in expected.items()}
        assert all(abs(run[q][d] - expected[q][d]) < 1e-5 for q in expected for d in expected[q])
    copy.lint_imports()


@pytest.mark.timeout(3000)  # the shared tests and a recipe in one new interpreter, then lint-imports
def test_a_pretraining_objective_is_one_new_file(tiny_model: Path, tmp_path: Path):
    from .test_pretraining import TEXTS

    copy = PackageCopy(tmp_path / "copy", "src/densekit/pretraining/objectives/cropping.py")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    config = {"method": "cropping", "model": {"path": str(tiny_model), "max_length": 24},
              "data": {"path": str(corpus)}, "cropping": {"crop_min": 3, "crop_max": 8},
              "optim": {"batch_size": 4, "max_steps": 2, "learning_rate": 1e-3}, "log_every": 1,
              "device": "cpu"}  # fmt: skip
    # the pretrain step runs `densekit pretrain`'s code with the config as it stands
    recipe = {"steps": {"pretrained": {"type": "pretrain", "output": "{out}/pretrained", "config": config}}}
    then = run_recipe(write_yaml(tmp_path / "recipe.yaml", recipe), tmp_path / "recipe")
    passed(copy.check("test_pretraining.py", "cropping", tmp_path, then), "cropping", OBJECTIVE_TESTS)

    run = tmp_path / "recipe" / "pretrained"
    logged = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged if "loss_contrastive" in row] == [1, 2]
    start = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    exported = safetensors.torch.load_file(str(run / "model" / "model.safetensors"))
    words = "embeddings.word_embeddings.weight"
    assert not torch.equal(start[words], exported[words])  # trained
    copy.lint_imports()
