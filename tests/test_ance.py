"""ANCE: atomic versions, an inferencer that may die, the trainer switching versions; MaxP."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from densekit.ance.hook import AnceHook
from densekit.ance.inferencer import refresh
from densekit.ance.versions import NegativeVersions
from densekit.data import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.encoding.passages import MaxPSettings, PassageSplitter, best_passage_run
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.models import DenseEncoder
from densekit.training.examples import TrainingExample, read_examples
from densekit.training.run import run_training
from densekit.training.trainer import Trainer

from .conftest import dead_pid, write_beir
from .test_training import make_config
from .training_fixtures import write_training_collection


@pytest.fixture
def collection(tmp_path: Path) -> tuple[Path, Path]:
    return write_training_collection(tmp_path / "data")


def ance_config(collection, model: Path, **ance):
    return make_config(
        collection,
        model,
        optim={"max_steps": 6, "batch_size": 4},
        checkpoint={"every": 2, "keep": 10},
        ance={
            "enabled": True,
            "depth": 20,
            "negatives": {"first_rank": 1, "last_rank": 20, "count": 4},
            **ance,
        },
    )


def log_records(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]


def test_a_reader_never_sees_a_partial_version(tmp_path: Path):
    versions = NegativeVersions(tmp_path)
    examples = [TrainingExample(query_id=f"q{i}", query="x" * 200, positives=["d"]) for i in range(400)]
    failures: list[str] = []
    stop = threading.Event()

    def read_forever():
        while not stop.is_set():
            latest = versions.latest()
            if latest is not None:
                loaded, meta = versions.load(latest)
                if len(loaded) != len(examples) or meta["version"] != latest:
                    failures.append(f"version {latest}: {len(loaded)} examples")

    reader = threading.Thread(target=read_forever)
    reader.start()
    for version in range(25):
        versions.publish(version, examples, {"checkpoint_step": version})
    stop.set()
    reader.join()
    assert failures == []
    leftover = versions.root / f".version-000025.tmp-{dead_pid()}-0123abcd"  # what a killed publisher leaves
    leftover.mkdir()
    (leftover / "examples.jsonl").write_text('{"query_id": "q0"')
    live = versions.root / f".version-000026.tmp-{os.getpid()}-0123abcd"  # a publisher still at work
    live.mkdir()
    assert versions.latest() == 24
    assert versions.remove_partial() == 1
    assert not leftover.exists() and live.exists()


def test_refresh_samples_negatives_without_positives(collection, tiny_st_model: Path, tmp_path: Path):
    config = ance_config(collection, tiny_st_model)
    output = tmp_path / "run"
    run_training(
        config.model_copy(update={"ance": config.ance.model_copy(update={"enabled": False})}),
        output,
        show_progress=False,
    )
    versions = NegativeVersions(output)
    versions.publish(0, read_examples(Path(config.data.train)), {"checkpoint_step": 0})
    version = refresh(output, config, versions, output / "checkpoints" / "step-00000006")
    examples, meta = versions.load(version)
    assert version == 1 and meta["checkpoint_step"] == 6
    for example in examples:
        assert example.negatives and not set(example.negatives) & set(example.positives)
        assert len(example.negatives) <= 4


def test_trainer_switches_to_a_new_version_at_a_step_boundary(
    collection, tiny_st_model: Path, tmp_path: Path, monkeypatch
):
    config = ance_config(collection, tiny_st_model, inferencer="external")
    output = tmp_path / "run"
    real_step = Trainer._one_step

    def step_then_publish(self):
        figures = real_step(self)
        if self.state["step"] == 2:  # as an inferencer would, from the step-2 checkpoint
            refresh(output, config, NegativeVersions(output), output / "checkpoints" / "step-00000002")
        return figures

    monkeypatch.setattr(Trainer, "_one_step", step_then_publish)
    output.mkdir(parents=True)
    state = run_training(config, output, show_progress=False)
    records = log_records(output)
    assert [r["ance_version"] for r in records] == [0, 0, 0, 1, 1, 1]
    # the version made at step 2 is used from step 4 on: gaps of 1, 2 and 3 steps
    assert [r["ance_async_gap"] for r in records[3:]] == [1, 2, 3]
    assert state["ance_version"] == 1


def test_a_dying_inferencer_leaves_training_running(
    collection, tiny_st_model: Path, tmp_path: Path, monkeypatch, caplog
):
    config = ance_config(collection, tiny_st_model, max_restarts=2)
    output = tmp_path / "run"
    dies_mid_refresh = (
        "import os, pathlib, signal, sys;"
        f"root = pathlib.Path({str(output / 'ance')!r});"
        "partial = root / '.version-000001.tmp-dying'; partial.mkdir(exist_ok=True);"
        '(partial / \'examples.jsonl\').write_text(\'{"query_id": "q0", "qu\');'
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    monkeypatch.setattr(AnceHook, "inferencer_command", lambda self: [sys.executable, "-c", dies_mid_refresh])
    real_step = Trainer._one_step

    def slow_step(self):
        time.sleep(0.5)  # time for the inferencer to die between steps
        return real_step(self)

    monkeypatch.setattr(Trainer, "_one_step", slow_step)
    with caplog.at_level("WARNING", logger="densekit"):
        state = run_training(config, output, show_progress=False)
    assert state["step"] == 6 and (output / "model" / "densekit.json").is_file()
    assert "restarting it (1 of 2" in caplog.text and "restarting it (2 of 2" in caplog.text
    assert "was restarted 2 times already" in caplog.text
    assert {r["ance_version"] for r in log_records(output)} == {0}  # the partial version was never read


def test_local_inferencer_end_to_end(collection, tiny_st_model: Path, tmp_path: Path, monkeypatch):
    config = ance_config(collection, tiny_st_model, poll_seconds=0.2)
    output = tmp_path / "run"
    real_step = Trainer._one_step

    def wait_for_a_version(self):
        if self.state["step"] == 4:  # give the real inferencer (a subprocess) time to publish
            deadline = time.time() + 180
            while (NegativeVersions(output).latest() or 0) < 1 and time.time() < deadline:
                time.sleep(0.5)
        return real_step(self)

    monkeypatch.setattr(Trainer, "_one_step", wait_for_a_version)
    run_training(config, output, show_progress=False)
    records = log_records(output)
    assert records[-1]["ance_version"] >= 1, (output / "ance" / "inferencer.log").read_text()
    assert (output / "ance" / "STOP").exists()
    examples, _ = NegativeVersions(output).load(1)
    assert all(not set(e.negatives) & set(e.positives) for e in examples)


def test_resumed_run_starts_from_the_version_it_had(collection, tiny_st_model: Path, tmp_path: Path):
    config = ance_config(collection, tiny_st_model, inferencer="external")
    output = tmp_path / "run"
    output.mkdir()
    from densekit.training.contrastive import ContrastiveTask

    texts = {d.id: d.full_text for d in Dataset.open(config.data.path).iter_corpus()}
    examples = read_examples(Path(config.data.train))
    task = ContrastiveTask(DenseEncoder.load(tiny_st_model), examples, texts, config)
    versions = NegativeVersions(output)
    changed = [e.model_copy(update={"negatives": e.negatives[::-1][:2]}) for e in examples]
    versions.publish(0, examples, {"checkpoint_step": 0})
    versions.publish(1, changed, {"checkpoint_step": 2})
    hook = AnceHook(task, output, config.ance)
    figures = hook.before_step(3, {"step": 3, "ance_version": 1})
    assert hook.current == 1 and figures["ance_async_gap"] == 1
    assert [e.negatives for e in task.examples] == [e.negatives for e in changed]


def test_maxp_scores_a_document_by_its_best_passage(tiny_st_model: Path, tmp_path: Path):
    long_text = " ".join(f"sentence {i} about volcanoes lava and magma chambers" for i in range(40))
    corpus = [
        {"_id": "long", "title": "Geology", "text": long_text},
        {"_id": "short", "title": "Cats", "text": "cats purr and sleep"},
    ]
    root = write_beir(
        tmp_path / "data", corpus, [{"_id": "q", "text": "magma"}], {"test": [("q", "long", 1)]}
    )
    encoder = DenseEncoder.load(tiny_st_model)  # 48-token passages
    settings = MaxPSettings()
    passages = PassageSplitter(encoder, settings)(Dataset.open(root).iter_corpus().__next__())
    assert len(passages) > 3 and all(p.title == "Geology" for p in passages)
    assert all(len(encoder.tokenize([p.full_text], "passage")[0]) <= 48 for p in passages)

    encode_corpus(encoder, Dataset.open(root), tmp_path / "emb", maxp=settings, show_progress=False)
    store = EmbeddingStore.open(tmp_path / "emb")
    assert store.ids()[: len(passages)] == [p.id for p in passages]
    build_index(store, IndexSpec(), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    query = embed_texts(encoder, ["magma"], "query")
    [ranked] = index.search_run(query, ["q"], k=2).values()
    passage_scores = embed_texts(encoder, [p.full_text for p in passages], "passage") @ query[0]
    assert ranked["long"] == pytest.approx(float(np.max(passage_scores)), abs=1e-5)
    assert set(ranked) == {"long", "short"}


def test_best_passage_run_aggregates_by_maximum():
    run = {"q": {"a#p1": 0.9, "b#p0": 0.8, "a#p0": 0.95, "c#p3": 0.1}}
    best = best_passage_run(run, k=2)
    assert best == {"q": {"a": 0.95, "b": 0.8}} and list(best["q"]) == ["a", "b"]
