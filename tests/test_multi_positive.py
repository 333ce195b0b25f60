"""Several positives per group (data.positives) and the multi-positive InfoNCE (loss.multi_positive)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from densekit.configuration import validate_config
from densekit.data import DataError
from densekit.data.examples import TrainingExample, write_examples
from densekit.training.config import CrossEncoderTrainConfig
from densekit.training.contrastive import ContrastiveTask, contrastive_loss, multi_positive_loss
from densekit.training.fine_tuning import run_training
from densekit.training.groups import GroupSampler
from densekit.training.sampling import global_batch_rows

from .conftest import write_beir
from .processes import run_in_processes
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
from .training_fixtures import TOPICS, write_training_collection

MULTI = {"data": {"group_size": 4, "positives": 2}, "loss": {"multi_positive": True}}


def write_examples_file(root: Path, name: str, multi: bool) -> Path:
    """Training examples over `write_training_collection`'s corpus. Each query's negatives include the
    next topic's first document (that query's positive) and another topic's second (a positive of
    that topic's query when `multi`); with `multi`, even topics have three positives, odd ones one."""
    count = len(TOPICS)
    examples = []
    for t in range(count):
        positives = [f"t{t}d{d}" for d in range(3)] if multi and t % 2 == 0 else [f"t{t}d0"]
        negatives = [f"t{(t + 1) % count}d0", f"t{(t + 2) % count}d1", f"t{(t + 3) % count}d2"]
        examples.append(
            TrainingExample(
                query_id=f"q{t}", query=f"question about {TOPICS[t]}", positives=positives,
                negatives=[*negatives, f"t{(t + 5) % count}d1"],
            )
        )  # fmt: skip
    write_examples(root / name, examples)
    return root / name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_training_collection(tmp_path_factory.mktemp("multi") / "data")[0]


@pytest.fixture(scope="module")
def single(corpus: Path) -> tuple[Path, Path]:
    """One positive per query; other queries' positives are among its negatives."""
    return corpus, write_examples_file(corpus, "single.jsonl", multi=False)


@pytest.fixture(scope="module")
def multi(corpus: Path) -> tuple[Path, Path]:
    """Three positives for even topics, one for odd ones (repeated to fill two slots)."""
    return corpus, write_examples_file(corpus, "multi.jsonl", multi=True)


def per_positive_loss(scores: torch.Tensor, layout: list[str], known: list[set[str]]) -> torch.Tensor:
    """The multi-positive loss from document ids: for each query and each distinct known positive of it
    in the batch (its first column in the query's own group, else its first in the batch), the
    single-positive InfoNCE with every other column holding one of its positives left out; the mean
    over a query's positives, then over queries."""
    group = len(layout) // len(known)
    losses = []
    for i, positives in enumerate(known):
        own = range(i * group, (i + 1) * group)
        first: dict[str, int] = {}
        for column in sorted(
            (c for c, d in enumerate(layout) if d in positives), key=lambda c: (c not in own, c)
        ):
            first.setdefault(layout[column], column)
        terms = []
        for target in first.values():
            excluded = torch.tensor([d in positives and c != target for c, d in enumerate(layout)])
            row = scores[i].masked_fill(excluded, float("-inf"))
            terms.append(F.cross_entropy(row[None], torch.tensor([target])))
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses).mean()


def batch_layout(task: ContrastiveTask, epoch: int, step: int) -> tuple[list[str], list[set[str]]]:
    """The batch's passages' document ids in column order, and each query's known positives."""
    rows = global_batch_rows(len(task.examples), task.config.optim.batch_size, epoch, step, task.config.seed)
    layout = [d for r in rows for d in task.sampler.group(int(r), epoch).documents]
    return layout, [set(task.examples[int(r)].positives) for r in rows]


# (a) one positive per group: the same loss and gradients as today's masked InfoNCE


def test_multi_positive_with_one_positive_is_the_masked_infonce(single, still_model: Path):
    plain = make_task(make_config(single, still_model, optim={"batch_size": 8}))
    multi = make_task(
        make_config(single, still_model, optim={"batch_size": 8}, loss={"multi_positive": True})
    )
    batch = multi.batch(0, 0)
    assert plain.batch(0, 0).false_negatives is not None  # copies of a query's positive are in the batch
    assert torch.equal(batch.false_negatives, plain.batch(0, 0).false_negatives)
    assert batch.positives.sum(1).tolist() == [1] * 8 and all(batch.positives[i, 3 * i] for i in range(8))

    plain_loss = plain.forward_backward(plain.batch(0, 0))["loss"]
    multi_loss = multi.forward_backward(batch)["loss"]
    assert abs(plain_loss - multi_loss) < 1e-12
    assert max_difference(gradients(plain.encoder), gradients(multi.encoder)) < 1e-12
    assert max(float(g.abs().max()) for g in gradients(plain.encoder).values()) > 1e-3


