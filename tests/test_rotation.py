"""`densekit rotate` and the Dense module after pooling: a rotated model scores every pair as its base
at full width, its first dimensions keep the most of the corpus's vectors, sentence-transformers loads
it to the same vectors (cut or not), a sentence-transformers Dense module is applied as
sentence-transformers applies it, and hostile Dense folders and mismatched inputs are refused."""

from __future__ import annotations

import json
import logging
import shutil
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
from densekit.models import DenseEncoder
from densekit.models.dimensions import truncated
from densekit.models.rotation import fit_rotation
from densekit.recipes.runner import load_recipe, run_recipe

from .conftest import write_beir

runner = CliRunner()
TEXTS = ["how do cats hunt", "a volcano erupts", "the stock market fell", "python reads well", "whales"]


def cli(*args: object) -> None:
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def rotated(tiny_st_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny sentence-transformers model's corpus embeddings, the model rotated by them, and the
    collection."""
    work = tmp_path_factory.mktemp("rotate")
    data = write_beir(work / "beir")
    cli("encode", tiny_st_model, data, "-o", work / "embeddings", "--no-progress")
    cli("rotate", tiny_st_model, work / "embeddings", "-o", work / "rotated")
    return work / "embeddings", work / "rotated", data


def test_a_rotated_model_scores_every_pair_as_its_base_and_orders_its_dimensions(
    tiny_st_model: Path, rotated: tuple[Path, Path, Path]
):
    embeddings, model, _ = rotated
    base, turned = DenseEncoder.load(tiny_st_model), DenseEncoder.load(model)
    for side in ("query", "passage"):
        before, after = embed_texts(base, TEXTS, side), embed_texts(turned, TEXTS, side)
        assert not np.allclose(before, after, atol=1e-3)  # the vectors are turned...
        assert np.allclose(before @ before.T, after @ after.T, atol=1e-5)  # ...every inner product kept
    queries, passages = embed_texts(base, TEXTS, "query"), embed_texts(base, TEXTS, "passage")
    turned_q, turned_p = embed_texts(turned, TEXTS, "query"), embed_texts(turned, TEXTS, "passage")
    assert np.allclose(queries @ passages.T, turned_q @ turned_p.T, atol=1e-5)

    # the corpus it was fitted on: each rotated dimension holds no more than the one before it, and
    # the first N hold more of the vectors' squared length than the base's first N
    corpus = EmbeddingStore.open(embeddings).vectors()
    rotation = fit_rotation([corpus], corpus.shape[1])
    turned_corpus = corpus @ rotation.matrix
    energy = (turned_corpus**2).sum(axis=0)
    assert np.all(np.diff(energy) <= 1e-4)
    for width in (4, 8, 16):
        assert energy[:width].sum() > (corpus[:, :width] ** 2).sum()
        assert rotation.kept(width) == pytest.approx(energy[:width].sum() / energy.sum(), abs=1e-5)
    assert np.allclose(embed_texts(turned, TEXTS, "passage"), passages @ rotation.matrix, atol=1e-5)

    saved = json.loads((model / "densekit.json").read_text())
    assert saved["variance_ordered"] is True
    assert "ordered by `densekit rotate`" in (model / "README.md").read_text()


def test_a_rotated_models_cut_vectors_need_no_matryoshka_training_and_warn_of_nothing(
    rotated: tuple[Path, Path, Path], caplog
):
    _, model, _ = rotated
    full = embed_texts(DenseEncoder.load(model), TEXTS, "query")
    with caplog.at_level(logging.WARNING, logger="densekit"):
        cut = embed_texts(DenseEncoder.load(model, dimensions=8), TEXTS, "query")
    assert not caplog.records
    assert np.allclose(cut, truncated(full, 8, True), atol=1e-6)


def test_sentence_transformers_loads_a_rotated_model_to_the_same_vectors(rotated: tuple[Path, Path, Path]):
    from sentence_transformers import SentenceTransformer

    _, model, _ = rotated
    modules = json.loads((model / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Dense", "Normalize"]
    ours = embed_texts(DenseEncoder.load(model), TEXTS, "passage")
    theirs = SentenceTransformer(str(model), device="cpu").encode(TEXTS, prompt_name="document")
    assert np.allclose(ours, theirs, atol=1e-5)
    ours_cut = embed_texts(DenseEncoder.load(model, dimensions=8), TEXTS, "passage")
    st_cut = SentenceTransformer(str(model), device="cpu", truncate_dim=8)
    theirs_cut = st_cut.encode(TEXTS, prompt_name="document", normalize_embeddings=True)
    assert np.allclose(ours_cut, theirs_cut, atol=1e-5)


def test_a_sentence_transformers_dense_module_is_applied_as_sentence_transformers_applies_it(
    tiny_st_model: Path, tmp_path: Path
):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(0)
    transformer = Transformer(str(tiny_st_model), max_seq_length=48)
    pooling = Pooling(32, pooling_mode="mean")
    st = SentenceTransformer(modules=[transformer, pooling, Dense(32, 12), Normalize()], device="cpu")  # tanh
    st.save(str(tmp_path / "dense"))
    theirs = st.encode(TEXTS)
    encoder = DenseEncoder.load(tmp_path / "dense")
    assert encoder.width == 12 and encoder.hidden_size == 32
    assert np.allclose(embed_texts(encoder, TEXTS, "passage"), theirs, atol=1e-5)
    # saved again by densekit, sentence-transformers and densekit still give the same
    encoder.save(tmp_path / "again")
    again = SentenceTransformer(str(tmp_path / "again"), device="cpu").encode(TEXTS)
    assert np.allclose(again, theirs, atol=1e-5)
    assert np.allclose(
        embed_texts(DenseEncoder.load(tmp_path / "again"), TEXTS, "passage"), theirs, atol=1e-5
    )


def dense_folder(tiny_st_model: Path, tmp_path: Path, config: dict, tensors: dict | None = None) -> Path:
    """The tiny model with a Dense module of `config` and `tensors` between pooling and normalising."""
    path = tmp_path / "model"
    shutil.copytree(tiny_st_model, path)
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "2_Dense").mkdir()
    (path / "2_Dense" / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        safetensors.torch.save_file(tensors, str(path / "2_Dense" / "model.safetensors"))
    return path


GOOD = {
    "in_features": 32,
    "out_features": 8,
    "bias": False,
    "activation_function": "torch.nn.modules.linear.Identity",
}


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        (
            {**GOOD, "activation_function": "os.system"},
            {"linear.weight": torch.zeros(8, 32)},
            "activation_function 'os.system' is not supported",
        ),
        (
            {**GOOD, "in_features": 16},
            {"linear.weight": torch.zeros(8, 16)},
            "in_features 16: the transformer before it makes 32-wide vectors",
        ),
        ({**GOOD, "out_features": 10**9}, None, "out_features 1000000000: expected a whole number from 1 to"),
        (GOOD, None, "missing: a Dense module's weights (its pytorch_model.bin is a pickle"),
        (
            GOOD,
            {"linear.weight": torch.zeros(8, 30)},
            "wrong shapes: linear.weight (8, 30) (expected (8, 32))",
        ),
        (GOOD, {"linear.weight": torch.full((8, 32), float("nan"))}, "linear.weight: expected finite"),
        (GOOD, {"linear.weight": torch.zeros(8, 32), "extra": torch.zeros(1)}, "holds tensors ['extra', "),
    ],
)
def test_a_hostile_dense_module_is_refused_in_one_line_naming_its_file(
    tiny_st_model: Path, tmp_path: Path, config: dict, tensors: dict | None, message: str
):
    path = dense_folder(tiny_st_model, tmp_path, config, tensors)
    if tensors is None:
        torch.save({}, path / "2_Dense" / "pytorch_model.bin")  # a pickle, never to be loaded
    with pytest.raises(DataError) as raised:
        DenseEncoder.load(path)
    assert message in str(raised.value)
    assert str(path / "2_Dense") in str(raised.value) and "\n" not in str(raised.value).strip()


def test_a_dense_module_after_the_normalisation_is_refused(tiny_st_model: Path, tmp_path: Path):
    path = dense_folder(tiny_st_model, tmp_path, GOOD, {"linear.weight": torch.zeros(8, 32)})
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([modules[0], modules[1], modules[3], modules[2]]))
    with pytest.raises(DataError, match="after the pooling and before any normalisation"):
        DenseEncoder.load(path)


def test_rotate_refuses_another_models_embeddings_cut_ones_and_its_inputs_as_output(
    tiny_st_model: Path, tiny_model: Path, rotated: tuple[Path, Path, Path], tmp_path: Path
):
    embeddings, model, data = rotated
    for arguments, message in (
        ([tiny_model, embeddings, "-o", tmp_path / "a"], "from passages encoded with other settings"),
        ([model, embeddings, "-o", tmp_path / "b"], "from the embeddings of other model weights"),
        ([tiny_st_model, embeddings, "-o", embeddings], "is an input of this command"),
    ):
        result = runner.invoke(app, ["rotate", *map(str, arguments)])
        assert result.exit_code != 0 and message in str(result.exception), result.output
    cli("encode", tiny_st_model, data, "-o", tmp_path / "cut", "--dimensions", "8", "--no-progress")
    result = runner.invoke(
        app, ["rotate", str(tiny_st_model), str(tmp_path / "cut"), "-o", str(tmp_path / "c")]
    )
    assert "holds 8-dimensional vectors" in str(result.exception)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_an_index_of_the_base_is_not_searched_with_the_rotated_model(
    rotated: tuple[Path, Path, Path], tmp_path: Path
):
    embeddings, model, data = rotated
    cli("index", embeddings, "-o", tmp_path / "index", "--no-progress")
    result = runner.invoke(app, ["search", str(model), str(tmp_path / "index"), str(data), "-o",
                                 str(tmp_path / "run.trec"), "--no-progress"])  # fmt: skip
    assert result.exit_code != 0 and "other model weights" in str(result.exception)


def test_a_module_on_a_rotated_model_leaves_the_rotation_frozen_and_merges_with_it(
    rotated: tuple[Path, Path, Path],
):
    from densekit.models.modules.kinds.lora import LoraSpec

    _, model, _ = rotated
    encoder = DenseEncoder.load(model)
    before = encoder.base_fingerprint()
    encoder.new_module(LoraSpec(name="lora", rank=2, alpha=4, dropout=0.0))
    assert not any(p.requires_grad for p in encoder.projection.parameters())
    assert encoder.base_fingerprint() == before
    # merged into the base, the module's vectors keep the rotation
    from densekit.models.merge import merged_encoder

    with_module = embed_texts(encoder, TEXTS, "query", module="lora")
    assert np.allclose(embed_texts(merged_encoder(encoder, "lora"), TEXTS, "query"), with_module, atol=1e-5)


def test_onnx_runtime_runs_the_rotation_as_pytorch_does(rotated: tuple[Path, Path, Path]):
    from densekit.encoding.runtimes import use_backend

    _, model, _ = rotated
    expected = embed_texts(DenseEncoder.load(model), TEXTS, "query")
    encoder = DenseEncoder.load(model)
    use_backend(encoder, "onnx", "float32")
    assert np.allclose(embed_texts(encoder, TEXTS, "query"), expected, atol=1e-4)


def test_a_recipes_rotate_step_makes_the_commands_model_and_reruns_only_when_its_inputs_change(
    tiny_st_model: Path, rotated: tuple[Path, Path, Path], tmp_path: Path
):
    embeddings, by_command, data = rotated
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"steps": {
        "encode": {"type": "encode", "model": str(tiny_st_model), "data": str(data), "output": "{out}/emb"},
        "rotate": {"type": "rotate", "model": str(tiny_st_model), "embeddings": "{out}/emb",
                   "output": "{out}/rotated"},
        "encode-rotated": {"type": "encode", "model": "{out}/rotated", "data": str(data),
                           "output": "{out}/rotated-emb"},
    }}, sort_keys=False))  # fmt: skip
    out = tmp_path / "out"
    run_recipe(recipe, out, device="cpu", show_progress=False)
    ours = safetensors.torch.load_file(out / "rotated" / "2_Dense" / "model.safetensors")
    theirs = safetensors.torch.load_file(by_command / "2_Dense" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert json.loads((out / "rotated" / "densekit.json").read_text())["variance_ordered"] is True
    rotated_vectors = EmbeddingStore.open(out / "rotated-emb").vectors()
    fitted = fit_rotation([EmbeddingStore.open(embeddings).vectors()], rotated_vectors.shape[1])
    assert np.allclose(rotated_vectors, EmbeddingStore.open(embeddings).vectors() @ fitted.matrix, atol=1e-5)

    made = (out / "rotated" / "2_Dense" / "model.safetensors").stat().st_mtime_ns
    run_recipe(recipe, out, device="cpu", show_progress=False)  # done: skipped
    assert (out / "rotated" / "2_Dense" / "model.safetensors").stat().st_mtime_ns == made
    run_recipe(recipe, out, ["steps.rotate.sample=3"], device="cpu", show_progress=False)  # another fit
    assert not torch.equal(
        safetensors.torch.load_file(out / "rotated" / "2_Dense" / "model.safetensors")[next(iter(ours))],
        ours[next(iter(ours))],
    )


@pytest.mark.parametrize("setting", [{"sample": 10**9}, {"seed": -1}], ids=["sample", "seed"])
def test_a_recipes_rotate_step_refuses_a_sample_or_seed_out_of_bounds(tmp_path: Path, setting: dict):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"steps": {"rotate": {
        "type": "rotate", "model": "m", "embeddings": "e", "output": "{out}/r", **setting}}}))
    with pytest.raises(DataError, match=rf"r(ecipe)?\.yaml:\d+: .*steps\.rotate\.{next(iter(setting))}"):
        load_recipe(recipe, tmp_path / "out", [])


def test_rotate_refuses_a_negative_seed_in_one_line(tiny_st_model: Path, rotated: tuple[Path, Path, Path],
                                                   tmp_path: Path):  # fmt: skip
    result = runner.invoke(app, ["rotate", str(tiny_st_model), str(rotated[0]), "-o", str(tmp_path / "r"),
                                 "--seed", "-1"])  # fmt: skip
    assert result.exit_code != 0 and "--seed" in result.output and not (tmp_path / "r").exists()


def test_rotating_again_on_another_sample_needs_overwrite_and_then_replaces_the_model(
    tiny_st_model: Path, rotated: tuple[Path, Path, Path], tmp_path: Path
):
    embeddings, _, _ = rotated
    cli("rotate", tiny_st_model, embeddings, "-o", tmp_path / "rotated")
    cli("rotate", tiny_st_model, embeddings, "-o", tmp_path / "rotated")  # the same fit again
    first = (tmp_path / "rotated" / "2_Dense" / "model.safetensors").read_bytes()
    other = ["rotate", str(tiny_st_model), str(embeddings), "-o", str(tmp_path / "rotated"), "--sample", "3"]
    refused = runner.invoke(app, other)
    assert refused.exit_code != 0 and "pass --overwrite to replace it" in str(refused.exception)
    cli(*other, "--overwrite")
    assert (tmp_path / "rotated" / "2_Dense" / "model.safetensors").read_bytes() != first
