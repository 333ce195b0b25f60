"""Distillation from a teacher's scores into the bi-encoder: MarginMSE and listwise KL, alone or beside
InfoNCE, with gradient caching and with several processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from densekit.data.examples import read_examples, write_examples
from densekit.training.contrastive import kl_distillation_loss, margin_mse_loss

from .processes import run_in_processes
from .test_training import _free_port, _one_step_worker, gradients, make_config, make_task, max_difference


@pytest.fixture(scope="module")
def scored(collection, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The training collection with a teacher score for every positive and negative."""
    root, train = collection
    rng = np.random.default_rng(0)
    examples = []
    for example in read_examples(train):
        scores = {d: float(rng.normal(8, 1)) for d in example.positives}
        scores.update({d: float(rng.normal(3, 2)) for d in example.negatives})
        examples.append(example.model_copy(update={"teacher_scores": scores}))
    path = tmp_path_factory.mktemp("scored") / "train.jsonl"
    write_examples(path, examples)
    return root, path


STUDENT = [[2.0, 1.5, -0.5], [0.3, 0.9, 0.1]]
TEACHER = [[9.0, 7.0, 1.0], [4.0, 6.0, 2.0]]


def test_margin_mse_equals_the_hand_computed_value():
    squares = [
        ((s[0] - s[j]) - (t[0] - t[j])) ** 2 for s, t in zip(STUDENT, TEACHER, strict=True) for j in (1, 2)
    ]
    expected = sum(squares) / len(squares)
    assert float(margin_mse_loss(torch.tensor(STUDENT), torch.tensor(TEACHER))) == pytest.approx(expected)


def test_kl_equals_the_hand_computed_value():
    def softmax(row: list[float], temperature: float) -> list[float]:
        exps = [math.exp(x / temperature) for x in row]
        return [e / sum(exps) for e in exps]

    expected = 0.0
    for s, t in zip(STUDENT, TEACHER, strict=True):
        p, q = softmax(t, 2.0), softmax(s, 0.5)
        expected += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    expected /= len(STUDENT)
    value = kl_distillation_loss(torch.tensor(STUDENT), torch.tensor(TEACHER), 0.5, 2.0)
    assert float(value) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["margin_mse", "kl"])
def test_distillation_with_grad_cache_equals_it_without(scored, still_model: Path, kind: str):
    loss = {"distillation": kind, "distillation_weight": 0.7, "contrastive_weight": 0.5}
    plain = make_task(make_config(scored, still_model, optim={"batch_size": 8}, loss=loss))
    cached = make_task(
        make_config(scored, still_model, optim={"batch_size": 8}, loss=loss,
                    grad_cache={"enabled": True, "chunk_size": 3})
    )  # fmt: skip
    batch = plain.batch(1, 0)
    assert batch.teacher is not None and batch.teacher.shape == (8, 3)
    plain_result = plain.forward_backward(batch)
    cached_result = cached.forward_backward(cached.batch(1, 0))
    for key in ("loss", "loss_contrastive", "loss_distillation"):
        assert abs(plain_result[key] - cached_result[key]) < 1e-10
    total = 0.5 * plain_result["loss_contrastive"] + 0.7 * plain_result["loss_distillation"]
    assert plain_result["loss"] == pytest.approx(total)
    assert max_difference(gradients(plain.encoder), gradients(cached.encoder)) < 1e-10


def test_the_weighted_sum_of_terms_is_what_is_back_propagated(scored, still_model: Path):
    def step(loss: dict) -> tuple[dict, dict]:
        task = make_task(make_config(scored, still_model, loss=loss))
        result = task.forward_backward(task.batch(0, 0))
        return result, gradients(task.encoder)

    _, both_gradients = step({"distillation": "kl", "contrastive_weight": 0.5, "distillation_weight": 0.7})
    alone, alone_gradients = step({"distillation": "kl", "contrastive_weight": 0})
    infonce, infonce_gradients = step({})
    assert set(alone) == {"loss", "loss_distillation"} and set(infonce) == {"loss"}
    combined = {k: 0.5 * infonce_gradients[k] + 0.7 * alone_gradients[k] for k in both_gradients}
    assert max_difference(both_gradients, combined) < 1e-10
    assert max_difference(alone_gradients, infonce_gradients) > 1e-4


def test_each_query_gets_its_own_groups_teacher_scores_positive_first(scored, still_model: Path):
    from densekit.training.sampling import local_batch_rows

    task = make_task(make_config(scored, still_model, optim={"batch_size": 8}, loss={"distillation": "kl"}))
    batch = task.batch(2, 0)
    for row, index in enumerate(local_batch_rows(len(task.examples), 8, 2, 0, task.config.seed)):
        documents = task.sampler.group(int(index), 2).documents
        scores = task.examples[int(index)].teacher_scores
        assert batch.teacher[row].tolist() == pytest.approx([scores[d] for d in documents])


def test_two_processes_distil_like_one(scored, still_model: Path, tmp_path: Path):
    config = make_config(scored, still_model, optim={"batch_size": 8}, loss={"distillation": "margin_mse"})
    single = make_task(config)
    single_result = single.forward_backward(single.batch(0, 0))
    run_in_processes(_one_step_worker, (2, _free_port(), config.model_dump_json(), str(tmp_path / "g")))
    two = safetensors.torch.load_file(str(tmp_path / "g"))
    saved = json.loads((tmp_path / "g.json").read_text())
    # process 0 reports its half's distillation term; the gradients are of the whole batch
    assert abs(saved["loss_contrastive"] - single_result["loss_contrastive"]) < 1e-10
    assert max_difference(two, gradients(single.encoder)) < 1e-10


def test_a_missing_teacher_score_is_an_error_naming_the_line(collection, still_model: Path):
    with pytest.raises(ValueError, match=r"train.jsonl:1: query 'q0' has no teacher score for document"):
        make_task(make_config(collection, still_model, loss={"distillation": "kl"}))


def test_nothing_to_learn_is_refused(collection, still_model: Path):
    with pytest.raises(ValueError, match="nothing to train on"):
        make_config(collection, still_model, loss={"contrastive_weight": 0})
