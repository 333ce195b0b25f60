"""Matryoshka training (`loss.matryoshka`) and `--dimensions`: the loss on cut vectors against the plain
loss and against an encoder that cuts its own, gradient caching against the full batch, what a trained
model records and how densekit and sentence-transformers cut its vectors, and artefacts of other widths
never mixed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import yaml
from typer.testing import CliRunner

from densekit.cli import app
from densekit.configuration import load_config
from densekit.data import Dataset
from densekit.data.examples import read_examples
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.io.artefact import read_file_manifest, read_manifest
from densekit.models import DenseEncoder
from densekit.models.dimensions import DimensionsError, truncated
from densekit.models.rotation import fit_rotation, put_rotation
from densekit.recipes.runner import load_recipe, run_recipe
from densekit.training.config import TrainConfig
from densekit.training.contrastive import ContrastiveTask, score_alignment_loss
from densekit.training.fine_tuning import run_training

from .processes import run_in_processes
from .test_distillation import scored  # noqa: F401  (a fixture)
from .test_modules import KINDS
from .test_training import (
    _free_port,
    _one_step_worker,
    final_weights,
    gradients,
    killed_at_step_five,
    make_config,
    make_task,
    max_difference,
)

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "question about cats and kittens",
    "bread flour and an oven",
    "a volcano",
    "the moon orbits a planet",
]
WIDTHS = {"dims": [32, 16, 8], "weights": [1.0, 0.5, 0.25]}  # the tiny BERT is 32 wide
runner = CliRunner()


def normalised(config: dict | None = None) -> dict:
    return {"model": {"normalize": True, **(config or {})}}


def matryoshka_config(collection, model: Path, widths: dict | None = None, **sections) -> TrainConfig:
    loss = {**sections.pop("loss", {}), "matryoshka": widths or WIDTHS}
    return make_config(collection, model, loss=loss, **normalised(), **sections)


@pytest.fixture(scope="module")
def trained(collection, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of three steps of Matryoshka training for 32, 16 and 8 dimensions."""
    output = tmp_path_factory.mktemp("matryoshka") / "run"
    config = matryoshka_config(collection, tiny_model, optim={"max_steps": 3, "learning_rate": 1e-2})
    run_training(config, output, show_progress=False)
    return output


# --- the loss --------------------------------------------------------------------------------------


def test_matryoshka_at_the_full_width_alone_is_the_plain_loss(collection, still_model: Path):
    plain = make_task(make_config(collection, still_model, optim={"batch_size": 8}, **normalised()))
    full = make_task(matryoshka_config(collection, still_model, {"dims": [32]}, optim={"batch_size": 8}))
    plain_loss = plain.forward_backward(plain.batch(1, 0))["loss"]
    full_loss = full.forward_backward(full.batch(1, 0))["loss"]
    assert abs(plain_loss - full_loss) < 1e-10
    assert max_difference(gradients(plain.encoder), gradients(full.encoder)) < 1e-10


def figures(result: dict) -> dict[str, float]:
    """A step's figures read as numbers (the trainer leaves them on the device until its log line)."""
    return {name: float(value) for name, value in result.items()}


def cutting_task(collection, model: Path, dimensions: int) -> ContrastiveTask:
    """A plain (not Matryoshka) task whose encoder cuts its own vectors to `dimensions`."""
    config = make_config(collection, model, optim={"batch_size": 8}, **normalised())
    encoder = DenseEncoder.load(model, pooling="mean", normalize=True, dimensions=dimensions)
    texts = {doc.id: doc.full_text for doc in Dataset.open(config.data.path).iter_corpus()}
    return ContrastiveTask(encoder.to(torch.float64), read_examples(Path(config.data.train)), texts, config)


