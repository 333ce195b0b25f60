"""Model cards, module folders and run folders against hostile names, edits and copies (issue 63: cases
4, 6, 8, 13, 14, 20 and 27's `--report-to ''`).

A folder name is anyone's text: through every card writer, one made to break out of a Python string, to
start a second title and to carry raw HTML stays one string literal in each snippet and escaped text in
the prose. A card is documentation: editing it (or any README in a checkpoint) never stops a folder
from loading or a run from resuming, and a README of the user's survives `--overwrite`."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from densekit.encoding.embed import embed_texts
from densekit.io.artefact import MANIFEST, read_manifest, verify
from densekit.io.fingerprint import file_digest
from densekit.io.readme import CARD_MARK
from densekit.models import DenseEncoder
from densekit.models.cross_encoder import CrossEncoder
from densekit.routing.route import Route
from densekit.routing.strategies import RouteSpec
from densekit.training.checkpoint import checkpoints
from densekit.training.fine_tuning import run_training

from ..conftest import write_beir
from ..test_modules import TEXTS, put_module
from ..test_trackers import CONFIG_YAML, log_record
from ..test_training import make_config
from .commands import assert_refused, cli

# A folder name that closes a Python string and runs code, starts a second title, and carries raw
# HTML, backticks that would end a code block, a table's bar, a link and a right-to-left override.
HOSTILE = (
    'x\')\n")\nimport os; os.system("touch PWNED")\n# <img src=x onerror=alert(1)> ```` | [a](b) \u202e &lt;'
)
SNIPPET_MODULES = {"densekit", "sentence_transformers", "peft", "transformers"}


def card_parts(folder: Path) -> tuple[dict, list[str], dict[str, str]]:
    """A card's YAML header, its prose lines (outside code blocks) and its Python blocks by the heading
    above them, read as CommonMark reads fences: a block ends only on a line of at least as many
    backticks as opened it, indented at most 3 spaces."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert match, text
    prose: list[str] = []
    code: dict[str, str] = {}
    heading, fence, language, block = "", "", "", []
    for line in match.group(2).split("\n"):
        if fence:
            if re.fullmatch(rf" {{0,3}}`{{{len(fence)},}}\s*", line):
                if language == "python":
                    code[heading] = "\n".join(block)
                fence, block = "", []
            else:
                block.append(line)
            continue
        opening = re.fullmatch(r" {0,3}(`{3,})([^`]*)", line)
        if opening:
            fence, language = opening.group(1), opening.group(2).strip()
            continue
        prose.append(line)
        if line.startswith("### "):
            heading = line[4:]
    assert not fence, "a code block is never closed"
    return yaml.safe_load(match.group(1)), prose, code


def literals(code: str) -> list[str]:
    """The string literals of a snippet that does nothing but import and assign (checked)."""
    tree = ast.parse(code)
    for statement in tree.body:
        assert isinstance(statement, ast.Import | ast.ImportFrom | ast.Assign), ast.unparse(statement)
        if isinstance(statement, ast.ImportFrom):
            assert statement.module.split(".")[0] in SNIPPET_MODULES, ast.unparse(statement)
        if isinstance(statement, ast.Import):
            names = [alias.name.split(".")[0] for alias in statement.names]
            assert set(names) <= SNIPPET_MODULES, ast.unparse(statement)
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def assert_safe_card(folder: Path, paths: dict[str, list[str]]) -> list[str]:
    """The card of `folder` (named `HOSTILE`) shows the name as text: one title, no raw HTML, table rows
    of two cells, and each snippet (by heading) holding each of its `paths` as exactly one literal."""
    header, prose, code = card_parts(folder)
    assert folder.name == HOSTILE and "base_model" not in header  # a local base: no path of this machine
    assert [line for line in prose if "<" in line] == [CARD_MARK]  # no raw HTML but densekit's mark
    headings = [line for line in prose if re.match(r" {0,3}#", line)]
    assert len([h for h in headings if re.match(r"# ", h)]) == 1, headings
    assert [h for h in headings if not h.startswith("# ")] == ["## Model", "## Use it"] + [
        f"### {name}" for name in paths
    ], headings
    assert not any(line.startswith(("import os", '")', "x')")) for line in prose)  # no name spilled over
    rows = prose[prose.index("## Model") + 2 : prose.index("## Use it")]
    table = [line for line in rows if line.startswith("|")]
    assert table and all(len(re.findall(r"(?<!\\)\|", line)) == 3 for line in table), table
    assert set(code) == set(paths)
    for name, expected in paths.items():
        found = literals(code[name])
        for path in expected:
            assert found.count(path) == 1, (name, path, found)
    return prose


