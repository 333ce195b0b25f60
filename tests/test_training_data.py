"""Training examples and the groups drawn from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from densekit.configuration import apply_overrides, load_config
from densekit.data import DataError, Diagnostics
from densekit.data.examples import (
    TrainingExample,
    check_example_ids,
    examples_from_qrels,
    read_examples,
    write_examples,
)
from densekit.training.config import TrainConfig
from densekit.training.groups import GroupSampler, NegativeShortfallError


def example(i: int, negatives: int, positives: int = 1) -> TrainingExample:
    return TrainingExample(
        query_id=f"q{i}",
        query=f"query {i}",
        positives=[f"p{i}.{j}" for j in range(positives)],
        negatives=[f"n{i}.{j}" for j in range(negatives)],
    )


def test_round_trip_and_errors_name_the_line(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    write_examples(path, [example(0, 2), example(1, 0)])
    assert [e.query_id for e in read_examples(path)] == ["q0", "q1"]
    path.write_text(path.read_text() + '{"query_id": "q2", "query": "x", "positives": []}\n')
    with pytest.raises(DataError) as err:
        read_examples(path)
    [problem] = err.value.problems
    assert problem.line == 3 and "positives" in problem.message
    path.write_text('{"query_id": "q2", "query": "x", "positives": ["a"], "negatives": "b"}\n{oops\n')
    diagnostics = Diagnostics(collect=True)
    read_examples(path, diagnostics)
    assert [(p.line, p.message.split(":")[0]) for p in diagnostics.errors] == [
        (1, "negatives"),
        (2, "malformed JSON"),
    ]


def test_unknown_document_ids_are_reported(tmp_path: Path):
    examples = [example(0, 1)]
    with pytest.raises(DataError, match=r"2 document ids not in the corpus: 'p0.0' \(line 1\)"):
        check_example_ids(tmp_path / "t.jsonl", examples, {"other"}, Diagnostics())


def test_examples_from_qrels_keep_every_positive(caplog):
    qrels = {"a": {"d1": 1, "d2": 2, "d3": 0}, "b": {"d4": 0}}
    with caplog.at_level("WARNING", logger="densekit"):
        examples = examples_from_qrels({"a": "qa", "b": "qb"}, qrels)
    assert [(e.query_id, e.positives) for e in examples] == [("a", ["d1", "d2"])]
    assert "1 judged queries have no document of relevance >= 1" in caplog.text


def test_negatives_rotate_per_epoch_and_repeat_by_seed():
    examples = [example(0, 6, positives=2)]
    sampler = GroupSampler(examples, group_size=4, seed=1)
    first, second, third = (sampler.group(0, epoch) for epoch in range(3))
    assert set(first[1]) | set(second[1]) == set(examples[0].negatives)  # two epochs cover all six
    assert not set(first[1]) & set(second[1])
    assert first[0] != second[0] and first[0] == third[0]  # positives rotate too
    assert GroupSampler(examples, 4, seed=1).group(0, 1) == second
    assert GroupSampler(examples, 4, seed=2).group(0, 0) != first


def test_too_few_negatives_is_an_error_by_default():
    with pytest.raises(NegativeShortfallError, match="1 of 2 training examples have fewer than 3 negatives"):
        GroupSampler([example(0, 3), example(1, 2)], group_size=4, seed=0)


def test_shortfall_policies_are_explicit_and_logged(caplog):
    examples = [example(0, 3), example(1, 1)]
    with caplog.at_level("WARNING", logger="densekit"):
        repeat = GroupSampler(examples, group_size=4, seed=0, shortfall="repeat")
    assert "filling them by 'repeat'" in caplog.text
    assert repeat.group(1, 0)[1] == ["n1.0"] * 3
    corpus = ["p1.0", "c1", "c2", "c3"]
    random_fill = GroupSampler(examples, group_size=4, seed=0, shortfall="random", corpus_ids=corpus)
    _, negatives = random_fill.group(1, 0)
    assert negatives[0] == "n1.0" and len(negatives) == 3 and "p1.0" not in negatives


def test_config_overrides_and_unknown_keys(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  path: /d\n  train: /t.jsonl\noptim:\n  batch_size: 8\n")
    config = load_config(
        path, TrainConfig, ["optim.learning_rate=1e-4", "grad_cache.enabled=true", "grad_cache.chunk_size=4"]
    )
    assert config.optim.learning_rate == 1e-4 and config.grad_cache.enabled and config.optim.batch_size == 8
    with pytest.raises(DataError, match=r"command-line override optim\.batchsize=3: Extra inputs are not"):
        load_config(path, TrainConfig, ["optim.batchsize=3"])
    with pytest.raises(ValueError, match="not of the form"):
        apply_overrides({}, ["optim.lr"])


def test_a_document_both_positive_and_negative_is_an_error_naming_the_line(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"query_id": "q1", "query": "a", "positives": ["d1"], "negatives": ["d2"]}\n'
        '{"query_id": "q2", "query": "b", "positives": ["d1", "d3"], "negatives": ["d3", "d4"]}\n'
    )
    with pytest.raises(DataError, match=r"train.jsonl:2: error: document 'd3' is both a positive and a neg"):
        read_examples(path)
