"""Recipes: steps run in order, finished steps are skipped, a killed run continues, overrides rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from densekit.data import DataError, Diagnostics
from densekit.data.trec import read_run, write_run
from densekit.io.outputs import OutputError
from densekit.recipes import steps as steps_module
from densekit.recipes.runner import check_steps_device, load_recipe, resolve, run_recipe

from .training_fixtures import write_training_collection

ROOT = Path(__file__).resolve().parents[1]


def tiny_recipe(path: Path, data: Path, model: Path) -> Path:
    recipe = {
        "description": "tiny two-step fine-tune",
        "data": {"path": str(data)},
        "model": {"path": str(model)},
        "steps": {
            "negatives": {"type": "mine", "data": "{data.path}", "output": "{out}/train.jsonl",
                          "settings": {"first_rank": 2, "last_rank": 20, "count": 3}},
            "round1": {"type": "train", "output": "{out}/round1", "config": {
                "model": {"path": "{model.path}", "pooling": "mean"},
                "data": {"path": "{data.path}", "train": "{out}/train.jsonl", "group_size": 2},
                "optim": {"batch_size": 4, "max_steps": 2}, "checkpoint": {"every": 1}}},
            "encode": {"type": "encode", "model": "{out}/round1/model", "data": "{data.path}",
                       "output": "{out}/emb"},
            "index": {"type": "index", "embeddings": "{out}/emb", "output": "{out}/index"},
            "search": {"type": "search", "model": "{out}/round1/model", "index": "{out}/index",
                       "data": "{data.path}", "output": "{out}/test.trec"},
            "evaluate": {"type": "evaluate", "data": "{data.path}", "run": "{out}/test.trec",
                         "output": "{out}/test.json"},
        },
    }  # fmt: skip
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_placeholders_keep_types_and_nest():
    context = {"a": {"b": 3, "c": "x{a.b}"}, "out": "/o"}
    assert resolve({"n": "{a.b}", "s": "{out}/{a.c}", "l": ["{a.b}"]}, context) == {
        "n": 3,
        "s": "/o/x3",
        "l": [3],
    }
    with pytest.raises(ValueError, match=r"unknown placeholder \{a.z\}"):
        resolve("{a.z}", context)


def test_recipe_runs_skips_resumes_and_reruns(tmp_path: Path, tiny_st_model: Path, monkeypatch):
    data, _ = write_training_collection(tmp_path / "data")
    recipe = tiny_recipe(tmp_path / "r.yaml", data, tiny_st_model)
    out = tmp_path / "out"

    ran: list[str] = []
    real_run = {name: cls.run for name, cls in steps_module.STEP_TYPES.items()}

    def tracking(name):
        def run(self, device, show_progress, overwrite):
            ran.append(name)
            if name == "index" and getattr(tracking, "kill_index", False):
                raise KeyboardInterrupt("killed")
            return real_run[name](self, device, show_progress, overwrite)

        return run

    for name, cls in steps_module.STEP_TYPES.items():
        monkeypatch.setattr(cls, "run", tracking(name))

    tracking.kill_index = True
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe, out, device="cpu", show_progress=False)
    assert ran == ["mine", "train", "encode", "index"]

    ran.clear()
    tracking.kill_index = False
    metrics = run_recipe(recipe, out, device="cpu", show_progress=False)
    assert ran == ["index", "search", "evaluate"]  # the finished steps were skipped
    assert set(metrics) == {"nDCG@10", "RR@10", "R@100", "R@1000", "AP"}
    assert json.loads((out / "metrics.json").read_text()) == metrics

    ran.clear()
    assert run_recipe(recipe, out, device="cpu", show_progress=False) == metrics
    assert ran == []

    # a marker written by another version of densekit, its keys in another order, still counts as done
    marker = out / ".steps" / "round1.json"
    record = json.loads(marker.read_text())
    parameters = yaml.safe_load(record["parameters"])
    record["parameters"] = yaml.safe_dump(dict(reversed(parameters.items())), sort_keys=False)
    marker.write_text(json.dumps(record))
    index_marker = out / ".steps" / "index.json"
    record = json.loads(index_marker.read_text())
    assert "backend" not in yaml.safe_load(record["parameters"])  # recorded only when set
    record["parameters"] += "backend: null\n"  # as densekit wrote it for a while
    index_marker.write_text(json.dumps(record))
    assert run_recipe(recipe, out, device="cpu", show_progress=False) == metrics
    assert ran == []

    ran.clear()
    run_recipe(recipe, out, ["steps.round1.config.optim.max_steps=3"], device="cpu", show_progress=False)
    assert ran == ["train", "encode", "index", "search", "evaluate"]
    steps = [
        json.loads(line)["step"] for line in (out / "round1" / "train_log.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 3


def test_unknown_step_type_and_bad_parameters_are_named(tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text("steps:\n  a:\n    type: fly\n")
    with pytest.raises(DataError, match=r"steps\.a: type must be one of"):
        load_recipe(path, tmp_path, [])
    path.write_text("steps:\n  a:\n    type: index\n    embeddings: x\n    output: y\n    colour: red\n")
    with pytest.raises(DataError, match=r"r.yaml:6: error: steps\.a\.colour: Extra inputs are not permitted"):
        load_recipe(path, tmp_path, [])
    path.write_text("steps:\n  a:\n    type: table\n    benchmarks: {base: b}\n    output: t.json\n")
    with pytest.raises(DataError, match=r"r.yaml:5: error: steps\.a\.output: .*t\.json would be both"):
        load_recipe(path, tmp_path, [])


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_validate(path: Path, tmp_path: Path):
    one_collection = "path" in yaml.safe_load(path.read_text())["data"]
    override = "data.path=/data" if one_collection else "data.scifact=/data"
    tree, steps = load_recipe(path, tmp_path, [override])
    assert "nDCG@10" in tree["expected"]
    assert list(steps.values())[-1].type == "evaluate"  # its scores are the run's metrics.json


@pytest.mark.parametrize("recipe", ["scifact-lora", "nfcorpus-lora"])
def test_the_module_recipes_train_any_kind_given_on_the_command_line(recipe: str, tmp_path: Path):
    path = ROOT / "recipes" / f"{recipe}.yaml"
    adapter = "module={type: adapter, name: d, bottleneck: 8}"
    _, steps = load_recipe(path, tmp_path, ["data.path=/data", adapter])
    for round_ in ("round1", "round2"):
        assert steps[round_].config["modules"] == {"type": "adapter", "name": "d", "bottleneck": 8}
    with pytest.raises(DataError, match=r"modules\.lora\.rnk: Extra inputs are not permitted"):
        load_recipe(path, tmp_path, ["data.path=/data", "module={type: lora, name: d, rnk: 4}"])


def test_a_train_steps_config_is_checked_before_anything_runs(tmp_path: Path):
    path = tmp_path / "r.yaml"
    recipe = {"steps": {
        "first": {"type": "bm25", "data": "/d", "output": "{out}/bm25.trec"},
        "train": {"type": "train", "output": "{out}/ft", "config": {"data": {"path": "/d", "train": "/t"},
                                                                   "optim": {"batchsize": 3}}},
    }}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(
        DataError, match=r"steps\.train\.config\.optim\.batchsize: Extra inputs are not permitted"
    ):
        load_recipe(path, tmp_path, [])
    with pytest.raises(DataError) as raised:
        load_recipe(path, tmp_path, ["steps.train.config.optim.lr=1"])
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "batchsize" in text)
    assert str(raised.value).splitlines() == [
        f"{path}:{line}: error: steps.train.config.optim.batchsize: Extra inputs are not permitted",
        "command-line override steps.train.config.optim.lr=1: Extra inputs are not permitted",
    ]


def test_a_step_the_device_cannot_run_is_refused_before_any_step_runs(beir_dir: Path, tmp_path: Path):
    path = tmp_path / "r.yaml"
    recipe = {"steps": {
        "first": {"type": "bm25", "data": str(beir_dir), "output": "{out}/bm25.trec"},
        "train": {"type": "train", "output": "{out}/ft", "config": {"data": {"path": "/d", "train": "/t"},
                                                                   "optim": {"precision": "fp16"}}},
        "rerank": {"type": "rerank", "model": "/m", "run": "{out}/bm25.trec", "data": str(beir_dir),
                   "output": "{out}/reranked.trec", "precision": "fp16"},
        "search": {"type": "search", "model": "/m", "index": "/i", "data": str(beir_dir),
                   "output": "{out}/dense.trec", "precision": "int8"},
    }}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(DataError) as raised:
        run_recipe(path, tmp_path / "out", device="cpu", show_progress=False)
    lines = {name: n for n, text in enumerate(path.read_text().splitlines(), 1)
             for name in recipe["steps"] if text == f"  {name}:"}  # fmt: skip
    assert str(raised.value).splitlines() == [
        f"{path}:{lines['train']}: error: steps.train: fp16 needs a GPU; use bf16 or float32 on the CPU",
        f"{path}:{lines['rerank']}: error: steps.rerank: fp16 needs a GPU; use bf16 or float32 on the CPU",
        f"{path}:{lines['search']}: error: steps.search: --precision int8 runs through ONNX Runtime or "
        "OpenVINO: add --backend onnx or --backend openvino",
    ]
    assert not (tmp_path / "out").exists()
    del recipe["steps"]["search"]
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    overrides = ["steps.train.config.optim.precision=bf16", "steps.rerank.precision=bf16"]
    _, steps = load_recipe(path, tmp_path / "out", overrides)
    check_steps_device(path, steps, "cpu")  # bf16 runs on a CPU: nothing left to refuse


def bm25_recipe(path: Path, data: Path) -> Path:
    recipe = {"data": {"path": str(data)}, "steps": {
        "bm25": {"type": "bm25", "data": "{data.path}", "output": "{out}/bm25.trec"},
        "evaluate": {"type": "evaluate", "data": "{data.path}", "run": "{out}/bm25.trec",
                     "output": "{out}/bm25.json", "measures": ["nDCG@10"]},
    }}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_a_changed_step_output_never_removes_what_densekit_did_not_make(beir_dir: Path, tmp_path: Path):
    recipe, out = bm25_recipe(tmp_path / "r.yaml", beir_dir), tmp_path / "out"
    run_recipe(recipe, out, device="cpu", show_progress=False)
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "chapter1.tex").write_text("years of work")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for target, reason in ((thesis, "is a folder"), (notes, "densekit did not write it")):
        with pytest.raises(OutputError, match=reason):  # outside --out: let out, then refused all the same
            run_recipe(recipe, out, [f"steps.bm25.output={target}"], device="cpu", show_progress=False,
                       allow_outside_out=True)  # fmt: skip
    assert (thesis / "chapter1.tex").read_text() == "years of work" and notes.read_text() == "mine"
    # the step's own earlier output is replaced when its parameters change
    run_recipe(recipe, out, ["steps.bm25.k=2"], device="cpu", show_progress=False)
    assert max(len(r) for r in read_run(out / "bm25.trec", Diagnostics()).values()) == 2


def test_data_changed_in_place_reruns_the_steps_that_read_it(beir_dir: Path, tmp_path: Path):
    recipe, out = bm25_recipe(tmp_path / "r.yaml", beir_dir), tmp_path / "out"
    first = run_recipe(recipe, out, device="cpu", show_progress=False)
    qrels = beir_dir / "qrels" / "test.tsv"
    run = read_run(out / "bm25.trec", Diagnostics())
    top = {q: next(iter(ranked)) for q, ranked in run.items()}
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in top.items()))
    second = run_recipe(recipe, out, device="cpu", show_progress=False)
    assert second["nDCG@10"] == pytest.approx(1.0) and first["nDCG@10"] < 1.0  # scored again, not stale
    assert json.loads((out / "metrics.json").read_text()) == second


def test_an_override_naming_no_key_of_the_recipe_is_refused(beir_dir: Path, tmp_path: Path):
    recipe, out = bm25_recipe(tmp_path / "r.yaml", beir_dir), tmp_path / "out"
    with pytest.raises(ValueError, match=r"override 'data.pth=/x': r.yaml has no key 'data.pth' \(its keys: "
                                         r"data\.path\)"):  # fmt: skip
        run_recipe(recipe, out, ["data.pth=/x"], device="cpu", show_progress=False)
    with pytest.raises(ValueError, match=r"has no step 'steps.bm52'"):
        run_recipe(recipe, out, ["steps.bm52.k=3"], device="cpu", show_progress=False)
    with pytest.raises(DataError, match=r"command-line override steps\.bm25\.kk=3: Extra inputs are not"):
        run_recipe(recipe, out, ["steps.bm25.kk=3"], device="cpu", show_progress=False)
    assert not out.exists()  # refused before anything was written


def test_a_run_continues_under_its_recipe_with_steps_added_at_the_end(
    beir_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    recipe, out = bm25_recipe(tmp_path / "r.yaml", beir_dir), tmp_path / "out"
    run_recipe(recipe, out, device="cpu", show_progress=False)
    made = (out / "bm25.trec").stat().st_mtime_ns
    tree = yaml.safe_load(recipe.read_text())
    tree["steps"]["deeper"] = {"type": "bm25", "data": str(beir_dir), "k": 2, "output": "{out}/deeper.trec"}
    longer = tmp_path / "longer.yaml"
    longer.write_text(yaml.safe_dump(tree, sort_keys=False))
    with caplog.at_level("INFO", logger="densekit"):
        run_recipe(longer, out, device="cpu", show_progress=False)
    assert "adds steps after the 2 of the run" in caplog.text and "step bm25: already done" in caplog.text
    assert (out / "bm25.trec").stat().st_mtime_ns == made and (out / "deeper.trec").is_file()
    with pytest.raises(OutputError, match=r"differs in: steps.deeper"):  # removing a step is another recipe
        run_recipe(recipe, out, device="cpu", show_progress=False)
    del tree["steps"]["bm25"]  # so is a step added before the others (here with one gone)
    tree["steps"] = {"first": {**tree["steps"]["deeper"], "output": "{out}/first.trec"}, **tree["steps"]}
    reordered = tmp_path / "reordered.yaml"
    reordered.write_text(yaml.safe_dump(tree, sort_keys=False))
    with pytest.raises(OutputError, match=r"differs in: steps"):
        run_recipe(reordered, out, device="cpu", show_progress=False)


def test_a_folder_of_another_recipe_is_refused(beir_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    run_recipe(bm25_recipe(tmp_path / "r.yaml", beir_dir), out, device="cpu", show_progress=False)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"steps": {"only": {"type": "bm25", "data": str(beir_dir),
                                                         "output": "{out}/x.trec"}}}))  # fmt: skip
    with pytest.raises(OutputError, match=r"differs in: steps.bm25, steps.evaluate, steps.only"):
        run_recipe(other, out, device="cpu", show_progress=False)
    run_recipe(other, out, device="cpu", show_progress=False, overwrite=True)
    shown = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert shown == ["densekit-artefact.json", "recipe.yaml", "timings.json", "x.trec"]  # bm25.* went


def test_a_fuse_step_writes_the_fused_run_and_a_setting_of_the_other_method_is_refused_at_load(
    tmp_path: Path,
):
    first, second = {"q": {"a": 9.0, "b": 5.0, "c": 1.0}}, {"q": {"c": 0.9, "d": 0.7, "a": 0.1}}
    write_run(tmp_path / "first.trec", first)
    write_run(tmp_path / "second.trec", second)
    runs = [str(tmp_path / "first.trec"), str(tmp_path / "second.trec")]
    recipe = {"steps": {"fuse": {"type": "fuse", "runs": runs, "weights": [1.0, 2.0], "k": 60,
                                 "output": "{out}/fused.trec"}}}  # fmt: skip
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_recipe(path, tmp_path / "out", device="cpu", show_progress=False)
    fused = read_run(tmp_path / "out" / "fused.trec", Diagnostics())
    assert fused["q"] == pytest.approx({"a": 1 / 61 + 2 / 63, "b": 1 / 62, "c": 1 / 63 + 2 / 61, "d": 2 / 62})
    assert list(fused["q"]) == ["c", "a", "d", "b"]
    with pytest.raises(DataError, match="normalisation is for the linear method"):
        run_recipe(path, tmp_path / "other", ["steps.fuse.normalisation=zscore"], device="cpu",
                   show_progress=False)  # fmt: skip
    assert not (tmp_path / "other").exists()


def test_the_distill_recipe_goes_on_training_the_module_of_a_module_run(tmp_path: Path):
    path = ROOT / "recipes" / "scifact-distill.yaml"
    _, full = load_recipe(path, tmp_path, ["data.path=/data"])
    assert full["distil"].config["modules"] is None
    module = "distil.module={type: lora, name: scifact, rank: 8}"
    _, steps = load_recipe(path, tmp_path, ["data.path=/data", module, "two_round.out=/runs/lora"])
    assert steps["distil"].config["modules"] == {"type": "lora", "name": "scifact", "rank": 8}
    assert steps["distil"].config["model"]["path"] == "/runs/lora/round2/model"


def test_settings_added_later_leave_the_records_of_steps_that_leave_them_unset_as_they_were():
    """A finished step's record (and a training run's config) made before `backend` and `matryoshka`
    existed reads the same now, so the step stays done; set, each is recorded."""
    from densekit.configuration import dump_config
    from densekit.training.config import LossSection

    plain = steps_module.describe(steps_module.IndexStep(type="index", embeddings="e", output="o"))
    assert "backend" not in yaml.safe_load(plain)
    named = steps_module.IndexStep(type="index", embeddings="e", output="o", backend="faiss")
    assert yaml.safe_load(steps_module.describe(named))["backend"] == "faiss"
    assert "matryoshka" not in yaml.safe_load(dump_config(LossSection()))
    trained = LossSection(matryoshka={"dims": [8, 4]})
    assert yaml.safe_load(dump_config(trained))["matryoshka"]["dims"] == [8, 4]