def test_the_loss_is_the_weighted_sum_of_the_losses_of_encoders_cutting_to_each_width(
    collection, still_model: Path
):
    """Each width's term is the plain loss of an encoder that cuts its vectors to that width itself
    (pooled, cut, then normalised), so training cuts vectors as `--dimensions` does."""
    matryoshka = make_task(matryoshka_config(collection, still_model, optim={"batch_size": 8}))
    result = figures(matryoshka.forward_backward(matryoshka.batch(1, 0)))
    expected_loss, expected_gradients = 0.0, None
    for width, weight in zip(WIDTHS["dims"], WIDTHS["weights"], strict=True):
        task = cutting_task(collection, still_model, width)
        loss = float(task.forward_backward(task.batch(1, 0))["loss"])
        assert result[f"loss_{width}d"] == pytest.approx(loss, abs=1e-10)
        expected_loss += weight * loss
        scaled = {name: weight * grad for name, grad in gradients(task.encoder).items()}
        expected_gradients = scaled if expected_gradients is None else {
            name: expected_gradients[name] + grad for name, grad in scaled.items()
        }  # fmt: skip
    assert result["loss"] == pytest.approx(expected_loss, abs=1e-10)
    assert max_difference(gradients(matryoshka.encoder), expected_gradients) < 1e-10
    smallest = cutting_task(collection, still_model, 8)
    smallest.forward_backward(smallest.batch(1, 0))
    assert max_difference(gradients(smallest.encoder), expected_gradients) > 1e-4  # the widths differ


ALIGNED = {**WIDTHS, "score_alignment": 0.7}


def widest_kl(task: ContrastiveTask, batch, detached: bool = True) -> torch.Tensor:
    """The sum over the narrower widths of their weight times F.kl_div from the widest width's
    in-batch score distribution to theirs, each a softmax over every passage of the batch (the false
    negatives left out by giving them a score far below any other)."""
    queries = task._encode("query")(batch.queries)[0]
    passages = task._encode("passage")(batch.passages)[0]
    rows = []
    for width in WIDTHS["dims"]:
        scores = truncated(queries, width, True) @ truncated(passages, width, True).T / task.temperature
        rows.append(scores.masked_fill(batch.false_negatives, -1e4))
    teacher = F.log_softmax(rows[0].detach() if detached else rows[0], dim=1)
    return sum(
        weight * F.kl_div(F.log_softmax(student, dim=1), teacher, log_target=True, reduction="batchmean")
        for student, weight in zip(rows[1:], WIDTHS["weights"][1:], strict=True)
    )


def test_score_alignment_adds_each_narrower_widths_kl_from_the_widest_held_fixed(
    collection, still_model: Path
):
    plain = make_task(matryoshka_config(collection, still_model, optim={"batch_size": 8}))
    aligned = make_task(matryoshka_config(collection, still_model, ALIGNED, optim={"batch_size": 8}))
    batch = aligned.batch(1, 0)
    assert batch.false_negatives.any()  # left out of both softmaxes
    plain_result = figures(plain.forward_backward(plain.batch(1, 0)))
    aligned_result = figures(aligned.forward_backward(batch))
    reference = make_task(matryoshka_config(collection, still_model, optim={"batch_size": 8}))
    kl = widest_kl(reference, reference.batch(1, 0))
    assert float(kl) > 1e-3
    assert aligned_result["loss"] == pytest.approx(plain_result["loss"] + 0.7 * float(kl), abs=1e-10)
    assert aligned_result["loss_alignment"] == pytest.approx(float(kl), abs=1e-10)
    assert aligned_result["loss_32d"] == pytest.approx(plain_result["loss_32d"], abs=1e-10)
    (0.7 * kl).backward()
    expected = {
        name: grad + gradients(plain.encoder)[name] for name, grad in gradients(reference.encoder).items()
    }
    assert max_difference(gradients(aligned.encoder), expected) < 1e-10
    # the widest width is the teacher only: its scores get no gradient from the alignment
    flowing = make_task(matryoshka_config(collection, still_model, optim={"batch_size": 8}))
    (0.7 * widest_kl(flowing, flowing.batch(1, 0), detached=False)).backward()
    assert max_difference(gradients(flowing.encoder), gradients(reference.encoder)) > 1e-6


def test_score_alignment_leaves_out_what_it_is_told_to():
    teacher = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 1.0]], dtype=torch.float64)
    left_out = torch.tensor([[False, False, True, False], [False, False, False, True]])
    assert float(score_alignment_loss(teacher, teacher, left_out)) == 0.0
    student = teacher.clone()
    student[0, 2], student[1, 3] = 50.0, -50.0  # only left-out entries changed
    assert float(score_alignment_loss(student, teacher, left_out)) == 0.0
    student[0, 1] = 1.5
    assert float(score_alignment_loss(student, teacher, left_out)) > 0.0


