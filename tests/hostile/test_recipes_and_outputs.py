"""Recipes, configs and command outputs against hostile input (issue 50): the cases of the issue about
them, then attacks of our own. Each bad input gets one line naming the file and line, or the option."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from densekit.data import DataError, Diagnostics
from densekit.data.trec import read_run, write_run
from densekit.evaluation.fusion import fuse_runs
from densekit.models import DenseEncoder
from densekit.recipes.runner import load_recipe, run_recipe

from ..test_modules import put_module
from ..test_outputs import snapshot
from .commands import assert_refused, cli, flat


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def bm25_steps(data: Path) -> str:
    """A recipe's text: one BM25 step over `data`."""
    step = '{type: bm25, data: "{data.path}", output: "{out}/b.trec"}'
    return f'data: {{path: "{data}"}}\nsteps:\n  bm25: {step}\n'


@pytest.fixture(scope="module")
def modules(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[DenseEncoder, Path]:
    """The tiny base with query-only LoRA modules a and b on it, each saved in a folder of its name."""
    root = tmp_path_factory.mktemp("modules")
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for seed, name in enumerate("ab"):
        put_module(encoder, "query-lora", name, seed=seed)
        encoder.save(root / name)
    encoder.own = None
    return encoder, root


# Case 34: recursive YAML aliases said "maximum recursion depth", with no file or line.


@pytest.mark.parametrize("command", ["run", "train"])
def test_a_recursive_alias_is_refused_naming_the_file_and_line(capsys, tmp_path: Path, command: str):
    path = write_recipe(tmp_path / "r.yaml", "data: {path: x, train: y}\nloop: &loop [1, *loop]\n")
    code, err, _ = cli(capsys, command, path, "--out", tmp_path / "out")
    assert_refused(code, err, f"{path}:2:", "alias *loop is inside the node it names")


# Case 7: `modules average A B -o B` wrote over one of its inputs.


@pytest.mark.parametrize("command", ["average", "route"])
def test_a_modules_command_never_writes_over_one_of_its_inputs(capsys, modules, command: str):
    _, root = modules
    before = snapshot(root)
    options = ["--weights", "0.5,0.5"] if command == "average" else ["--domain", "x=a"]
    code, err, _ = cli(capsys, "modules", command, root / "a", root / "b", *options, "-o", root / "b")
    assert_refused(code, err, f"{root / 'b'} is an input of this command")
    assert snapshot(root) == before


# Case 8: a run or examples file densekit made was replaced by another command without --overwrite.


def test_a_run_another_command_made_is_replaced_only_with_overwrite(capsys, served, tmp_path: Path):
    data, index, model = served
    dense = tmp_path / "dense.trec"
    code, err, _ = cli(capsys, "search", model, index, data, "-o", dense, "--k", "3", "--device", "cpu",
                       "--no-progress")  # fmt: skip
    assert code == 0, err
    made = dense.read_bytes()
    code, err, _ = cli(capsys, "bm25", data, "-o", dense, "--no-progress")
    assert_refused(code, err, str(dense), "made by another command or settings", "--overwrite")
    assert dense.read_bytes() == made
    code, err, _ = cli(capsys, "bm25", data, "-o", dense, "--no-progress", "--overwrite")
    assert code == 0, err
    assert dense.read_text().split("\n")[0].endswith("bm25")
    assert cli(capsys, "bm25", data, "-o", dense, "--no-progress")[0] == 0  # the same settings again
    code, err, _ = cli(capsys, "bm25", data, "-o", dense, "--no-progress", "--k", "2")
    assert_refused(code, err, "differs in: settings.k", "--overwrite")


def test_pseudo_queries_rerun_with_another_seed_needs_overwrite(capsys, beir_dir: Path, tmp_path: Path):
    output = tmp_path / "pq.jsonl"
    command = ["pseudo-queries", beir_dir, "-o", output, "--words", "2-3"]
    assert cli(capsys, *command)[0] == 0
    made = output.read_bytes()
    assert cli(capsys, *command)[0] == 0  # the same settings may write it again
    code, err, _ = cli(capsys, *command, "--seed", "7")
    assert_refused(code, err, str(output), "pseudo_queries.seed", "--overwrite")
    assert output.read_bytes() == made
    assert cli(capsys, *command, "--seed", "7", "--overwrite")[0] == 0
    assert output.read_bytes() != made


def test_a_module_folder_of_other_weights_is_replaced_only_with_overwrite(capsys, modules, tmp_path: Path):
    _, root = modules
    average = ["modules", "average", root / "a", root / "b", "-o", tmp_path / "ab"]
    assert cli(capsys, *average, "--weights", "0.5,0.5")[0] == 0
    assert cli(capsys, *average, "--weights", "0.5,0.5")[0] == 0  # the same module again
    made = snapshot(tmp_path / "ab")
    code, err, _ = cli(capsys, *average, "--weights", "0.3,0.7")
    assert_refused(code, err, "differs in: module", "--overwrite")
    assert snapshot(tmp_path / "ab") == made
    assert cli(capsys, *average, "--weights", "0.3,0.7", "--overwrite")[0] == 0
    assert snapshot(tmp_path / "ab") != made


def test_every_command_that_writes_an_output_has_overwrite():
    from densekit.cli.main import app

    writers = {"output", "out", "json_file", "per_query", "plot", "json_output"}
    groups = [(app, ""), *((group.typer_instance, f"{group.name} ") for group in app.registered_groups)]
    missing = []
    for typer_app, prefix in groups:
        for command in typer_app.registered_commands:
            parameters = inspect.signature(command.callback).parameters
            name = prefix + (command.name or command.callback.__name__)
            if name == "ance-infer":  # it publishes into a training run's folder, never a path of its own
                continue
            if writers & set(parameters) and "overwrite" not in parameters:
                missing.append(name)
    assert missing == []


# Case 9: `search ROUTE --domain unknown` gave a KeyError traceback.


def test_searching_a_route_with_a_domain_it_does_not_route_lists_its_domains(
    capsys, modules, beir_dir: Path, tmp_path: Path
):
    from ..test_routing import base_index

    encoder, root = modules
    base_index(encoder, beir_dir, tmp_path)
    route = tmp_path / "route"
    command = ["modules", "route", root / "a", root / "b", "--domain", "x=a", "--domain", "y=b", "-o", route]
    assert cli(capsys, *command)[0] == 0
    assert cli(capsys, *command)[0] == 0  # the same route again needs no --overwrite
    assert_refused(*cli(capsys, *command[:-4], "-o", route)[:2], "differs in: route", "--overwrite")
    code, err, _ = cli(capsys, "search", route, tmp_path / "index", beir_dir, "--domain", "unknown",
                       "-o", tmp_path / "z.trec", "--device", "cpu", "--no-progress")  # fmt: skip
    assert_refused(code, err, "--domain 'unknown'", "x, y")
    assert not (tmp_path / "z.trec").exists()


# Case 10: `compare --trials 1000000000000` tried to allocate 14.6 TiB.


def judged_runs(folder: Path) -> list[Path]:
    """Judgements of two queries and two runs of them: qrels, first run, second run."""
    (folder / "qrels.tsv").write_text("q1\t0\td1\t1\nq2\t0\td2\t1\n")
    write_run(folder / "one.trec", {"q1": {"d1": 2.0, "d2": 1.0}, "q2": {"d1": 2.0, "d2": 1.0}})
    write_run(folder / "two.trec", {"q1": {"d2": 2.0, "d1": 1.0}, "q2": {"d2": 2.0, "d1": 1.0}})
    return [folder / "qrels.tsv", folder / "one.trec", folder / "two.trec"]


def test_options_that_size_an_allocation_are_bounded_naming_their_range(capsys, beir_dir: Path, tmp_path):
    from densekit.evaluation.significance import paired_test

    qrels, one, two = judged_runs(tmp_path)
    began = time.perf_counter()
    huge = "1000000000000"
    commands = [(["compare", qrels, one, two, "--trials", huge], "10000000"),
                (["bm25", beir_dir, "-o", tmp_path / "b.trec", "--k", huge], "100000"),
                (["diagnose-negatives", tmp_path / "x.jsonl", "m", "i", "--depth", huge], "100000"),
                ]  # fmt: skip
    for command, largest in commands:
        code, err, _ = cli(capsys, *command)
        assert code == 2 and f"Invalid value for '{command[-2]}'" in err, err
        assert f"equal to {largest} " in flat(err), err
    code, err, _ = cli(capsys, "mine", beir_dir, "-o", tmp_path / "m.jsonl", "--ranks", f"10-{huge}")
    assert code == 2 and f"--ranks 10-{huge}: give 1 <= first <= last <= 100000" in flat(err), err
    assert time.perf_counter() - began < 10
    with pytest.raises(ValueError, match=r"trials 1000000000000: from 1 to 10000000"):
        paired_test({"q": 0.0, "r": 1.0}, {"q": 1.0, "r": 0.5}, trials=10**12)


# Case 15: an ids line of only U+00A0 gave StopIteration (the counter and the reader stripped differently).


@pytest.mark.parametrize("blank", ["\u00a0", "\u2003\u3000", "  "])
def test_an_ids_line_of_whitespace_is_an_error_naming_the_file_and_line(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, blank: str
):
    from ..conftest import CORPUS

    ids = [d["_id"] for d in CORPUS]
    vectors = tmp_path / "v.npy"
    np.save(vectors, np.random.default_rng(0).standard_normal((len(ids), 32)).astype(np.float32))
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("\n".join([*ids[:3], blank, *ids[3:]]) + "\n", encoding="utf-8")
    code, err, _ = cli(capsys, "import-embeddings", tiny_st_model, beir_dir, vectors, "-o", tmp_path / "imp",
                       "--ids", ids_file, "--no-progress")  # fmt: skip
    assert_refused(code, err, f"{ids_file}:4:", "blank id")
    assert not (tmp_path / "imp").exists()


# Case 16: `pseudo-queries --per-document 100000000` held everything in memory.


def test_pseudo_queries_per_document_is_bounded_and_the_examples_are_streamed(
    capsys, beir_dir: Path, make_beir, tmp_path: Path
):
    import tracemalloc

    from densekit.data.dataset import Dataset
    from densekit.data.pseudo_queries import PseudoQuerySettings, write_pseudo_queries

    code, err, _ = cli(capsys, "pseudo-queries", beir_dir, "-o", tmp_path / "x.jsonl", "--per-document",
                       "100000000")  # fmt: skip
    assert code == 2 and "Invalid value for '--per-document'" in err and "equal to 1000 " in flat(err), err
    with pytest.raises(ValueError, match="less than or equal to 1000"):
        PseudoQuerySettings(per_document=1001)
    words = [f"word{i}" for i in range(40)]
    corpus = [{"_id": f"d{n}", "title": "", "text": " ".join(words[n:] + words[:n])} for n in range(20)]
    output = tmp_path / "pq.jsonl"
    settings = PseudoQuerySettings(per_document=1000, min_words=20, max_words=30)
    tracemalloc.start()
    write_pseudo_queries(Dataset.open(make_beir(corpus=corpus)), settings, output)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(output.read_text().splitlines()) == 20_000
    # the examples held in a list would take several times the file; streamed, a few buffers of it
    assert peak < output.stat().st_size / 2


# Case 20: `modules route --domain a=X --domain a=Y` kept one silently.


def test_modules_route_refuses_a_domain_given_twice(capsys, modules, tmp_path: Path):
    _, root = modules
    code, err, _ = cli(capsys, "modules", "route", root / "a", root / "b", "--domain", "x=a",
                       "--domain", "x=b", "-o", tmp_path / "route")  # fmt: skip
    assert_refused(code, err, "--domain x", "given twice")
    assert not (tmp_path / "route").exists()


# Case 27: `pseudo-queries DATA -o DATA/queries.jsonl` turned a collection's queries into training examples.


def test_no_output_is_written_into_a_collection_folder(capsys, beir_dir: Path, tmp_path: Path):
    before = snapshot(beir_dir)
    code, err, _ = cli(capsys, "pseudo-queries", beir_dir, "-o", beir_dir / "queries.jsonl")
    assert_refused(code, err, f"already exists inside {beir_dir}, an input")  # refused before as well
    for command, what in (
        (["pseudo-queries", beir_dir, "-o", beir_dir / "queries.test.tsv"], "queries.test.tsv is one of"),
        (["bm25", beir_dir, "-o", beir_dir / "qrels" / "bm25.trec", "--no-progress"], "one of its splits'"),
        (["fuse", beir_dir / "a.trec", beir_dir / "b.trec", "-o", beir_dir / "collection.tsv"], "collection"),
    ):
        code, err, _ = cli(capsys, *command)
        assert_refused(code, err, f"{beir_dir} is a collection folder and", what)
    assert snapshot(beir_dir) == before
    code, err, _ = cli(capsys, "bm25", beir_dir, "-o", tmp_path / "runs" / "bm25.trec", "--no-progress")
    assert code == 0, err


# Case 29 (pseudo-queries): option errors were pydantic dumps.


@pytest.mark.parametrize(
    ("options", "expected"),
    [(["--words", "10-2"], "--words 10-2: the shortest length is above the longest"),
     (["--method", "nope"], "--method 'nope': use span, title, lead or keywords"),
     (["--domain", ""], "--domain '': give a name of at least one character"),
     (["--method", "title", "--per-document", "2"], "--per-document 2: for span and keywords only")],
)  # fmt: skip
def test_pseudo_queries_option_errors_name_the_option(capsys, beir_dir: Path, tmp_path, options, expected):
    code, err, _ = cli(capsys, "pseudo-queries", beir_dir, "-o", tmp_path / "pq.jsonl", *options)
    assert code == 2 and err.strip() == f"error: {expected}", err


# Case 35: `fuse --weights 0,0` was accepted (every score 0).


def test_fusion_weights_must_leave_one_run_counting(capsys, tmp_path: Path):
    _, one, two = judged_runs(tmp_path)
    for weights in ("0,0", "-1,2", "nan,1", "inf,1"):
        code, err, _ = cli(capsys, "fuse", one, two, "--weights", weights, "-o", tmp_path / "f.trec")
        assert_refused(code, err, f"--weights {weights}", "at least one above 0")
    assert not (tmp_path / "f.trec").exists()
    runs = [read_run(p, Diagnostics()) for p in (one, two)]
    with pytest.raises(ValueError, match="at least one above 0"):
        fuse_runs(runs, "linear", [0.0, 0.0])
    recipe = {"steps": {"f": {"type": "fuse", "runs": [str(one), str(two)], "weights": [0, 0],
                              "output": "{out}/f.trec"}}}  # fmt: skip
    path = write_recipe(tmp_path / "r.yaml", yaml.safe_dump(recipe))
    with pytest.raises(DataError, match="at least one above 0"):
        load_recipe(path, tmp_path / "out", [])


# Our own attacks on recipes and configs.


@pytest.mark.parametrize("name", ["../../../../escaped", "a/b", "..", "1", "null", "a.b"])
def test_a_step_name_that_is_not_a_plain_word_is_refused(beir_dir: Path, tmp_path: Path, name: str):
    text = bm25_steps(beir_dir).replace("  bm25:", f"  {name}:" if name in ("1", "null") else f'  "{name}":')
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(DataError, match=r"r\.yaml:3: error: step name .* letters, digits, - and _"):
        run_recipe(path, tmp_path / "out", device="cpu", show_progress=False)
    assert not list(tmp_path.rglob("*.json"))  # no marker anywhere, inside the run or out of it


@pytest.mark.parametrize("step_type", ["[bm25]", "{name: bm25}", "null", "7"])
def test_a_step_type_that_is_not_a_name_is_refused_in_one_line(beir_dir: Path, tmp_path: Path, step_type):
    text = bm25_steps(beir_dir).replace("type: bm25", f"type: {step_type}")
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(DataError, match=r"r\.yaml:3: error: steps\.bm25: type must be one of mine, "):
        load_recipe(path, tmp_path / "out", [])


def test_a_placeholder_naming_its_own_section_is_a_loop_not_a_recursion_error(beir_dir: Path, tmp_path):
    text = 'x: {y: "{x}"}\n' + bm25_steps(beir_dir).replace("output:", 'split: "{x}", output:')
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(DataError, match=r"r\.yaml:4: error: steps\.bm25\.split\.y: placeholders refer"):
        load_recipe(path, tmp_path / "out", [])


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [("x: " + "[" * 5000 + "]" * 5000 + "\n", 1, "nested more than 100 deep"),
     ("x: &a [1]\n" + "".join(f"y{i}: &a{i} [*{'a' if i == 0 else f'a{i - 1}'}]\n" for i in range(150)),
      None, "aliases nest it more than 100 deep"),
     ("a: *a\n", 1, "found undefined alias"),
     ("x: !!python/object/apply:os.system [echo pwned]\n", 1, "could not determine a constructor"),
     ("steps:\n\tbm25: 1\n", 2, "found character '\\t' that cannot start any token"),
     ("a: 1\n---\nb: 2\n", 2, "expected a single document"),
     ('a: "\x00"\n', 1, "unacceptable character"),
     ("? [1, 2]\n: x\n", 1, "found unhashable key")],
)  # fmt: skip
def test_malformed_or_runaway_yaml_is_one_line_naming_the_file(capsys, tmp_path: Path, text, line, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    code, err, _ = cli(capsys, "run", path, "--out", tmp_path / "out")
    assert_refused(code, err, f"{path}:{line}:" if line else str(path), message)


@pytest.mark.parametrize(("raw", "line"), [(b"data: 1\nx: caf\xe9\n", 2), ("data: 1\n".encode("utf-16"), 1)])
def test_a_recipe_that_is_not_utf8_is_refused_naming_the_file_and_line(capsys, tmp_path: Path, raw, line):
    path = tmp_path / "r.yaml"
    path.write_bytes(raw)
    code, err, _ = cli(capsys, "run", path, "--out", tmp_path / "out")
    assert_refused(code, err, f"{path}:{line}:", "not valid UTF-8")


def test_a_recipe_larger_than_the_limit_is_refused_before_it_is_parsed(capsys, beir_dir: Path, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(bm25_steps(beir_dir) + "pad: '" + "x" * (2 << 20) + "'\n")
    began = time.perf_counter()
    code, err, _ = cli(capsys, "run", path, "--out", tmp_path / "out")
    assert time.perf_counter() - began < 2
    assert_refused(code, err, str(path), "larger than 1 MiB")


def test_a_recipe_section_named_out_is_refused(beir_dir: Path, tmp_path: Path):
    path = write_recipe(tmp_path / "r.yaml", "out: /somewhere/else\n" + bm25_steps(beir_dir))
    with pytest.raises(DataError, match=r"r\.yaml:1: error: out is the output folder \(--out\)"):
        load_recipe(path, tmp_path / "out", [])


@pytest.mark.parametrize(
    ("output", "message"),
    [("{out}", "is --out itself"), ("{out}/recipe.yaml", "the run's own record"),
     ("{out}/metrics.json", "the run's own record"), ("{out}/.steps/bm25.json", "the run's own record"),
     ("{out}/densekit-artefact.json", "the run's own record"),
     ("{out}/.b.trec.densekit.json", "a name densekit keeps for its manifests")],
)  # fmt: skip
def test_a_step_output_over_the_runs_own_files_is_refused(beir_dir: Path, tmp_path: Path, output, message):
    path = write_recipe(tmp_path / "r.yaml", bm25_steps(beir_dir).replace("{out}/b.trec", output))
    with pytest.raises(DataError, match=rf"steps\.bm25\.output: .*{message}"):
        load_recipe(path, tmp_path / "out", [])


def test_two_steps_writing_one_output_are_refused(beir_dir: Path, tmp_path: Path):
    text = bm25_steps(beir_dir) + '  again: {type: bm25, data: "{data.path}", k: 3, output: "{out}/b.trec"}\n'
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(DataError, match=r"steps\.again\.output: .*b\.trec is written by step bm25 too"):
        load_recipe(path, tmp_path / "out", [])


@pytest.mark.parametrize(
    ("override", "message"),
    [("data.path=&a [*a]", "command-line override data.path=&a [*a]: alias *a is inside the node it names"),
     ("data..path=1", "override 'data..path=1': an empty part in the key"),
     (".data=1", "override '.data=1': an empty part in the key")],
)  # fmt: skip
def test_a_hostile_override_is_refused_in_one_line(capsys, beir_dir: Path, tmp_path, override, message):
    path = write_recipe(tmp_path / "r.yaml", bm25_steps(beir_dir))
    code, err, _ = cli(capsys, "run", path, "--out", tmp_path / "out", override)
    assert_refused(code, err, message)
    code, err, _ = cli(capsys, "train", path, "--out", tmp_path / "out", override)
    assert_refused(code, err, message)


def test_a_steps_depth_is_bounded_like_the_commands(beir_dir: Path, tmp_path: Path):
    text = bm25_steps(beir_dir).replace("type: bm25", "type: bm25, k: 1000000000000000000000000")
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(DataError, match=r"steps\.bm25\.k: Input should be less than or equal to 100000"):
        load_recipe(path, tmp_path / "out", [])


def test_an_unreadable_marker_reruns_its_step_instead_of_failing_without_a_file(beir_dir: Path, tmp_path):
    path = write_recipe(tmp_path / "r.yaml", bm25_steps(beir_dir))
    out = tmp_path / "out"
    run_recipe(path, out, device="cpu", show_progress=False)
    (out / "b.trec").unlink()
    (out / ".steps" / "bm25.json").write_text("{not json")  # a marker damaged by hand
    run_recipe(path, out, device="cpu", show_progress=False)
    assert (out / "b.trec").is_file()  # the step ran again
    assert json.loads((out / ".steps" / "bm25.json").read_text())["seconds"] >= 0


def test_a_corpus_line_of_unicode_whitespace_is_counted_as_the_reader_skips_it(tmp_path: Path):
    from densekit.data.dataset import Dataset

    from ..conftest import CORPUS, write_beir

    root = write_beir(tmp_path / "data")
    lines = [json.dumps(d) for d in CORPUS]
    (root / "corpus.jsonl").write_text("\n".join([*lines[:2], "\u00a0\u2003", *lines[2:]]) + "\n")
    dataset = Dataset.open(root)
    assert dataset.count_documents() == len(list(dataset.iter_corpus())) == len(CORPUS)
