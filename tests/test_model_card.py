"""Model cards: the README.md of every saved model, module and route folder, written from the manifests."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from densekit.encoding.embed import embed_texts
from densekit.io.artefact import read_manifest, verify
from densekit.io.model_card import markdown_text
from densekit.models import DenseEncoder
from densekit.routing.route import Route
from densekit.routing.strategies import RouteSpec
from densekit.training.fine_tuning import run_training

from .test_modules import TEXTS, put_module
from .test_training import make_config


def card_of(folder: Path) -> tuple[dict, str]:
    """The card's YAML header, parsed, and its Markdown body."""
    text = (folder / "README.md").read_text()
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert match, f"{folder}/README.md has no YAML header"
    return yaml.safe_load(match.group(1)), match.group(2)


def snippets(body: str) -> dict[str, str]:
    """The Python snippet under each `### library` heading of the card's "Use it" section."""
    found = re.findall(r"^### (.+?)\n\n```python\n(.*?)```", body, re.S | re.M)
    return dict(found)


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
def trained(collection, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    run = tmp_path_factory.mktemp("card") / "run"
    config = make_config(
        collection, tiny_model, model={"normalize": True}, eval={"split": "test", "every": 3}
    )
    run_training(config, run, show_progress=False)
    return run


def test_a_trained_models_card_holds_its_base_inputs_settings_and_scores(trained: Path, tiny_model: Path):
    run, model = trained, trained / "model"
    header, body = card_of(model)
    manifest, run_manifest = read_manifest(model), read_manifest(run)
    assert header["library_name"] == "sentence-transformers"
    assert manifest.about["source"] == str(tiny_model)
    assert "base_model" not in header  # a local folder: the card names no path of this machine
    assert f"| base model | {markdown_text(os.path.relpath(tiny_model, run))} |" in body
    assert str(tiny_model) not in body.split("## Training")[0]  # the run's own record names its inputs
    assert {"densekit", "sentence-transformers"} <= set(header["tags"])
    assert f"| identity: weights | {manifest.identity['weights']} |" in body

    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval/nDCG@10" in r]
    metrics = header["model-index"][0]["results"]
    assert [(m["dataset"]["split"], m["metrics"][0]["type"], m["metrics"][0]["value"]) for m in metrics] == [
        ("test", "nDCG@10", evaluations[-1]["eval/nDCG@10"])
    ]
    for key, path in run_manifest.about["inputs"].items():
        assert f"| {key} | {markdown_text(path)} | {run_manifest.identity['inputs'][key]} |" in body
    examples = Path(run_manifest.about["inputs"]["data.train"])
    assert f"{len(examples.read_text().splitlines())} lines" in body
    assert "Made by `densekit train`" in body
    assert (run / "config.yaml").read_text().strip() in body
    assert json.dumps(manifest.identity["settings"]["pooling"]) in body

    best_header, _ = card_of(run / "best")  # the best model's scores: those of its own evaluation
    best = best_header["model-index"][0]["results"][0]["metrics"][0]
    step = int(best["name"].rsplit(" ", 1)[1])
    assert best["value"] == next(r["eval/nDCG@10"] for r in evaluations if r["step"] == step)
    assert best["value"] == max(r["eval/nDCG@10"] for r in evaluations)


def test_the_cards_snippets_load_the_model_in_densekit_and_sentence_transformers(trained: Path):
    model = trained / "model"
    code = snippets(card_of(model)[1])
    assert set(code) == {"densekit", "sentence-transformers"}
    ours = run_snippet(code["densekit"], model.parent)["encoder"]
    theirs = run_snippet(code["sentence-transformers"], model.parent)
    expected = embed_texts(DenseEncoder.load(model), ["a question"], "query")
    assert np.allclose(embed_texts(ours, ["a question"], "query"), expected, atol=1e-6)
    assert np.allclose(theirs["vectors"], expected, atol=1e-5)


def test_an_edited_card_leaves_the_folder_valid_and_a_users_readme_is_kept(tiny_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True)
    folder = tmp_path / "model"
    encoder.save(folder)
    (folder / "README.md").write_text((folder / "README.md").read_text() + "\nA line of my own.\n")
    verify(folder)
    DenseEncoder.load(folder)

    encoder.save(folder)  # a densekit card, edited but still marked as densekit's, is written again
    assert "A line of my own." not in (folder / "README.md").read_text()

    mine = "# My model\n\nWritten by hand.\n"
    (folder / "README.md").write_text(mine)
    encoder.save(folder)  # replaces the folder
    assert (folder / "README.md").read_text() == mine
    assert read_manifest(folder).kind == "model"


def test_module_and_route_folders_get_cards_whose_snippets_load_them(tiny_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for name in ("a", "b"):
        put_module(encoder, "query-lora", name, seed=ord(name))
        encoder.save(tmp_path / name)
    header, body = card_of(tmp_path / "a")
    description = json.loads((tmp_path / "a" / "densekit-module.json").read_text())
    assert header["library_name"] == "peft" and "base_model" not in header  # a local base
    assert f"| base model | {markdown_text(os.path.relpath(tiny_model, tmp_path))} |" in body
    assert {"densekit", "module", "lora", "peft"} <= set(header["tags"])
    assert description["base"]["fingerprint"] in body
    code = snippets(body)
    assert set(code) == {"densekit", "PEFT (query tower)"}
    loaded = run_snippet(code["densekit"], tmp_path)["encoder"]
    encoder.own = "a"
    assert np.allclose(embed_texts(loaded, TEXTS, "query"), embed_texts(encoder, TEXTS, "query"), atol=1e-6)
    peft_model = run_snippet(code["PEFT (query tower)"], tmp_path)["model"].eval()
    batch = encoder.pad(encoder.tokenize(TEXTS, "query"))
    with torch.no_grad():
        theirs = peft_model(**batch).last_hidden_state
        ours = encoder.module.query_tower(batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(theirs, ours, atol=1e-6)

    encoder.own = None
    route = Route(encoder, RouteSpec(type="fusion", modules=["a", "b"]))
    route.save(tmp_path / "route", {"a": tmp_path / "a", "b": tmp_path / "b"})
    header, body = card_of(tmp_path / "route")
    assert header["library_name"] == "densekit" and "base_model" not in header
    assert {"densekit", "route", "fusion"} <= set(header["tags"])
    assert "| module a | a |" in body and str(tmp_path) not in body  # the module's path from beside it
    routed = run_snippet(snippets(body)["densekit"], tmp_path)["vectors"]
    assert np.allclose(routed, route.encode_queries(["a question"]), atol=1e-6)