# (b) hand-built scores


def test_the_loss_is_the_mean_of_single_positive_terms_without_the_other_positives():
    scores = torch.tensor([[2.0, 1.0, 0.0, 3.0, -1.0], [0.5, 1.5, 2.5, -0.5, 1.0]], requires_grad=True)
    positives = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 0, 0]], dtype=torch.bool)
    loss = multi_positive_loss(scores, positives)
    loss.backward()  # gradients flow
    first = [-2 + torch.tensor([2.0, 0, 3, -1]).logsumexp(0), -1 + torch.tensor([1.0, 0, 3, -1]).logsumexp(0)]
    second = -2.5 + scores[1].detach().logsumexp(0)  # one target: plain InfoNCE over the whole row
    assert float(loss.detach()) == pytest.approx(float((first[0] + first[1]) / 2 + second) / 2, abs=1e-6)

    # a copy of query 0's first positive (column 5) counts once: a false negative, not a second term
    row = multi_positive_loss(scores[:1].detach(), positives[:1])
    copied = torch.cat([scores[:1].detach(), torch.tensor([[2.4]])], dim=1)
    wider = torch.cat([positives[:1], torch.tensor([[False]])], dim=1)
    copy = torch.tensor([[False] * 5 + [True]])
    assert float(multi_positive_loss(copied, wider, copy)) == pytest.approx(float(row), abs=1e-6)
    assert float(multi_positive_loss(copied, wider | copy)) != pytest.approx(float(row), abs=1e-3)

    # a query whose every passage is one of its positives has nothing to push away: 0, finite gradients
    alone = torch.tensor([[1.0, 2.0]], requires_grad=True)
    nothing = multi_positive_loss(alone, torch.tensor([[True, False]]), torch.tensor([[False, True]]))
    nothing.backward()
    assert float(nothing.detach()) == 0 and torch.isfinite(alone.grad).all()


def overlapping_multi_task(tmp_path: Path, model: Path) -> ContrastiveTask:
    """Three queries in one batch: A has one positive for two slots; C's three positives are among A's
    negatives, so one of them may be in the batch only in A's group; B's positive is C's negative."""
    ids = ("a1", "b1", "c1", "c2", "c3", "n1", "n2", "n3")
    corpus = [{"_id": d, "title": "", "text": f"text of {d} about {d}"} for d in ids]
    root = write_beir(tmp_path / "overlap", corpus, [{"_id": q, "text": q} for q in "ABC"], {"train": []})
    groups = {"A": (["a1"], ["c1", "c2", "c3", "n1"]), "B": (["b1"], ["n1", "n2", "n3"]),
              "C": (["c1", "c2", "c3"], ["b1", "n2"])}  # fmt: skip
    examples = [TrainingExample(query_id=q, query=f"question {q}", positives=p, negatives=n)
                for q, (p, n) in groups.items()]  # fmt: skip
    write_examples(root / "train.jsonl", examples)
    config = make_config((root, root / "train.jsonl"), model, data={"group_size": 4, "positives": 2},
                         optim={"batch_size": 3}, loss={"multi_positive": True})  # fmt: skip
    return make_task(config)


def test_each_distinct_known_positive_in_the_batch_is_one_term(tmp_path: Path, still_model: Path):
    task = overlapping_multi_task(tmp_path, still_model)
    # an epoch in which one of C's positives is in the batch only in A's group
    epoch = next(
        e for e in range(8) if len({d for d in batch_layout(task, e, 0)[0] if d.startswith("c")}) == 3
    )
    layout, known = batch_layout(task, epoch, 0)
    rows = global_batch_rows(3, 3, epoch, 0, task.config.seed)
    query = {task.examples[int(r)].query_id: i for i, r in enumerate(rows)}
    a, b, c = query["A"], query["B"], query["C"]
    batch = task.batch(epoch, 0)
    targets = batch.positives
    assert layout[4 * a : 4 * a + 2] == ["a1", "a1"]  # A's one positive fills both slots...
    assert targets[a].nonzero().flatten().tolist() == [4 * a]  # ...and is one term
    assert batch.false_negatives[a].nonzero().flatten().tolist() == [4 * a + 1]
    assert targets[b].nonzero().flatten().tolist() == [4 * b]  # B's repeat and C's negative b1: copies
    assert batch.false_negatives[b].nonzero().flatten().tolist() == sorted(
        [4 * b + 1, layout.index("b1", 4 * c)]
    )
    outside = [j for j in targets[c].nonzero().flatten().tolist() if not 4 * c <= j < 4 * c + 4]
    assert targets[c].sum() == 3 and len(outside) == 1 and layout[outside[0]] not in layout[4 * c : 4 * c + 4]

    queries = task._encode("query")(batch.queries)[0]
    passages = task._encode("passage")(batch.passages)[0]
    scores = (queries @ passages.T / task.temperature).detach()
    by_hand = per_positive_loss(scores, layout, known)
    with torch.no_grad():
        loss = contrastive_loss(queries, passages, 4, task.temperature, True, batch.false_negatives, targets)
    assert abs(float(loss) - float(by_hand)) < 1e-10
    assert abs(task.forward_backward(batch)["loss"] - float(by_hand)) < 1e-10