def run_snippet(code: str, where: Path) -> dict:
    """Run a card's snippet as a reader would, in the folder that holds the saved one."""
    here = Path.cwd()
    os.chdir(where)
    try:
        scope: dict = {}
        exec(code, scope)
        return scope
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def query_modules(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    """Two query-only LoRA modules on the tiny base, `qa` and `qb`."""
    root = tmp_path_factory.mktemp("card-modules")
    for seed, name in enumerate(("qa", "qb")):
        encoder = DenseEncoder.load(tiny_model, pooling="mean")
        put_module(encoder, "query-lora", name, seed=seed)
        encoder.save(root / name)
    return {"qa": root / "qa", "qb": root / "qb"}


def test_4_a_hostile_folder_name_is_one_string_in_a_models_snippets_and_text_in_its_card(
    tiny_model: Path, tmp_path: Path
):
    encoder = DenseEncoder.load(tiny_model, pooling="mean")
    folder = tmp_path / HOSTILE
    encoder.save(folder)
    assert_safe_card(folder, {"densekit": [HOSTILE], "sentence-transformers": [HOSTILE]})
    code = card_parts(folder)[2]
    loaded = run_snippet(code["densekit"], tmp_path)["encoder"]  # it loads the folder, and runs nothing
    assert not (tmp_path / "PWNED").exists()
    assert np.allclose(embed_texts(loaded, TEXTS, "query"), embed_texts(encoder, TEXTS, "query"), atol=1e-6)

    two_towers = tmp_path / "towers" / HOSTILE
    DenseEncoder.load(tiny_model, tied=False).save(two_towers)
    assert_safe_card(two_towers, {"densekit": [HOSTILE]})


def test_4_a_hostile_folder_name_is_text_in_a_cross_encoders_card(tiny_model: Path, tmp_path: Path):
    folder = tmp_path / HOSTILE
    CrossEncoder.load(tiny_model, 48).save(folder)
    assert_safe_card(folder, {"densekit": [HOSTILE], "sentence-transformers": [HOSTILE]})


def test_4_a_hostile_folder_name_is_text_in_a_module_card(tiny_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_model, pooling="mean")
    put_module(encoder, "query-lora", "m", seed=2)
    folder = tmp_path / HOSTILE
    encoder.save(folder)
    base = os.path.relpath(tiny_model, tmp_path)
    assert_safe_card(folder, {"densekit": [base, HOSTILE], "PEFT (query tower)": [base, f"{HOSTILE}/query"]})
    loaded = run_snippet(card_parts(folder)[2]["densekit"], tmp_path)["encoder"]
    assert not (tmp_path / "PWNED").exists()
    assert np.allclose(embed_texts(loaded, TEXTS, "query"), embed_texts(encoder, TEXTS, "query"), atol=1e-6)


def test_4_a_hostile_folder_name_is_text_in_a_route_card_saved_or_written_by_modules_route(
    query_modules: dict[str, Path], tmp_path: Path, capsys
):
    from densekit.routing.route import load_modules

    encoder, names = load_modules(list(query_modules.values()))
    spec = RouteSpec(type="fixed", modules=names, domains={"x": "qa", "y": "qb"})
    saved = tmp_path / "saved" / HOSTILE
    Route(encoder, spec).save(saved, query_modules)
    prose = assert_safe_card(saved, {"densekit": [HOSTILE]})
    assert not any(str(folder) in line for line in prose for folder in query_modules.values())

    written = tmp_path / "cli" / HOSTILE
    domains = ["--domain", "x=qa", "--domain", "y=qb"]
    code, err, _ = cli(capsys, "modules", "route", *query_modules.values(), *domains, "-o", written)
    assert code == 0, err
    assert_safe_card(written, {"densekit": [HOSTILE]})
    routed = run_snippet(card_parts(written)[2]["densekit"], written.parent)["vectors"]
    assert not (written.parent / "PWNED").exists()
    assert np.allclose(routed, Route.load(written).encode_queries(["a question"], ["x"]), atol=1e-6)


def test_4_a_trained_models_card_shows_hostile_input_paths_as_text(
    collection, tiny_model: Path, tmp_path: Path
):
    root, train = collection
    data = shutil.copytree(root, tmp_path / HOSTILE)
    config = make_config((data, train), tiny_model, optim={"max_steps": 2}, checkpoint={"every": 2})
    run_training(config, tmp_path / "run", show_progress=False)
    _, prose, code = card_parts(tmp_path / "run" / "model")
    assert set(code) == {"densekit", "sentence-transformers"}  # the config's block closed where it should
    assert [line for line in prose if "<" in line] == [CARD_MARK]
    assert [line for line in prose if line.startswith("## ")] == ["## Model", "## Use it", "## Training"]
    inputs = [line for line in prose if line.startswith("| data.path |")]
    assert len(inputs) == 1 and len(re.findall(r"(?<!\\)\|", inputs[0])) == 5, inputs


# --- case 13: module folders carry densekit's card, outside their checksums --------------------------


def assert_editable_card(folder: Path, *machine_paths: Path) -> None:
    """`folder`'s only README is densekit's card, outside its checksums, naming none of `machine_paths`;
    with the card edited, the folder still loads."""
    assert [p.relative_to(folder).as_posix() for p in folder.rglob("README.md")] == ["README.md"]
    text = (folder / "README.md").read_text()
    assert CARD_MARK in text and "peft" in yaml.safe_load(text.split("---")[1])["library_name"]
    assert not [str(path) for path in machine_paths if str(path) in text]
    assert not [name for name in read_manifest(folder).checksums if name.endswith("README.md")]
    (folder / "README.md").write_text(text + "\nMy notes on this module.\n")  # as docs/modules.md invites
    verify(folder)


@pytest.mark.parametrize("kind", ["lora", "separate-lora"])
def test_13_a_lora_modules_card_is_densekits_outside_its_checksums(
    tiny_model: Path, tmp_path: Path, kind: str
):
    encoder = DenseEncoder.load(tiny_model, pooling="mean", tied=kind == "lora")
    put_module(encoder, kind, "m", seed=3)
    folder = tmp_path / "m"
    encoder.save(folder)
    assert_editable_card(folder, tiny_model.parent, tmp_path)
    loaded = DenseEncoder.load(folder)
    assert np.allclose(embed_texts(loaded, TEXTS, "query"), embed_texts(encoder, TEXTS, "query"), atol=1e-6)


def test_13_modules_average_writes_densekits_card_outside_the_checksums(
    tiny_model: Path, tmp_path: Path, capsys
):
    for seed, name in enumerate(("a", "b")):
        encoder = DenseEncoder.load(tiny_model, pooling="mean")
        put_module(encoder, "lora", name, seed=seed)
        encoder.save(tmp_path / name)
    code, err, _ = cli(capsys, "modules", "average", tmp_path / "a", tmp_path / "b", "--weights", "0.5,0.5",
                       "-o", tmp_path / "avg")  # fmt: skip
    assert code == 0, err
    assert_editable_card(tmp_path / "avg", tiny_model.parent, tmp_path)
    assert DenseEncoder.load(tmp_path / "avg").own == "averaged"


def test_13_a_module_an_earlier_densekit_saved_with_a_checksummed_readme_loads_after_an_edit(
    tiny_model: Path, tmp_path: Path
):
    encoder = DenseEncoder.load(tiny_model, pooling="mean")
    put_module(encoder, "lora", "m", seed=4)
    folder = tmp_path / "m"
    encoder.save(folder)
    manifest = json.loads((folder / MANIFEST).read_text())  # as densekit wrote it before: README listed
    manifest["checksums"]["README.md"] = file_digest(folder / "README.md")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / "README.md").write_text("# m\n\nMy own words.\n")
    assert DenseEncoder.load(folder).own == "m"


