"""Security of recipes and configs (issue 50, cases 3 and 4): YAML and placeholders are bounded before
they are expanded, and a recipe writes only inside --out unless the user lets it out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from densekit.recipes.runner import load_recipe

from .commands import assert_refused, cli

ROOT = Path(__file__).resolve().parents[2]


def bomb(levels: int = 9, width: int = 10) -> str:
    """A one-line YAML list whose nested aliases expand to width**levels strings."""
    items = [f"&l0 [{', '.join(['x'] * width)}]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(items)}]"


def bm25_recipe(data: Path, **sections: object) -> dict:
    """A one-step recipe (BM25 over `data`) with the extra top-level `sections`."""
    step = {"type": "bm25", "data": "{data.path}", "output": "{out}/bm25.trec", "k": 3}
    return {"data": {"path": str(data)}, **sections, "steps": {"bm25": step}}


# Case 3: a YAML alias bomb (10^9 strings from 40 lines) took gigabytes before anything failed.


@pytest.mark.parametrize("where", ["recipe", "training config", "override"])
def test_an_alias_bomb_is_refused_in_one_line_naming_where_it_is(capsys, beir_dir: Path, tmp_path, where):
    out = tmp_path / "out"
    if where == "recipe":
        path = tmp_path / "bomb.yaml"
        path.write_text(f"bomb: {bomb()}\n" + yaml.safe_dump(bm25_recipe(beir_dir)))
        command, named = ["run", path, "--out", out], str(path)
    elif where == "training config":
        path = tmp_path / "bomb.yaml"
        path.write_text(f"data: {{path: {beir_dir}, train: t.jsonl}}\nextra: {bomb()}\n")
        command, named = ["train", path, "--out", out], str(path)
    else:
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(bm25_recipe(beir_dir)))
        command, named = ["run", path, "--out", out, f"data.path={bomb()}"], "command-line override data.path"
    began = time.perf_counter()
    code, err, _ = cli(capsys, *command)
    assert time.perf_counter() - began < 10
    assert_refused(code, err, named, "aliases expand to more than 100000 values")
    assert not out.exists()


def test_placeholders_that_expand_exponentially_are_refused_naming_the_file_and_step(
    capsys, beir_dir: Path, tmp_path: Path
):
    words = {"p0": "x" * 10, **{f"p{i}": f"{{grow.p{i - 1}}}" * 10 for i in range(1, 10)}}
    lists = {"l0": ["x"] * 10, **{f"l{i}": [f"{{grow.l{i - 1}}}"] * 10 for i in range(1, 9)}}
    for section, placeholder in ((words, "{p9}"), (lists, "{l8}")):
        recipe = bm25_recipe(beir_dir, grow=section)
        recipe["steps"]["bm25"]["split"] = f"{{grow.{placeholder[1:-1]}}}"
        path = tmp_path / "grow.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        began = time.perf_counter()
        code, err, _ = cli(capsys, "run", path, "--out", tmp_path / "out")
        assert time.perf_counter() - began < 10
        assert_refused(code, err, str(path), "steps.bm25", "placeholders expand to more than 1000000")
        assert not (tmp_path / "out").exists()


# Case 4: "{out}/../../x.trec" and absolute paths were written.


@pytest.mark.parametrize("escape", ["parent", "absolute", "symlink"])
def test_a_step_output_outside_out_is_refused_before_any_step_runs_unless_allowed(
    capsys, beir_dir: Path, tmp_path: Path, escape: str
):
    out, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    target = {"parent": "{out}/../elsewhere/x.trec", "absolute": str(outside / "x.trec"),
              "symlink": "{out}/link/x.trec"}[escape]  # fmt: skip
    recipe = bm25_recipe(beir_dir)
    path = tmp_path / "r.yaml"
    if escape == "symlink":  # a link put into a run's folder, then a step appended that writes through it
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        assert cli(capsys, "run", path, "--out", out, "--device", "cpu", "--no-progress")[0] == 0
        (out / "bm25.trec").unlink()
        os.symlink(outside, out / "link")
    recipe["steps"]["escape"] = {"type": "bm25", "data": "{data.path}", "k": 2, "output": target}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    code, err, _ = cli(capsys, "run", path, "--out", out, "--device", "cpu", "--no-progress")
    assert_refused(code, err, "steps.escape.output", "outside --out", "--allow-outside-out")
    assert not (outside / "x.trec").exists() and not (out / "bm25.trec").exists()  # no step ran
    code, err, _ = cli(capsys, "run", path, "--out", out, "--device", "cpu", "--no-progress",
                       "--allow-outside-out")  # fmt: skip
    assert code == 0, err
    assert (outside / "x.trec").is_file()


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_writes_only_inside_out(path: Path, tmp_path: Path):
    one_collection = "path" in yaml.safe_load(path.read_text())["data"]
    override = "data.path=/data" if one_collection else "data.scifact=/data"
    out = tmp_path / "out"
    _, steps = load_recipe(path, out, [override])  # the rule holds, or this raises
    for name, step in steps.items():
        assert Path(step.output).resolve().is_relative_to(out.resolve()), name