@pytest.mark.parametrize("widths", [WIDTHS, ALIGNED], ids=["plain", "aligned"])
def test_grad_cache_with_matryoshka_equals_the_full_batch(collection, still_model: Path, widths: dict):
    plain = make_task(matryoshka_config(collection, still_model, widths, optim={"batch_size": 8}))
    cached = make_task(
        matryoshka_config(collection, still_model, widths, optim={"batch_size": 8},
                          grad_cache={"enabled": True, "chunk_size": 3})
    )  # fmt: skip
    plain_result = figures(plain.forward_backward(plain.batch(1, 0)))
    cached_result = cached.forward_backward(cached.batch(1, 0))
    aligned = {"loss_alignment"} if "score_alignment" in widths else set()
    assert set(plain_result) == {"loss", "loss_contrastive", "loss_32d", "loss_16d", "loss_8d", *aligned}
    for key, value in plain_result.items():
        assert abs(value - cached_result[key]) < 1e-10
    assert max_difference(gradients(plain.encoder), gradients(cached.encoder)) < 1e-10


def test_grad_cache_with_matryoshka_and_distillation_equals_the_full_batch(scored, still_model: Path):  # noqa: F811
    loss = {"distillation": "kl", "distillation_weight": 0.7, "contrastive_weight": 0.5}
    plain = make_task(matryoshka_config(scored, still_model, optim={"batch_size": 8}, loss=loss))
    cached = make_task(
        matryoshka_config(scored, still_model, optim={"batch_size": 8}, loss=loss,
                          grad_cache={"enabled": True, "chunk_size": 3})
    )  # fmt: skip
    plain_result = figures(plain.forward_backward(plain.batch(1, 0)))
    cached_result = cached.forward_backward(cached.batch(1, 0))
    for key in ("loss", "loss_contrastive", "loss_distillation", "loss_8d"):
        assert abs(plain_result[key] - cached_result[key]) < 1e-10
    widths = sum(
        w * plain_result[f"loss_{d}d"] for d, w in zip(WIDTHS["dims"], WIDTHS["weights"], strict=True)
    )
    assert plain_result["loss"] == pytest.approx(widths)
    assert max_difference(gradients(plain.encoder), gradients(cached.encoder)) < 1e-10


@pytest.mark.parametrize("widths", [WIDTHS, ALIGNED], ids=["plain", "aligned"])
def test_two_processes_train_matryoshka_like_one(collection, still_model: Path, tmp_path: Path, widths: dict):
    config = matryoshka_config(collection, still_model, widths, optim={"batch_size": 8})
    single = make_task(config)
    single_loss = single.forward_backward(single.batch(0, 0))["loss"]
    run_in_processes(_one_step_worker, (2, _free_port(), config.model_dump_json(), str(tmp_path / "g")))
    two = safetensors.torch.load_file(str(tmp_path / "g"))
    assert abs(json.loads((tmp_path / "g.json").read_text())["loss"] - single_loss) < 1e-10
    assert max_difference(two, gradients(single.encoder)) < 1e-10


# --- the config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matryoshka", "line", "message"),
    [
        ("{dims: [16, 32]}", 5, r"loss\.matryoshka\.dims: .*widest first"),
        ("{dims: [32, 16, 0]}", 5, r"loss\.matryoshka\.dims\.2: Input should be greater than or equal to 1"),
        ("{dims: []}", 5, r"loss\.matryoshka\.dims: List should have at least 1 item"),
        ("{dims: [32, 16], weights: [1]}", 5, r"loss\.matryoshka: .*1 given for 2 dims"),
        ("{dims: [32], score_alignment: 1}", 5, r"loss\.matryoshka: .*score_alignment .*at least two dims"),
        (
            "{dims: [32, 16], score_alignment: -1}",
            5,
            r"loss\.matryoshka\.score_alignment: Input should be greater than or equal to 0",
        ),
        (
            "{dims: [32, 16], score_alignment: .inf}",
            5,
            r"loss\.matryoshka\.score_alignment: Input should be a finite",
        ),
        (
            "{dims: [32, 16], weights: [.inf, 1]}",
            5,
            r"loss\.matryoshka\.weights\.0: Input should be a finite",
        ),
        (
            "{dims: [32, 16], weights: [1, 0]}",
            5,
            r"loss\.matryoshka\.weights\.1: Input should be greater than 0",
        ),
    ],
)
def test_a_bad_matryoshka_option_is_refused_naming_the_file_and_line(
    tmp_path: Path, matryoshka: str, line: int, message: str
):
    path = tmp_path / "train.yaml"
    path.write_text(f"data:\n  path: d\n  train: t.jsonl\nloss:\n  matryoshka: {matryoshka}\n")
    with pytest.raises(Exception, match=rf"train\.yaml:{line}: error: {message}") as raised:
        load_config(path, TrainConfig)
    assert len(str(raised.value).splitlines()) == 1


