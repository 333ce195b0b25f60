"""Length-grouped batching: every example once per epoch, less padding, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from densekit.data.dataset import Dataset
from densekit.diagnostics import DataError
from densekit.training.fine_tuning import run_training
from densekit.training.sampling import (
    DomainBatching,
    LengthGrouping,
    batches_per_epoch,
    epoch_order,
    global_batch_rows,
)

from .test_training import final_weights, killed_at_step_five, make_config, make_task


def padded_tokens(order: np.ndarray, lengths: np.ndarray, batch: int) -> int:
    return int(sum(lengths[b].max() * batch for b in order.reshape(-1, batch)))


def test_grouped_batches_cover_every_example_once_and_pad_less_than_random_ones():
    lengths = np.random.default_rng(0).integers(5, 256, size=96)
    grouping = LengthGrouping(lengths, bucket_batches=4)
    for epoch in range(3):
        order = epoch_order(96, 8, epoch, seed=7, grouping=grouping)
        assert sorted(order.tolist()) == list(range(96))
        random_order = epoch_order(96, 8, epoch, seed=7)
        assert padded_tokens(order, lengths, 8) < 0.8 * padded_tokens(random_order, lengths, 8)
    assert not np.array_equal(
        epoch_order(96, 8, 0, 7, grouping), epoch_order(96, 8, 1, 7, grouping)
    )  # each epoch has its own batches


def test_with_a_partial_batch_left_over_no_example_repeats_and_full_batches_fill_the_epoch():
    lengths = np.arange(101)
    order = epoch_order(101, 8, 0, seed=3, grouping=LengthGrouping(lengths, bucket_batches=3))
    assert len(order) == 96 and len(set(order.tolist())) == 96


def test_a_batch_draws_from_a_bucket_of_random_examples_not_from_the_sorted_collection():
    lengths = np.arange(800)
    order = epoch_order(800, 8, 0, seed=1, grouping=LengthGrouping(lengths, bucket_batches=4))
    first_bucket = set(np.random.default_rng([1, 0]).permutation(800)[:32].tolist())
    batches = order.reshape(-1, 8)
    holding = [b for b in batches if set(b.tolist()) <= first_bucket]
    assert len(holding) == 4  # the first bucket's 32 random examples make exactly four batches
    assert all(np.all(np.diff(lengths[b]) <= 0) for b in holding)


def test_the_task_groups_by_the_longest_passage_of_each_examples_group(collection, tiny_model: Path):
    config = make_config(collection, tiny_model, data={"length_grouping": 2})
    task = make_task(config)
    grouping = task.length_grouping(0)
    assert grouping is not None and grouping.bucket_batches == 2
    for index in (0, len(task.examples) - 1):
        documents = task.sampler.group(index, 0).documents
        counts = task.encoder.tokenize([task.texts[d] for d in documents], "passage")
        assert grouping.lengths[index] == max(len(ids) for ids in counts)
    steps = task.steps_per_epoch()
    rows = [global_batch_rows(len(task.examples), 4, 0, step, config.seed, grouping) for step in range(steps)]
    seen = np.concatenate(rows).tolist()
    assert len(seen) == len(set(seen)) == steps * 4


def test_a_killed_length_grouped_run_resumes_to_the_same_weights(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch
):
    config = make_config(collection, tiny_model, data={"length_grouping": 2})
    run_training(config, tmp_path / "straight", show_progress=False)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
    run_training(config, tmp_path / "resumed", resume=True, show_progress=False)
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

    run_training(make_config(collection, tiny_model), tmp_path / "random", show_progress=False)
    random = safetensors.torch.load_file(str(tmp_path / "random" / "model" / "model.safetensors"))
    assert any(not torch.equal(random[k], straight[k]) for k in straight)  # grouping changed the batches


def test_domain_batches_hold_one_domain_each_and_no_example_twice():
    domains = np.array(["a"] * 37 + ["b"] * 20 + ["c"] * 11)
    grouping = DomainBatching(np.random.default_rng(1).permutation(domains))
    orders = []
    for epoch in range(3):
        order = epoch_order(len(domains), 8, epoch, seed=5, grouping=grouping)
        assert (
            len(order)
            == 8 * (37 // 8 + 20 // 8 + 11 // 8)
            == batches_per_epoch(len(domains), 8, grouping) * 8
        )
        assert len(set(order.tolist())) == len(order)
        batches = order.reshape(-1, 8)
        assert all(len(set(grouping.domains[b].tolist())) == 1 for b in batches)
        orders.append([grouping.domains[b[0]] for b in batches])
    assert len({tuple(o) for o in orders}) > 1  # the domains take turns in another order each epoch


def test_training_by_domain_batches_and_an_example_without_domain_is_refused(
    collection, tiny_model, tmp_path
):
    from densekit.data.examples import read_examples, write_examples

    root, train = collection
    examples = read_examples(train)
    tagged = [
        e.model_copy(update={"domain": "even" if i % 2 == 0 else "odd"}) for i, e in enumerate(examples)
    ]
    write_examples(tmp_path / "tagged.jsonl", tagged)
    config = make_config((root, tmp_path / "tagged.jsonl"), tiny_model, data={"batches": "by_domain"})
    task = make_task(config)
    assert task.steps_per_epoch() == 2  # 6 examples a domain, batches of 4
    for epoch in range(2):
        for step in range(task.steps_per_epoch()):
            rows = global_batch_rows(len(tagged), 4, epoch, step, config.seed, task.grouping(epoch))
            assert len({tagged[int(i)].domain for i in rows}) == 1
    tagged[3] = tagged[3].model_copy(update={"domain": None})
    write_examples(tmp_path / "untagged.jsonl", tagged)
    config = make_config((root, tmp_path / "untagged.jsonl"), tiny_model, data={"batches": "by_domain"})
    with pytest.raises(ValueError, match=r"untagged.jsonl:4: no domain"):
        make_task(config).steps_per_epoch()


def test_mine_writes_the_collections_domain_into_every_example(beir_dir, tmp_path):
    from typer.testing import CliRunner

    from densekit.cli.main import app
    from densekit.data.examples import read_examples

    result = CliRunner().invoke(app, ["mine", str(beir_dir), "--split", "test", "--source", "none",
                                      "--domain", "sci", "-o", str(tmp_path / "ex.jsonl")])  # fmt: skip
    assert result.exit_code == 0, result.output
    examples = read_examples(tmp_path / "ex.jsonl")
    assert examples and all(e.domain == "sci" for e in examples)


def test_training_on_two_collections_reads_each_examples_documents_from_its_own(
    collection, tiny_model, tmp_path
):
    from densekit.data.examples import read_examples, write_examples
    from densekit.training.fine_tuning import read_training_inputs

    from .conftest import write_beir

    root, train = collection
    home = {d.id: d.full_text for d in Dataset.open(root).iter_corpus()}
    other_corpus = [{"_id": doc_id, "title": "", "text": f"other collection's {doc_id}"} for doc_id in home]
    other = write_beir(
        tmp_path / "other", other_corpus, [{"_id": "q", "text": "q"}], {"test": [("q", "t0d0", 1)]}
    )
    examples = read_examples(train)
    tagged = [e.model_copy(update={"domain": "other"}) if i % 2 else e for i, e in enumerate(examples)]
    write_examples(tmp_path / "mixed.jsonl", tagged)
    config = make_config(
        (root, tmp_path / "mixed.jsonl"), tiny_model, data={"collections": {"other": str(other)}}
    )
    _, _, texts, read = read_training_inputs(config.data)
    for example in read:
        text = texts[example.positives[0]]
        assert text.startswith("other collection's") == (example.domain == "other")
    assert len(texts) == 2 * len(home)
    run_training(config, tmp_path / "run", show_progress=False)  # trains across both
    assert (tmp_path / "run" / "model").is_dir()

    tagged[1] = tagged[1].model_copy(update={"negatives": ["missing-doc"]})
    write_examples(tmp_path / "bad.jsonl", tagged)
    bad = make_config((root, tmp_path / "bad.jsonl"), tiny_model, data={"collections": {"other": str(other)}})
    with pytest.raises(DataError, match=r"bad.jsonl:2: error: 1 document ids not in the corpus: 'missing"):
        read_training_inputs(bad.data)
