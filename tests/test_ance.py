"""ANCE: atomic versions, an inferencer that may die, the trainer switching versions; MaxP."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.data import Dataset
from densekit.data.examples import TrainingExample, read_examples, write_examples
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.encoding.passages import MaxPSettings, PassageSplitter, best_passage_run
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.models import DenseEncoder
from densekit.training.ance.hook import AnceHook
from densekit.training.ance.inferencer import refresh, run_inferencer
from densekit.training.ance.versions import NegativeVersions
from densekit.training.checkpoint import save_checkpoint
from densekit.training.fine_tuning import run_training
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


_PARTIAL = re.compile(r"^\.version-(?P<version>\d{6})\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


def _process_state(pid: int) -> str | None:
    """A process's state letter in /proc (T: stopped, Z: dead, not yet reaped); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _wait_for_state(pid: int, wanted: set[str | None], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while _process_state(pid) not in wanted:
        assert time.monotonic() < deadline, f"process {pid} is {_process_state(pid)}, never {wanted}"
        time.sleep(0.001)


def _freeze_mid_publish(
    versions: NegativeVersions, checkpoint_step: int, seconds: float = 180
) -> tuple[int, Path, int] | None:
    """Wait for an inferencer to publish the version after the newest (from the step-`checkpoint_step`
    checkpoint), and stop it (SIGSTOP) while that version's temporary folder is there, before its
    rename: returns its pid, the folder and the version, or None when the version was published
    before it could be caught."""
    newest = versions.latest()
    if versions.load(newest)[1]["checkpoint_step"] >= checkpoint_step:
        return None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for entry in os.scandir(versions.root):
            match = _PARTIAL.match(entry.name)
            if match is None or int(match["version"]) != newest + 1 or int(match["pid"]) == os.getpid():
                continue
            pid = int(match["pid"])
            os.kill(pid, signal.SIGSTOP)
            _wait_for_state(pid, {"T", "t", "Z", None})
            if Path(entry.path).is_dir():
                return pid, Path(entry.path), newest + 1
            os.kill(pid, signal.SIGCONT)  # too late: it had renamed the folder into place
        if versions.latest() > newest:
            return None
        time.sleep(0.002)
    log = versions.root / "inferencer.log"
    raise AssertionError(
        f"no inferencer published version {newest + 1} in {seconds} s; its log:\n"
        + (log.read_text() if log.is_file() else "(none)")
    )


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_a_real_inferencer_killed_mid_publish_leaves_no_partial_version(
    collection, tiny_st_model: Path, tmp_path: Path, monkeypatch, caplog
):
    root, train = collection
    # 2,400 queries of 20 kB: writing a version takes long enough (~0.5 s) to stop the inferencer inside it
    filler = " ".join(["filler"] * 2900)
    big = [
        e.model_copy(update={"query_id": f"{e.query_id}-{i}", "query": f"{e.query} {filler}"})
        for i in range(200)
        for e in read_examples(train)
    ]
    write_examples(root / "train-big.jsonl", big)
    config = ance_config(
        (root, root / "train-big.jsonl"), tiny_st_model,
        max_restarts=0, threads=1, poll_seconds=0.1, queries_per_refresh=4,
    )  # fmt: skip
    config = config.model_copy(update={"optim": config.optim.model_copy(update={"max_steps": 8})})
    output = tmp_path / "run"
    seen: dict = {}

    def save_then_watch(folder: Path, *args, **kwargs) -> None:
        save_checkpoint(folder, *args, **kwargs)
        step = int(folder.name.split("-")[1])
        versions = NegativeVersions(output)
        if "killed_after" not in seen and step in (2, 4):
            # the trainer's local inferencer refreshes from this new checkpoint (no newer one is saved
            # before the trainer goes on): catch it inside its publish and kill it there
            caught = _freeze_mid_publish(versions, step)
            if caught is not None:
                pid, partial, version = caught
                try:  # while it is stopped halfway through writing `version`
                    assert versions.published() == list(range(version))
                    assert len(versions.load(version - 1)[0]) == len(big)
                    with pytest.raises(FileNotFoundError):
                        versions.load(version)
                finally:
                    os.kill(pid, signal.SIGKILL)
                _wait_for_state(pid, {"Z", None})  # dead; the trainer's hook reaps it
                assert partial.is_dir() and versions.published() == list(range(version))
                seen.update(killed_after=step, partial=partial, version=version)
        elif seen.get("killed_after") == step - 2:
            # an inferencer started again (in this process, as `densekit ance-infer OUT --once` would
            # run) once a newer checkpoint is saved; STOP ends it should it wait instead
            assert seen["partial"].is_dir() and versions.latest() == seen["version"] - 1
            guard = threading.Timer(120, versions.stop_file.touch)
            guard.start()
            try:
                run_inferencer(output, once=True)
            finally:
                guard.cancel()

    monkeypatch.setattr("densekit.training.trainer.save_checkpoint", save_then_watch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the inferencer on 2 cores, a trainer with 2 threads crawls
    try:
        with caplog.at_level("WARNING", logger="densekit"):
            state = run_training(config, output, show_progress=False)
    finally:
        torch.set_num_threads(threads)
    assert state["step"] == 8 and "killed_after" in seen
    killed_after, version = seen["killed_after"], seen["version"]
    said = " ".join(caplog.text.split())
    assert (
        "the ANCE inferencer exited (code -9) and was restarted 0 times already; training goes on with "
        f"version {version - 1}"
    ) in said
    left = sorted(child.name for child in NegativeVersions(output).root.iterdir())
    assert "removed 1 partial versions left by an interrupted inferencer" in said, (said, left)
    assert not seen["partial"].exists()
    # the steps while no inferencer ran trained on the last complete version, the next ones on the
    # version the inferencer started again made from the newest checkpoint
    trained = [r["ance_version"] for r in log_records(output)]
    assert all(v < version for v in trained[:killed_after])
    assert trained[killed_after:] == [version - 1] * 2 + [version] * (6 - killed_after)
    assert NegativeVersions(output).load(version)[1]["checkpoint_step"] == killed_after + 2


class _Stopped(Exception):
    """Stands for a run stopped (killed, or interrupted) right after a checkpoint."""


def test_resumed_run_starts_from_the_version_it_had(
    collection, tiny_st_model: Path, tmp_path: Path, monkeypatch, caplog
):
    config = ance_config(collection, tiny_st_model, inferencer="external")
    output = tmp_path / "run"
    real_step, real_save = Trainer._one_step, Trainer._save_checkpoint

    def step_then_publish(self):
        figures = real_step(self)
        if self.state["step"] == 2:  # version 1, standing for one made from the step-2 checkpoint
            versions = NegativeVersions(output)
            examples, _ = versions.load(0)
            changed = [e.model_copy(update={"negatives": e.negatives[::-1][:2]}) for e in examples]
            versions.publish(1, changed, {"checkpoint_step": 2})
        return figures

    def save_then_stop(self):
        real_save(self)
        if self.state["step"] == 4:
            raise _Stopped

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_one_step", step_then_publish)
        patch.setattr(Trainer, "_save_checkpoint", save_then_stop)
        with pytest.raises(_Stopped):
            run_training(config, output, show_progress=False)
    saved = json.loads((output / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert saved["ance_version"] == 1 and [r["ance_version"] for r in log_records(output)] == [0, 0, 0, 1]

    # while the run is stopped, an inferencer publishes version 2 from the newest checkpoint
    versions = NegativeVersions(output)
    assert refresh(output, config, versions, output / "checkpoints" / "step-00000004") == 2
    caplog.clear()
    with caplog.at_level("INFO", logger="densekit"):
        state = run_training(config, output, resume=True, show_progress=False)
    said = [r.getMessage() for r in caplog.records if "ANCE version" in r.getMessage()]
    # the resumed run takes the version it had back from its checkpoint (not the newest one), then
    # switches to the newer one as at any step boundary
    assert said == [
        "step 4: resuming with ANCE version 1 (from step 2)",
        "step 4: switching to ANCE version 2 (from step 4)",
    ]
    records = log_records(output)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["ance_version"] for r in records] == [0, 0, 0, 1, 2, 2]
    assert [r["ance_async_gap"] for r in records[4:]] == [0, 1]
    assert state["ance_version"] == 2


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