def test_widths_above_the_models_are_refused_before_training(collection, tiny_model: Path):
    config = matryoshka_config(collection, tiny_model, {"dims": [64, 32]})
    with pytest.raises(ValueError, match=r"loss\.matryoshka\.dims: 64 is more than the 32 dimensions"):
        make_task(config)


def test_matryoshka_is_refused_with_a_route(collection, tiny_model: Path):
    route = {"modules": {"a": "a", "b": "b"}}
    with pytest.raises(Exception, match=r"loss\.matryoshka with route"):
        matryoshka_config(collection, tiny_model, route=route)


def test_the_recipe_takes_the_option_as_an_override(tmp_path: Path):
    overrides = [
        "data.path=/data",
        "steps.round1.config.loss.matryoshka.dims=[384,256,128,64]",
        "steps.round2.config.loss.matryoshka={dims: [384, 256, 128, 64], weights: [1, 1, 1, 1]}",
    ]
    _, steps = load_recipe(ROOT / "recipes" / "scifact-two-round.yaml", tmp_path, overrides)
    for name in ("round1", "round2"):
        assert steps[name].validated().loss.matryoshka.dims == [384, 256, 128, 64]


# --- what a trained model records, and its cut vectors ------------------------------------------------


def test_a_matryoshka_models_cut_vectors_are_its_full_ones_cut_and_normalised_again(trained: Path):
    model = trained / "model"
    assert json.loads((model / "densekit.json").read_text())["matryoshka_dims"] == [32, 16, 8]
    full = embed_texts(DenseEncoder.load(model), TEXTS, "query")
    for width in (16, 8):
        cut = embed_texts(DenseEncoder.load(model, dimensions=width), TEXTS, "query")
        assert cut.shape == (len(TEXTS), width)
        expected = full[:, :width] / np.linalg.norm(full[:, :width], axis=1, keepdims=True)
        assert np.allclose(cut, expected, atol=1e-6)
        assert np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
    assert "matryoshka" in (model / "README.md").read_text()


def test_sentence_transformers_loads_it_with_truncate_dim_to_the_same_vectors(trained: Path, tmp_path: Path):
    from sentence_transformers import SentenceTransformer

    model = trained / "model"
    ours = embed_texts(DenseEncoder.load(model, dimensions=16), TEXTS, "passage")
    st = SentenceTransformer(str(model), device="cpu", truncate_dim=16)
    theirs = st.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    assert theirs.shape == (len(TEXTS), 16)
    assert np.allclose(ours, theirs, atol=1e-5)
    # a model saved cut to 16 says so to sentence-transformers (truncate_dim) and to densekit
    DenseEncoder.load(model, dimensions=16).save(tmp_path / "cut")
    saved = json.loads((tmp_path / "cut" / "config_sentence_transformers.json").read_text())
    assert saved["truncate_dim"] == 16
    assert DenseEncoder.load(tmp_path / "cut").dimension == 16
    plain_st = SentenceTransformer(str(tmp_path / "cut"), device="cpu")
    assert np.allclose(plain_st.encode(TEXTS, normalize_embeddings=True), ours, atol=1e-5)


def test_a_run_without_the_option_records_no_widths_whatever_its_start_was_trained_for(
    collection, trained: Path, tmp_path: Path
):
    config = make_config(collection, trained / "model", optim={"max_steps": 1}, **normalised())
    run_training(config, tmp_path / "run", show_progress=False)
    assert "matryoshka_dims" not in json.loads((tmp_path / "run" / "model" / "densekit.json").read_text())
    assert DenseEncoder.load(tmp_path / "run" / "model").config.matryoshka_dims is None


def test_a_run_from_a_rotated_model_no_longer_records_its_dimensions_ordered(
    collection, tiny_model: Path, tmp_path: Path
):
    encoder = DenseEncoder.load(tiny_model)
    vectors = embed_texts(encoder, TEXTS, "passage")
    put_rotation(encoder, fit_rotation([vectors], encoder.width))
    encoder.save(tmp_path / "rotated")
    assert DenseEncoder.load(tmp_path / "rotated").config.variance_ordered
    config = make_config(collection, tmp_path / "rotated", optim={"max_steps": 1}, **normalised())
    run_training(config, tmp_path / "run", show_progress=False)
    assert not DenseEncoder.load(tmp_path / "run" / "model").config.variance_ordered
    assert "ordered" not in (tmp_path / "run" / "model" / "README.md").read_text()