# --- case 14: a checkpoint's model card -------------------------------------------------------------


def test_14_edited_cards_in_checkpoints_leave_resume_working(collection, tiny_model: Path, tmp_path: Path):
    run = tmp_path / "run"
    config = make_config(collection, tiny_model, optim={"max_steps": 4}, checkpoint={"every": 2, "keep": 5})
    run_training(config, run, show_progress=False)
    found = checkpoints(run / "checkpoints")
    assert [p.name for p in found] == ["step-00000002", "step-00000004"]
    for checkpoint in found:
        assert "model/README.md" not in read_manifest(checkpoint).checksums
        card = checkpoint / "model" / "README.md"
        card.write_text(card.read_text() + "\nEdited.\n")
        verify(checkpoint)
    shutil.rmtree(found[-1])  # as if killed before its last checkpoint: the run resumes from step 2
    shutil.rmtree(run / "model")
    run_training(config, run, resume=True, show_progress=False)
    assert [p.name for p in checkpoints(run / "checkpoints")] == ["step-00000002", "step-00000004"]
    assert read_manifest(run / "model").kind == "model"


# --- case 6: --overwrite keeps the user's README ------------------------------------------------------


@pytest.mark.parametrize("then", ["the same config", "another config"])
def test_6_train_overwrite_keeps_the_users_readme_in_model_and_best(
    collection, tiny_model: Path, tmp_path: Path, then: str
):
    run = tmp_path / "run"
    config = make_config(collection, tiny_model, optim={"max_steps": 2}, eval={"split": "test", "every": 2},
                         checkpoint={"every": 2})  # fmt: skip
    run_training(config, run, show_progress=False)
    mine = {name: f"# My {name}\n\nNotes of my own, kept by hand.\n" for name in ("model", "best")}
    for name, text in mine.items():
        (run / name / "README.md").write_text(text)
    if then == "another config":
        config = make_config(collection, tiny_model, optim={"max_steps": 2, "learning_rate": 2e-3},
                             eval={"split": "test", "every": 2}, checkpoint={"every": 2})  # fmt: skip
    run_training(config, run, show_progress=False, overwrite=True)
    for name, text in mine.items():
        assert (run / name / "README.md").read_text() == text
        assert read_manifest(run / name).kind == "model"
        verify(run / name)
        DenseEncoder.load(run / name)