def test_a_multi_positive_batch_is_the_mean_over_distinct_positives(multi, still_model: Path):
    task = make_task(make_config(multi, still_model, optim={"batch_size": 8}, **MULTI))
    batch = task.batch(1, 0)
    assert batch.positives.sum(1).max() > 2  # another positive from another query's group
    assert batch.false_negatives.any()  # repeats and copies
    layout, known = batch_layout(task, 1, 0)
    queries = task._encode("query")(batch.queries)[0]
    passages = task._encode("passage")(batch.passages)[0]
    scores = (queries @ passages.T / task.temperature).detach()
    assert abs(task.forward_backward(batch)["loss"] - float(per_positive_loss(scores, layout, known))) < 1e-10


# (c) the sampler

# GroupSampler's groups before data.positives existed (git 64e0665), positive then negatives, for
# examples with 1, 3 and 4 positives and 5, 6 and 2 negatives (the last repeated), group size 4, epochs 0-2
BEFORE = {
    0: [
        ["p0.0 n0.2 n0.4 n0.3", "p0.0 n0.0 n0.1 n0.2", "p0.0 n0.4 n0.3 n0.0"],
        ["p1.0 n1.1 n1.3 n1.5", "p1.1 n1.0 n1.4 n1.2", "p1.2 n1.1 n1.3 n1.5"],
        ["p2.2 n2.1 n2.0 n2.1", "p2.3 n2.1 n2.0 n2.1", "p2.0 n2.1 n2.0 n2.1"],
    ],
    7: [
        ["p0.0 n0.3 n0.2 n0.0", "p0.0 n0.4 n0.1 n0.3", "p0.0 n0.2 n0.0 n0.4"],
        ["p1.2 n1.3 n1.0 n1.2", "p1.0 n1.1 n1.4 n1.5", "p1.1 n1.3 n1.0 n1.2"],
        ["p2.3 n2.0 n2.1 n2.0", "p2.0 n2.0 n2.1 n2.0", "p2.1 n2.0 n2.1 n2.0"],
    ],
}
# and with a random fill: 2 positives, 1 negative, seed 3
BEFORE_RANDOM_FILL = ["p0.0 n0.0 c0 c1", "p0.1 n0.0 c2 c7", "p0.0 n0.0 c5 c3"]


def example(i: int, positives: int, negatives: int) -> TrainingExample:
    return TrainingExample(
        query_id=f"q{i}", query=f"query {i}", positives=[f"p{i}.{j}" for j in range(positives)],
        negatives=[f"n{i}.{j}" for j in range(negatives)],
    )  # fmt: skip


def test_one_positive_per_group_draws_the_groups_it_always_did():
    examples = [example(0, 1, 5), example(1, 3, 6), example(2, 4, 2)]
    for seed, expected in BEFORE.items():
        sampler = GroupSampler(examples, group_size=4, seed=seed, shortfall="repeat")
        groups = [[sampler.group(i, e) for e in range(3)] for i in range(3)]
        assert all(len(g.positives) == 1 for row in groups for g in row)
        assert [[" ".join(g.documents) for g in row] for row in groups] == expected
    corpus = [f"c{k}" for k in range(8)] + ["p0.0", "n0.0"]
    sampler = GroupSampler([example(0, 2, 1)], 4, seed=3, shortfall="random", corpus_ids=corpus)
    assert [" ".join(sampler.group(0, e).documents) for e in range(3)] == BEFORE_RANDOM_FILL