def test_a_distillation_run_with_matryoshka_saves_its_widths(scored, tiny_model: Path, tmp_path: Path):  # noqa: F811
    config = matryoshka_config(
        scored, tiny_model, loss={"distillation": "margin_mse"}, optim={"max_steps": 2}
    )
    run_training(config, tmp_path / "run", show_progress=False)
    assert DenseEncoder.load(tmp_path / "run" / "model").config.matryoshka_dims == [32, 16, 8]
    records = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert {"loss_contrastive", "loss_distillation", "loss_32d", "loss_16d", "loss_8d"} <= set(records[0])


def test_a_lora_module_run_with_matryoshka_saves_its_widths_and_loads_cut(
    collection, tiny_model: Path, tmp_path: Path
):
    config = matryoshka_config(
        collection, tiny_model, modules=dict(KINDS["lora"]), optim={"max_steps": 2, "learning_rate": 1e-2}
    )
    run_training(config, tmp_path / "run", show_progress=False)
    module = tmp_path / "run" / "model"
    settings = json.loads((module / "densekit-module.json").read_text())["settings"]
    assert settings["matryoshka_dims"] == [32, 16, 8]
    full = DenseEncoder.load(module)
    assert full.own == "module" and full.config.matryoshka_dims == [32, 16, 8]
    cut = DenseEncoder.load(module, dimensions=8)
    queries = embed_texts(full, TEXTS, "query")[:, :8]
    assert np.allclose(embed_texts(cut, TEXTS, "query"), queries / np.linalg.norm(queries, axis=1)[:, None],
                       atol=1e-6)  # fmt: skip
    with pytest.raises(
        DimensionsError, match=r"--dimensions 12: .* was trained \(Matryoshka\) for 32, 16, 8"
    ):
        DenseEncoder.load(module, dimensions=12)


def test_a_killed_matryoshka_run_resumes_to_the_same_weights(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch
):
    config = matryoshka_config(collection, tiny_model)
    run_training(config, tmp_path / "straight", show_progress=False)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
    assert run_training(config, tmp_path / "resumed", resume=True, show_progress=False)["step"] == 6
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


# --- --dimensions ----------------------------------------------------------------------------------


def test_a_width_above_the_models_is_refused_in_one_line(tiny_st_model: Path, beir_dir: Path, tmp_path: Path):
    result = runner.invoke(app, ["encode", str(tiny_st_model), str(beir_dir), "-o", str(tmp_path / "e"),
                                 "--dimensions", "64", "--no-progress"])  # fmt: skip
    assert isinstance(result.exception, DimensionsError)
    assert str(result.exception) == (
        f"--dimensions 64: {tiny_st_model} makes 32-dimensional vectors; choose 32 or fewer"
    )
    assert not (tmp_path / "e").exists()


def test_a_narrower_width_of_a_model_recording_none_is_warned_of(tiny_st_model: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="densekit"):
        encoder = DenseEncoder.load(tiny_st_model, dimensions=8)
    assert encoder.dimension == 8 and encoder.width == 32
    warned = [r.getMessage() for r in caplog.records if "--dimensions 8" in r.getMessage()]
    assert len(warned) == 1 and "records no Matryoshka training" in warned[0]
    assert "\n" not in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="densekit"):
        assert DenseEncoder.load(tiny_st_model, dimensions=32).config.dimensions is None  # its own width
    assert not caplog.records


def test_a_width_the_model_was_not_trained_for_is_refused(trained: Path):
    with pytest.raises(DimensionsError, match=r"^--dimensions 24: .* trained \(Matryoshka\) for 32, 16, 8 "):
        DenseEncoder.load(trained / "model", dimensions=24)


