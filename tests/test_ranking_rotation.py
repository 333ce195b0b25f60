"""`densekit rotate --fit ranking`: a rotation turned from the principal directions so that cut vectors
rank as full-width ones do. It stays orthogonal (full-width scores unchanged), its cut vectors rank a
collection whose principal direction ranks nothing closer to full width than the principal directions
do, it is seeded, and a recipe's step makes the command's model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import yaml
from typer.testing import CliRunner

from densekit.cli import app
from densekit.diagnostics import DataError
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.errors import InputError
from densekit.models import DenseEncoder
from densekit.models.dimensions import truncated
from densekit.models.ranking_rotation import NEIGHBOURS, _nearest, fit_ranking_rotation
from densekit.models.rotation import fit_rotation
from densekit.recipes.runner import load_recipe, run_recipe

from .conftest import write_beir

runner = CliRunner()
WORDS = [
    "cat",
    "dog",
    "wolf",
    "stock",
    "market",
    "bond",
    "river",
    "lake",
    "volcano",
    "lava",
    "whale",
    "shark",
    "python",
    "code",
    "tea",
    "coffee",
]


CORPUS_SPREAD = np.linspace(1.0, 0.5, 24)
QUERY_SPREAD = CORPUS_SPREAD * np.r_[np.full(4, 0.5), np.full(4, 2.0), np.ones(16)]


def unit_vectors(rows: int, spread: np.ndarray, seed: int) -> np.ndarray:
    """Unit vectors in 24 dimensions, each drawn with the standard deviations `spread`."""
    vectors = np.random.default_rng(seed).normal(size=(rows, 24)) * spread
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def top_overlap(anchors: np.ndarray, corpus: np.ndarray, matrix: np.ndarray, width: int) -> float:
    """The mean share of each anchor's full-width top 10 that its vectors cut to `width` also rank there."""
    full = np.argsort(-(anchors @ corpus.T), axis=1)[:, :10]
    cut_a, cut_c = truncated(anchors @ matrix, width, True), truncated(corpus @ matrix, width, True)
    cut = np.argsort(-(cut_a @ cut_c.T), axis=1)[:, :10]
    return float(np.mean([len(set(f) & set(c)) / 10 for f, c in zip(full, cut, strict=True)]))


def test_a_ranking_fit_stays_orthogonal_and_cuts_rank_closer_to_full_width_than_the_variance_order():
    # the corpus varies most along its first 4 dimensions, the queries weigh the next 4: the principal
    # directions keep the first 4 at a cut to 4, which rank less of what the queries' full width ranks
    corpus = unit_vectors(800, CORPUS_SPREAD, seed=0)
    anchors, unseen = unit_vectors(300, QUERY_SPREAD, seed=1), unit_vectors(200, QUERY_SPREAD, seed=2)
    start = fit_rotation([corpus], 24).matrix
    fit = fit_ranking_rotation(start, anchors, corpus, [4], normalise=True, seed=0)
    assert np.allclose(fit.matrix.T @ fit.matrix, np.eye(24), atol=1e-5)
    assert fit.steps > 0 and fit.loss < fit.start_loss
    # on queries the fit never saw
    assert top_overlap(unseen, corpus, fit.matrix, 4) > top_overlap(unseen, corpus, start, 4) + 0.05
    short = [
        fit_ranking_rotation(start, anchors, corpus, [4], True, seed, max_steps=50) for seed in (0, 0, 1)
    ]
    assert np.array_equal(short[0].matrix, short[1].matrix)
    assert not np.array_equal(short[0].matrix, short[2].matrix)


def test_corpus_anchors_leave_themselves_out_of_their_candidates():
    corpus = torch.from_numpy(unit_vectors(300, CORPUS_SPREAD, seed=0))
    rows = np.arange(0, 300, 3)
    assert (_nearest(corpus[rows], corpus, None)[:, 0] == torch.from_numpy(rows)).all()
    found = _nearest(corpus[rows], corpus, rows)
    assert not (found == torch.from_numpy(rows)[:, None]).any()
    assert found.shape == (len(rows), NEIGHBOURS)


@pytest.mark.parametrize(
    ("widths", "anchors", "corpus", "message"),
    [
        ([24], 100, 200, "below the 24 dimensions"),
        ([4], 10, 200, "at least 20"),
        ([4], 100, 50, "more than 64"),
    ],
    ids=["width", "anchors", "corpus"],
)
def test_a_ranking_fit_refuses_what_it_cannot_fit(widths: list[int], anchors: int, corpus: int, message: str):
    vectors = unit_vectors(max(anchors, corpus), CORPUS_SPREAD, seed=0)
    with pytest.raises(InputError, match=message):
        fit_ranking_rotation(np.eye(24), vectors[:anchors], vectors[:corpus], widths, True, 0)