# --- case 8: a copied run folder and a shared MLflow store ------------------------------------------


def test_8_resuming_a_copied_run_folder_leaves_the_originals_mlflow_run(tmp_path: Path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from densekit.training.log import TrainingLog

    store = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store)

    def started(folder: Path, resume_step: int | None, steps: range) -> str:
        training_log = TrainingLog(folder, resume_step, ["mlflow"], CONFIG_YAML)
        for step in steps:
            training_log.write(log_record(step, resumed=resume_step is not None))
        training_log.close(failed=resume_step is None)
        return json.loads((folder / "mlflow-run.json").read_text())["run_id"]

    original = tmp_path / "original"
    original.mkdir()
    first = started(original, None, range(1, 5))
    copy = shutil.copytree(original, tmp_path / "copy")
    copied = started(copy, 3, range(4, 7))
    assert client.get_run(first).info.lifecycle_stage == "active"  # the original's run is left
    resumed = started(original, 3, range(4, 7))
    assert client.get_run(first).info.lifecycle_stage == "deleted"  # its own folder replaces it
    assert {client.get_run(r).info.lifecycle_stage for r in (copied, resumed)} == {"active"}
    history = client.get_metric_history(copied, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]


# --- case 20: a module of the same name with other weights ------------------------------------------


def test_20_an_index_made_with_a_module_of_the_same_name_and_other_weights_names_the_module(
    tiny_model: Path, tmp_path: Path, capsys
):
    for seed, name in enumerate(("s1", "s2")):
        encoder = DenseEncoder.load(tiny_model, pooling="mean")
        put_module(encoder, "lora", "s", seed=seed)
        encoder.save(tmp_path / name)
    data = write_beir(tmp_path / "data")
    code, err, _ = cli(capsys, "encode", tmp_path / "s1", data, "-o", tmp_path / "emb")
    assert code == 0, err
    code, err, _ = cli(capsys, "index", tmp_path / "emb", "-o", tmp_path / "idx")
    assert code == 0, err
    code, err, _ = cli(capsys, "search", tmp_path / "s2", tmp_path / "idx", data, "-o", tmp_path / "run.trec")
    assert_refused(code, err, f"{tmp_path / 'idx'} was built with a module 's' of other weights",
                   f"module 's' on this encoder (loaded from {tmp_path / 's2'})")  # fmt: skip
    assert "other model weights" not in err


# --- case 27: --report-to '' -------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["", "mlflow,", " , "])
def test_27_an_empty_report_to_is_refused_in_one_line(
    collection, tiny_model: Path, tmp_path: Path, capsys, given
):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(make_config(collection, tiny_model).model_dump(mode="json")))
    code, err, _ = cli(capsys, "train", config, "--out", tmp_path / "run", "--report-to", given)
    assert_refused(code, err, f"--report-to {given!r}: an empty tracker name", "none")
    assert not (tmp_path / "run").exists()