def cli(*args: object) -> None:
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_embeddings_indexes_and_runs_of_other_widths_are_never_mixed(
    trained: Path, beir_dir: Path, tmp_path: Path
):
    model = trained / "model"
    full, cut = tmp_path / "full", tmp_path / "cut"
    cli("encode", model, beir_dir, "-o", full, "--no-progress")
    cli("encode", model, beir_dir, "-o", cut, "--dimensions", "16", "--no-progress")
    cut_vectors, full_vectors = EmbeddingStore.open(cut).vectors(), EmbeddingStore.open(full).vectors()
    assert cut_vectors.shape[1] == 16
    assert read_manifest(cut).identity["model"]["settings"]["dimensions"] == 16
    assert "dimensions" not in read_manifest(full).identity["model"]["settings"]
    assert np.allclose(cut_vectors, truncated(full_vectors, 16, True), atol=1e-6)

    # the embeddings of another width are not taken for these: refused, not reused or appended to
    result = runner.invoke(app, ["encode", str(model), str(beir_dir), "-o", str(full), "--dimensions", "16",
                                 "--no-progress"])  # fmt: skip
    assert result.exit_code != 0 and "--overwrite" in str(result.exception)
    assert EmbeddingStore.open(full).vectors().shape[1] == 32

    cli("index", cut, "-o", tmp_path / "cut-index", "--no-progress")
    cli("index", full, "-o", tmp_path / "full-index", "--no-progress")
    run = tmp_path / "run.trec"
    for index, options, held in (
        (tmp_path / "cut-index", [], 16),
        (tmp_path / "full-index", ["--dimensions", "16"], 32),
    ):
        arguments = ["search", model, index, beir_dir, "-o", run, "--no-progress", *options]
        result = runner.invoke(app, [str(a) for a in arguments])
        assert result.exit_code != 0 and not run.exists()
        message = str(result.exception)
        assert f"holds {held}-dimensional ones" in message and "--dimensions" in message
        assert "\n" not in message
    cli("search", model, tmp_path / "cut-index", beir_dir, "-o", run, "--dimensions", "16", "--k", "3",
        "--no-progress")  # fmt: skip
    assert read_file_manifest(run).identity["settings"]["dimensions"] == 16


def test_a_recipes_encode_and_search_steps_cut_as_the_commands_do_and_refuse_another_width(
    trained: Path, beir_dir: Path, tmp_path: Path
):
    model = trained / "model"
    cli("encode", model, beir_dir, "-o", tmp_path / "cut", "--dimensions", "16", "--no-progress")
    cli("index", tmp_path / "cut", "-o", tmp_path / "cut-index", "--no-progress")
    cli("search", model, tmp_path / "cut-index", beir_dir, "-o", tmp_path / "run.trec", "--dimensions", "16",
        "--k", "3", "--no-progress")  # fmt: skip
    steps = {
        "encode": {"type": "encode", "model": str(model), "data": str(beir_dir), "output": "{out}/cut",
                   "dimensions": 16},
        "index": {"type": "index", "embeddings": "{out}/cut", "output": "{out}/index"},
        "search": {"type": "search", "model": str(model), "index": "{out}/index", "data": str(beir_dir),
                   "output": "{out}/test.trec", "k": 3, "dimensions": 16},
    }  # fmt: skip
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"steps": steps}, sort_keys=False))
    run_recipe(recipe, tmp_path / "out", device="cpu", show_progress=False)
    ours = EmbeddingStore.open(tmp_path / "out" / "cut").vectors()
    assert ours.shape[1] == 16 and np.array_equal(ours, EmbeddingStore.open(tmp_path / "cut").vectors())
    ranked = [read_run(run, Diagnostics()) for run in (tmp_path / "out" / "test.trec", tmp_path / "run.trec")]
    assert ranked[0] == ranked[1]

    del steps["search"]["dimensions"]  # full-width queries against the 16-dimensional index
    recipe.write_text(yaml.safe_dump({"steps": steps}, sort_keys=False))
    with pytest.raises(Exception, match="holds 16-dimensional ones"):
        run_recipe(recipe, tmp_path / "out", device="cpu", show_progress=False)


def test_a_benchmark_of_cut_vectors_reuses_only_its_own_width(trained: Path, beir_dir: Path, tmp_path: Path):
    model, output = trained / "model", tmp_path / "bench"
    for _ in range(2):
        cli("benchmark", model, beir_dir, "-o", output, "--dimensions", "16", "--k", "5", "--no-progress")
    results = json.loads((output / "results.json").read_text())
    assert "run (16 dimensions)" in json.dumps(results)
    assert EmbeddingStore.open(output / "beir" / "embeddings").vectors().shape[1] == 16
    assert set(results["collections"][0]["stages"].values()) == {"reused"}  # the second, of the same width
    arguments = ["benchmark", model, beir_dir, "-o", output, "--k", "5", "--no-progress"]
    refused = runner.invoke(app, [str(a) for a in arguments])
    assert refused.exit_code != 0 and "--overwrite" in str(refused.exception)
    cli(*arguments, "--overwrite")
    assert EmbeddingStore.open(output / "beir" / "embeddings").vectors().shape[1] == 32
