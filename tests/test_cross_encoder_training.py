"""Training a cross-encoder through the trainer, and scoring training examples with it as a teacher."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from densekit.cli.main import app
from densekit.configuration import validate_config
from densekit.data.dataset import Dataset
from densekit.data.examples import read_examples
from densekit.io.outputs import OutputError
from densekit.mining.teacher import score_examples, work_file
from densekit.models.cross_encoder import CrossEncoder
from densekit.recipes.runner import run_recipe
from densekit.training.config import CrossEncoderTrainConfig
from densekit.training.fine_tuning import run_cross_encoder_training
from densekit.training.listwise import CrossEncoderTask, listwise_loss

from .test_training import gradients, killed_at_step_five, max_difference


def make_config(collection: tuple[Path, Path], model: Path, **sections) -> CrossEncoderTrainConfig:
    root, train = collection
    tree = {
        "model": {"path": str(model), "max_length": 48},
        "data": {"path": str(root), "train": str(train), "group_size": 3},
        "optim": {"batch_size": 4, "learning_rate": 1e-3, "max_steps": 6, "warmup_ratio": 0.2},
        "checkpoint": {"every": 3, "keep": 5},
        "log_every": 1,
        "device": "cpu",
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    return validate_config(tree, CrossEncoderTrainConfig, "<test>")


def make_task(config: CrossEncoderTrainConfig, seed: int = 0) -> CrossEncoderTask:
    torch.manual_seed(seed)  # the new head's initial weights
    model = CrossEncoder.load(config.model.path, config.model.max_length).double()
    texts = {doc.id: doc.full_text for doc in Dataset.open(config.data.path).iter_corpus()}
    return CrossEncoderTask(model, read_examples(Path(config.data.train)), texts, config)


def test_the_listwise_loss_is_the_positives_cross_entropy_over_its_group():
    scores = torch.tensor([[2.0, 1.0, -1.0], [0.5, 3.0, 0.0]])
    by_hand = [
        -np.log(np.exp(2.0) / (np.exp(2.0) + np.exp(1.0) + np.exp(-1.0))),
        -np.log(np.exp(0.5) / (np.exp(0.5) + np.exp(3.0) + np.exp(0.0))),
    ]
    assert float(listwise_loss(scores)) == pytest.approx(np.mean(by_hand), abs=1e-6)


def test_a_batch_holds_each_querys_pairs_positive_first(collection, tiny_model: Path):
    from densekit.training.sampling import local_batch_rows

    task = make_task(make_config(collection, tiny_model))
    batch = task.batch(epoch=0, step=0)
    assert batch.size == 4 and len(batch.pairs) == 12
    tokenizer = task.module.tokenizer
    first = int(local_batch_rows(len(task.examples), 4, 0, 0, task.config.seed)[0])
    [positive], negatives = task.sampler.group(first, 0)
    decoded = tokenizer.decode(batch.pairs[0]["input_ids"], skip_special_tokens=True)
    assert decoded.endswith(tokenizer.decode(tokenizer(task.texts[positive])["input_ids"][1:-1]))
    assert positive in task.examples[first].positives and negatives[0] in task.examples[first].negatives


def test_chunked_scoring_gives_the_whole_batchs_gradient(collection, still_model: Path):
    whole = make_task(make_config(collection, still_model))
    chunked = make_task(make_config(collection, still_model, chunk_size=3))
    batch = whole.batch(0, 0)
    loss_whole = whole.forward_backward(batch)["loss"]
    loss_chunked = chunked.forward_backward(batch)["loss"]
    assert loss_whole == pytest.approx(loss_chunked, abs=1e-10)
    assert max_difference(gradients(whole.module), gradients(chunked.module)) < 1e-10
    assert max(float(g.abs().max()) for g in gradients(whole.module).values()) > 1e-4


def test_a_killed_cross_encoder_run_resumes_to_the_same_weights(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch
):
    config = make_config(collection, tiny_model, data={"length_grouping": 2})
    torch.manual_seed(0)
    run_cross_encoder_training(config, tmp_path / "straight", show_progress=False)
    torch.manual_seed(0)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed", run_cross_encoder_training)
    state = run_cross_encoder_training(config, tmp_path / "resumed", resume=True, show_progress=False)
    assert state["step"] == 6
    straight = CrossEncoder.load(tmp_path / "straight" / "model").state_dict()
    resumed = CrossEncoder.load(tmp_path / "resumed" / "model").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    start = CrossEncoder.load(tiny_model).state_dict()
    assert not torch.equal(start["model.bert.embeddings.word_embeddings.weight"],
                           straight["model.bert.embeddings.word_embeddings.weight"])  # fmt: skip


def test_training_lowers_the_listwise_loss_over_every_negative(collection, still_model: Path, tmp_path: Path):
    config = make_config(collection, still_model, optim={"max_steps": 60, "learning_rate": 3e-3})
    examples = read_examples(Path(config.data.train))
    texts = {doc.id: doc.full_text for doc in Dataset.open(config.data.path).iter_corpus()}

    def loss(model: CrossEncoder) -> float:
        groups = [
            model.score([(e.query, texts[d]) for d in (e.positives[0], *e.negatives)]) for e in examples
        ]
        return float(listwise_loss(torch.tensor(np.array(groups))))

    torch.manual_seed(0)
    before = loss(CrossEncoder.load(still_model, 48))
    run_cross_encoder_training(config, tmp_path / "run", show_progress=False)
    after = loss(CrossEncoder.load(tmp_path / "run" / "model"))
    assert before == pytest.approx(np.log(5), abs=0.05)  # a new head scores every pair alike
    assert after < 0.7 * before


def test_grad_cache_and_a_group_without_negatives_are_refused(collection, tiny_model: Path):
    with pytest.raises(ValueError, match="chunk_size"):
        make_config(collection, tiny_model, grad_cache={"enabled": True, "chunk_size": 2})
    with pytest.raises(ValueError, match="group_size"):
        make_config(collection, tiny_model, data={"group_size": 1})


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("teacher") / "model"
    CrossEncoder.load(tiny_model, 48).save(path)
    return path


def test_scored_examples_carry_the_teachers_score_of_every_pair(collection, teacher: Path, tmp_path: Path):
    root, train = collection
    model = CrossEncoder.load(teacher)
    scored = score_examples(model, train, Dataset.open(root), tmp_path / "scored.jsonl", 5, 4, False)
    examples, originals = read_examples(tmp_path / "scored.jsonl"), read_examples(train)
    texts = {d.id: d.full_text for d in Dataset.open(root).iter_corpus()}
    assert scored == sum(len(e.positives) + len(e.negatives) for e in originals)
    for example, original in zip(examples, originals, strict=True):
        assert example.model_copy(update={"teacher_scores": None}) == original
        documents = [*original.positives, *original.negatives]
        alone = model.score([(original.query, texts[d]) for d in documents])
        assert list(example.teacher_scores) == documents
        assert np.abs(np.array(list(example.teacher_scores.values())) - alone).max() < 1e-5
    assert not work_file(tmp_path / "scored.jsonl").exists()


def test_a_killed_scoring_resumes_after_its_last_saved_chunk(collection, teacher: Path, tmp_path: Path):
    root, train = collection
    model, dataset = CrossEncoder.load(teacher), Dataset.open(root)
    score_examples(model, train, dataset, tmp_path / "straight.jsonl", 5, 4, False)

    def killed(number: int) -> None:
        if number == 1:
            raise KeyboardInterrupt("killed")

    output = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        score_examples(model, train, dataset, output, 5, 4, False, on_chunk=killed)
    assert not output.exists() and work_file(output).is_file()
    with work_file(output).open("a") as handle:
        handle.write('{"scores": [{"t1d')  # a torn write
    rest = score_examples(model, train, dataset, output, 5, 4, False)
    examples = read_examples(train)
    assert rest == sum(len(e.positives) + len(e.negatives) for e in examples[8:])  # chunks 0 and 1 kept
    assert read_examples(output) == read_examples(tmp_path / "straight.jsonl")


def test_scoring_starts_again_for_another_teacher_and_refuses_what_it_did_not_make(
    collection, teacher: Path, tiny_model: Path, tmp_path: Path
):
    root, train = collection
    dataset, output = Dataset.open(root), tmp_path / "scored.jsonl"
    with pytest.raises(KeyboardInterrupt):
        score_examples(CrossEncoder.load(teacher), train, dataset, output, 5, 4, False,
                       on_chunk=lambda n: (_ for _ in ()).throw(KeyboardInterrupt()))  # fmt: skip
    torch.manual_seed(2)
    other = CrossEncoder.load(tiny_model, 48)
    assert score_examples(other, train, dataset, output, 5, 4, False) == sum(
        len(e.positives) + len(e.negatives) for e in read_examples(train)
    )  # nothing reused from the first teacher
    work_file(tmp_path / "mine.jsonl").write_text("my notes\n")
    with pytest.raises(OutputError, match="did not write it"):
        score_examples(other, train, dataset, tmp_path / "mine.jsonl", 5, 4, False)
    assert work_file(tmp_path / "mine.jsonl").read_text() == "my notes\n"
    with pytest.raises(OutputError, match="input"):
        score_examples(other, train, dataset, train, 5, 4, False)


def test_scoring_at_another_precision_starts_again(collection, teacher: Path, tmp_path: Path):
    root, train = collection
    model, dataset, output = CrossEncoder.load(teacher), Dataset.open(root), tmp_path / "scored.jsonl"
    with pytest.raises(KeyboardInterrupt):
        score_examples(model, train, dataset, output, 5, 4, False,
                       on_chunk=lambda n: (_ for _ in ()).throw(KeyboardInterrupt()))  # fmt: skip
    pairs = sum(len(e.positives) + len(e.negatives) for e in read_examples(train))
    assert score_examples(model, train, dataset, output, 5, 4, False, precision="bf16") == pairs
    texts = {d.id: d.full_text for d in dataset.iter_corpus()}
    first = read_examples(output)[0]
    documents = [*first.positives, *first.negatives]
    bf16 = model.score([(first.query, texts[d]) for d in documents], precision="bf16")
    assert list(first.teacher_scores.values()) == pytest.approx(bf16.tolist(), abs=1e-6)


def test_distillation_recipe_mines_trains_a_teacher_scores_distils_and_reranks(
    tmp_path: Path, tiny_st_model: Path, collection
):
    root, _ = collection
    recipe = {
        "data": {"path": str(root)},
        "steps": {
            "mine": {"type": "mine", "data": "{data.path}", "source": "bm25", "output": "{out}/ex.jsonl",
                     "settings": {"first_rank": 1, "last_rank": 20, "count": 4}},
            "teacher": {"type": "train_cross_encoder", "output": "{out}/teacher", "config": {
                "model": {"path": str(tiny_st_model), "max_length": 48},
                "data": {"path": "{data.path}", "train": "{out}/ex.jsonl", "group_size": 3},
                "optim": {"batch_size": 4, "max_steps": 3, "learning_rate": 1e-3}}},
            "score": {"type": "score", "model": "{out}/teacher/model", "examples": "{out}/ex.jsonl",
                      "data": "{data.path}", "output": "{out}/scored.jsonl"},
            "distil": {"type": "train", "output": "{out}/distilled", "config": {
                "model": {"path": str(tiny_st_model)},
                "data": {"path": "{data.path}", "train": "{out}/scored.jsonl", "group_size": 3},
                "loss": {"distillation": "kl", "distillation_weight": 1.0},
                "optim": {"batch_size": 4, "max_steps": 3, "learning_rate": 1e-3}}},
            "bm25": {"type": "bm25", "data": "{data.path}", "output": "{out}/bm25.trec", "k": 10},
            "rerank": {"type": "rerank", "model": "{out}/teacher/model", "run": "{out}/bm25.trec",
                       "data": "{data.path}", "depth": 5, "output": "{out}/reranked.trec"},
            "evaluate": {"type": "evaluate", "data": "{data.path}", "run": "{out}/reranked.trec",
                         "output": "{out}/reranked.json"},
        },
    }  # fmt: skip
    path = tmp_path / "distil.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    metrics = run_recipe(path, tmp_path / "out", device="cpu", show_progress=False)
    assert 0 <= metrics["nDCG@10"] <= 1
    scored = read_examples(tmp_path / "out" / "scored.jsonl")
    assert all(set(e.teacher_scores) == {*e.positives, *e.negatives} for e in scored)
    log = [json.loads(line) for line in (tmp_path / "out" / "distilled" / "train_log.jsonl").open()]
    assert all("loss_distillation" in row for row in log if "loss" in row)


def test_the_train_cross_encoder_and_score_commands(collection, tiny_model: Path, tmp_path: Path):
    root, train = collection
    config = tmp_path / "ce.yaml"
    config.write_text(yaml.safe_dump(make_config(collection, tiny_model).model_dump(mode="json")))
    runner = CliRunner()
    result = runner.invoke(
        app, ["train-cross-encoder", str(config), "--out", str(tmp_path / "ce"), "optim.max_steps=2",
              "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, ["score", str(tmp_path / "ce" / "model"), str(train), str(root), "-o", str(tmp_path / "s.jsonl"),
              "--no-progress", "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert all(e.teacher_scores for e in read_examples(tmp_path / "s.jsonl"))