def test_several_positives_rotate_through_all_of_them_by_seed():
    examples = [example(0, 7, 6), example(1, 1, 6), example(2, 3, 6)]
    sampler = GroupSampler(examples, group_size=4, seed=1, positives=3)
    epochs = [sampler.group(0, e) for e in range(7)]
    assert all(len(set(g.positives)) == 3 and len(g.negatives) == 1 for g in epochs)
    # windows of 3 over 7 positives, one after the other: 7 epochs take each positive 3 times, and
    # epochs 0-2 (9 slots) every one at least once
    drawn = [p for g in epochs for p in g.positives]
    assert sorted(drawn) == sorted(examples[0].positives * 3)
    assert set(drawn[:9]) == set(examples[0].positives)
    file_order = examples[0].positives
    assert drawn[:7] not in [
        file_order[k:] + file_order[:k] for k in range(7)
    ]  # a seeded order, not the file's
    again = GroupSampler(examples, 4, seed=1, positives=3)
    assert [again.group(0, e) for e in range(7)] == epochs  # the same for the same seed (a resumed run)
    other = GroupSampler(examples, 4, seed=2, positives=3)
    assert [other.group(0, e) for e in range(7)] != epochs
    assert sampler.group(1, 0).positives == ["p1.0"] * 3  # too few: cycled
    for e in range(3):  # exactly as many: all of them, each epoch
        assert sorted(sampler.group(2, e).positives) == ["p2.0", "p2.1", "p2.2"]
    assert GroupSampler(examples, 3, seed=1, positives=3).group(0, 0).negatives == []


def test_the_settings_are_checked_together(single, tiny_model: Path):
    with pytest.raises(DataError, match=r"data\.positives > 1 needs loss\.multi_positive"):
        make_config(single, tiny_model, data={"group_size": 4, "positives": 2})
    with pytest.raises(DataError, match=r"data\.positives 4 is more than data\.group_size 3"):
        make_config(single, tiny_model, data={"positives": 4}, loss={"multi_positive": True})
    with pytest.raises(DataError, match=r"data\.positives > 1 with loss\.distillation"):
        make_config(
            single, tiny_model, data=MULTI["data"], loss={"multi_positive": True, "distillation": "kl"}
        )
    with pytest.raises(DataError, match=r"does not combine with loss\.mask_false_negatives false"):
        make_config(single, tiny_model, loss={"multi_positive": True, "mask_false_negatives": False})
    tree = {"data": {"path": "/d", "train": "/t.jsonl", "group_size": 4, "positives": 2}}
    with pytest.raises(DataError, match=r"does not apply to a cross-encoder"):
        validate_config(tree, CrossEncoderTrainConfig, "<test>")
    assert (
        make_config(single, tiny_model, data={"positives": 3}, loss={"multi_positive": True}).data.positives
        == 3
    )


# (d) gradient caching and two processes


def test_grad_cache_gives_the_multi_positive_gradients_of_one_pass(multi, still_model: Path):
    plain = make_task(make_config(multi, still_model, optim={"batch_size": 8}, **MULTI))
    cached = make_task(
        make_config(multi, still_model, optim={"batch_size": 8}, **MULTI,
                    grad_cache={"enabled": True, "chunk_size": 3})
    )  # fmt: skip
    batch = plain.batch(1, 0)
    assert batch.positives.sum(1).max() > 2 and batch.false_negatives.any()
    plain_loss = plain.forward_backward(batch)["loss"]
    cached_loss = cached.forward_backward(cached.batch(1, 0))["loss"]
    assert abs(plain_loss - cached_loss) < 1e-10
    assert max_difference(gradients(plain.encoder), gradients(cached.encoder)) < 1e-10


def test_two_processes_give_the_multi_positive_loss_and_gradients_of_one(
    multi, still_model: Path, tmp_path: Path
):
    config = make_config(multi, still_model, optim={"batch_size": 8}, **MULTI)
    single = make_task(config)
    batch = single.batch(0, 0)
    assert batch.positives.sum(1).max() > 2  # a query's positive from another group of the whole batch
    single_loss = single.forward_backward(batch)["loss"]
    run_in_processes(_one_step_worker, (2, _free_port(), config.model_dump_json(), str(tmp_path / "g")))
    two = safetensors.torch.load_file(str(tmp_path / "g"))
    assert abs(json.loads((tmp_path / "g.json").read_text())["loss"] - single_loss) < 1e-10
    assert max_difference(two, gradients(single.encoder)) < 1e-10


# (e) a run


def test_a_multi_positive_run_resumes_to_the_same_weights(
    multi, tiny_model: Path, tmp_path: Path, monkeypatch
):
    config = make_config(multi, tiny_model, **MULTI)
    run_training(config, tmp_path / "straight", show_progress=False)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
    assert run_training(config, tmp_path / "resumed", resume=True, show_progress=False)["step"] == 6
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    start = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(start[k], straight[k]) for k in straight if k in start)
