"""Recipes: steps run in order, finished steps are skipped, a killed run continues, overrides rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from densekit.data import DataError
from densekit.recipes import steps as steps_module
from densekit.recipes.runner import load_recipe, resolve, run_recipe

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
        def run(self, device, show_progress):
            ran.append(name)
            if name == "index" and getattr(tracking, "kill_index", False):
                raise KeyboardInterrupt("killed")
            return real_run[name](self, device, show_progress)

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
    with pytest.raises(DataError, match=r"steps\.a\.colour: Extra inputs are not permitted"):
        load_recipe(path, tmp_path, [])


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_validate(path: Path, tmp_path: Path):
    tree, steps = load_recipe(path, tmp_path, ["data.path=/data"])
    assert "nDCG@10" in tree["expected"]
    assert list(steps)[-1] == "evaluate"


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