@pytest.fixture(scope="module")
def collection(tiny_st_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A collection of 120 documents and 40 judged train queries, and its corpus embeddings by the tiny
    model."""
    work = tmp_path_factory.mktemp("ranking-rotate")
    rng = np.random.default_rng(0)
    corpus = [{"_id": f"d{i}", "title": "", "text": " ".join(rng.choice(WORDS, 6))} for i in range(120)]
    queries = [{"_id": f"q{i}", "text": " ".join(rng.choice(WORDS, 3))} for i in range(40)]
    qrels = {"train": [(f"q{i}", f"d{i}", 1) for i in range(40)]}
    data = write_beir(work / "beir", corpus, queries, qrels)
    result = runner.invoke(
        app, ["encode", str(tiny_st_model), str(data), "-o", str(work / "emb"), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    return data, work / "emb"


def rotate(*args: object) -> None:
    result = runner.invoke(app, ["rotate", *map(str, args)], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_a_ranking_rotated_model_scores_every_pair_as_its_base_and_cuts_as_it_was_fitted(
    tiny_st_model: Path, collection: tuple[Path, Path], tmp_path: Path
):
    data, embeddings = collection
    rotate(tiny_st_model, embeddings, "-o", tmp_path / "ranked", "--fit", "ranking", "--queries", data,
           "--width", 16, "--width", 8)  # fmt: skip
    rotate(tiny_st_model, embeddings, "-o", tmp_path / "variance")
    base, ranked = DenseEncoder.load(tiny_st_model), DenseEncoder.load(tmp_path / "ranked")
    texts = [q["text"] for q in map(json.loads, (data / "queries.jsonl").read_text().splitlines())]
    before_q, after_q = embed_texts(base, texts, "query"), embed_texts(ranked, texts, "query")
    corpus = EmbeddingStore.open(embeddings).vectors()
    turned = embed_texts(ranked, texts[:5], "passage")
    assert np.allclose(before_q @ before_q.T, after_q @ after_q.T, atol=1e-5)
    assert np.allclose(embed_texts(base, texts[:5], "passage") @ before_q.T, turned @ after_q.T, atol=1e-5)
    variance = DenseEncoder.load(tmp_path / "variance")
    assert not np.allclose(embed_texts(variance, texts, "query"), after_q, atol=1e-3)
    cut = embed_texts(DenseEncoder.load(tmp_path / "ranked", dimensions=8), texts, "query")
    assert np.allclose(cut, truncated(after_q, 8, True), atol=1e-6)
    assert json.loads((tmp_path / "ranked" / "densekit.json").read_text())["variance_ordered"] is True
    assert corpus.shape[1] == 32


def test_rotate_refuses_ranking_settings_without_a_ranking_fit_and_widths_it_cannot_cut(
    tiny_st_model: Path, collection: tuple[Path, Path], tmp_path: Path
):
    data, embeddings = collection
    for arguments, message in (
        (["--width", "8"], "--width shapes a ranking fit"),
        (["--queries", data], "queries anchor a ranking fit"),
        (["--fit", "ranking"], "none is below the model's 32 dimensions"),
        (["--fit", "ranking", "--width", "8", "--width", "64"], "below the 32 dimensions"),
        (["--fit", "ranking", "--width", "8", "--sample", 300_000], "at most 200,000"),
    ):
        result = runner.invoke(app, ["rotate", str(tiny_st_model), str(embeddings), "-o", str(tmp_path / "r"),
                                     *map(str, arguments)])  # fmt: skip
        assert result.exit_code != 0 and message in str(result.exception), (arguments, result.output)
        assert not (tmp_path / "r").exists()
    before = sorted(path.name for path in data.iterdir())
    result = runner.invoke(app, ["rotate", str(tiny_st_model), str(embeddings), "-o", str(data), "--fit",
                                 "ranking", "--width", "8", "--queries", str(data)])  # fmt: skip
    assert result.exit_code != 0 and "is an input of this command" in str(result.exception)
    assert sorted(path.name for path in data.iterdir()) == before


def test_a_recipes_ranking_rotate_step_makes_the_commands_model(
    tiny_st_model: Path, collection: tuple[Path, Path], tmp_path: Path
):
    data, embeddings = collection
    rotate(tiny_st_model, embeddings, "-o", tmp_path / "by-command", "--fit", "ranking", "--queries", data,
           "--width", 8)  # fmt: skip
    recipe = tmp_path / "recipe.yaml"
    step = {"type": "rotate", "model": str(tiny_st_model), "embeddings": str(embeddings),
            "output": "{out}/rotated", "fit": "ranking", "queries": str(data), "widths": [8]}  # fmt: skip
    recipe.write_text(yaml.safe_dump({"steps": {"rotate": step}}))
    run_recipe(recipe, tmp_path / "out", device="cpu", show_progress=False)
    ours = safetensors.torch.load_file(tmp_path / "out" / "rotated" / "2_Dense" / "model.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "by-command" / "2_Dense" / "model.safetensors")
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


@pytest.mark.parametrize("setting", [{"widths": [8]}, {"queries": "/data"}], ids=["widths", "queries"])
def test_a_recipes_rotate_step_refuses_widths_without_a_ranking_fit(tmp_path: Path, setting: dict):
    recipe = tmp_path / "recipe.yaml"
    step = {"type": "rotate", "model": "m", "embeddings": "e", "output": "{out}/r", **setting}
    recipe.write_text(yaml.safe_dump({"steps": {"rotate": step}}))
    name = next(iter(setting))
    with pytest.raises(DataError, match=rf"recipe\.yaml:\d+: .*{name} shape a ranking fit"):
        load_recipe(recipe, tmp_path / "out", [])
