"""Faults (issue 63): a full disk, two writers on one output, kill -9 of a writer, and progress intervals
that flood a log or overflow a timer. A full disk is a small tmpfs, mounted for the test (root with
CAP_SYS_ADMIN, as CI runs; skipped, saying why, elsewhere); a second writer is a real process."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.configuration import dump_config
from densekit.encoding.store import EmbeddingStore
from densekit.io.atomic import TEMPORARY
from densekit.io.lock import LOCK_NAME, lock_file
from densekit.progress import INTERVAL_VARIABLE, progress_bar

from ..conftest import write_beir
from ..test_training import make_config
from ..training_fixtures import write_training_collection
from .commands import assert_refused, cli

FULL = "No space left on device"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mount a tmpfs of the given size in bytes under `tmp_path`; unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        if sys.platform != "linux" or shutil.which("mount") is None:
            pytest.skip("a small file system is made with Linux's mount -t tmpfs, not found here")
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)]
        made = subprocess.run(command, capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"mount -t tmpfs needs root with CAP_SYS_ADMIN (CI has them): {made.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def fill(disk: Path, leave: int = 0) -> None:
    """Fill `disk` to the brim, then free about `leave` bytes of it (to the page)."""
    reserve = disk / "reserve"
    reserve.write_bytes(b"\1" * leave)
    descriptor = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for block in (b"\1" * 65536, b"\1" * 512):
            try:
                while os.write(descriptor, block):
                    pass
            except OSError as err:
                assert err.errno == errno.ENOSPC
    finally:
        os.close(descriptor)
    reserve.unlink()


def leftovers(folder: Path) -> list[str]:
    """What a failed write may have left under `folder`: temporaries, locks, partial files."""
    return sorted(p.name for p in folder.rglob("*")
                  if TEMPORARY.match(p.name) or LOCK_NAME.match(p.name) or ".partial" in p.name)  # fmt: skip


def corpus_of(size: int, root: Path) -> Path:
    """A collection of `size` short documents."""
    documents = [
        {"_id": f"d{i}", "title": "", "text": f"document {i} of the collection"} for i in range(size)
    ]
    return write_beir(root, corpus=documents)


def densekit_process(*args, cwd: Path) -> subprocess.CompletedProcess:
    """Run `python -m densekit ARGS` in a process of its own (a SIGBUS there ends only it)."""
    command = [sys.executable, "-m", "densekit", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def one_line(result: subprocess.CompletedProcess, *expected: str) -> None:
    """`result` ended with exit status 2 and one line of error holding every `expected` fragment."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert_refused(result.returncode, result.stderr, *expected)


# Case 9: encode on a full disk died of SIGBUS (rc 135) with no message, directly and as a recipe step.


@pytest.mark.parametrize("how", ["encode", "recipe step"])
def test_9_encode_on_a_full_disk_is_one_line_naming_the_file_and_the_rerun_completes(
    capsys, small_disk, tiny_model: Path, tmp_path: Path, how: str
):
    data = corpus_of(1000, tmp_path / "data")  # 1000 x 32 float32: 128 KB of vectors
    disk = small_disk(1 << 20)
    fill(disk, leave=32 << 10)
    if how == "encode":
        args = ["encode", tiny_model, data, "-o", disk / "emb", "--device", "cpu", "--no-progress"]
    else:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f'steps:\n  emb: {{type: encode, model: "{tiny_model}", data: "{data}", '
                          'output: "{out}/emb"}\n')  # fmt: skip
        args = ["-q", "run", recipe, "--out", disk / "out", "--device", "cpu", "--no-progress"]
    one_line(densekit_process(*args, cwd=tmp_path), "part-00000-of-00001.partial.npy", FULL)
    assert leftovers(disk) == []

    (disk / "filler").unlink()
    code, err, _ = cli(capsys, *args)
    assert code == 0, err
    code, err, _ = cli(capsys, "encode", tiny_model, data, "-o", tmp_path / "reference", "--device", "cpu",
                       "--no-progress")  # fmt: skip
    assert code == 0, err
    made = disk / "emb" if how == "encode" else disk / "out" / "emb"
    for suffix in ("npy", "ids"):
        name = f"part-00000-of-00001.{suffix}"
        assert (made / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


# Case 10: train on a full disk ended in a 54-line traceback from checkpoint.py (SafetensorError).


def test_10_train_on_a_full_disk_is_one_line_naming_the_checkpoint_folder(
    capsys, small_disk, tiny_model: Path, tmp_path: Path
):
    collection = write_training_collection(tmp_path / "data")
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(make_config(collection, tiny_model, checkpoint={"every": 1})))
    disk = small_disk(8 << 20)  # the run's files fit; a checkpoint (weights, moments, model) does not
    code, err, _ = cli(capsys, "train", config, "--out", disk / "run", "--no-progress")
    assert_refused(code, err, f"{disk / 'run' / 'checkpoints' / 'step-00000001'}: {FULL}")
    assert leftovers(disk) == []
    assert list((disk / "run" / "checkpoints").iterdir()) == []


def test_10_a_training_log_line_the_disk_cannot_take_is_left_out_whole_and_named(
    capsys, small_disk, tiny_model: Path, tmp_path: Path, monkeypatch
):
    from densekit.training.trainer import Trainer

    collection = write_training_collection(tmp_path / "data")
    config = tmp_path / "config.yaml"
    tree = make_config(collection, tiny_model, optim={"max_steps": 80}, checkpoint={"every": 1000})
    config.write_text(dump_config(tree))
    disk = small_disk(1 << 20)
    real_step = Trainer._one_step

    def filling(self):
        if self.state["step"] == 2:
            fill(disk)  # the log's page has room for a few lines more; the line that needs a new one fails
        return real_step(self)

    monkeypatch.setattr(Trainer, "_one_step", filling)
    code, err, _ = cli(capsys, "train", config, "--out", disk / "run", "--no-progress")
    log = disk / "run" / "train_log.jsonl"
    assert_refused(code, err, f"{log}: {FULL}")
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 2


# Case 27 (part): disk-full errors of index and bm25 named no path; bm25 left its run without a manifest.


def test_27_index_and_bm25_on_a_full_disk_name_the_path_and_leave_nothing(capsys, small_disk, served):
    data, index, _ = served
    disk = small_disk(64 << 10)
    fill(disk)
    code, err, _ = cli(capsys, "bm25", data, "-o", disk / "bm25.trec", "--no-progress")
    assert_refused(code, err, f"{disk / 'bm25.trec'}: {FULL}")
    code, err, _ = cli(capsys, "index", index.parent / "emb", "-o", disk / "ix", "--no-progress")
    assert_refused(code, err, f"{disk / 'ix'}: {FULL}")
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_27_a_run_whose_manifest_finds_the_disk_full_is_removed_so_a_rerun_is_not_refused(
    capsys, small_disk, served, monkeypatch
):
    from densekit.io import artefact

    data, _, _ = served
    disk = small_disk(1 << 20)
    real = artefact.write_text_atomic

    def full_for_the_manifest(path, text):
        fill(disk)  # the run is written; its manifest, next, finds the disk full
        return real(path, text)

    monkeypatch.setattr(artefact, "write_text_atomic", full_for_the_manifest)
    code, err, _ = cli(capsys, "bm25", data, "-o", disk / "bm25.trec", "--no-progress")
    assert_refused(code, err, f"{disk / 'bm25.trec'}: {FULL}")
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    monkeypatch.undo()
    (disk / "filler").unlink()
    code, err, _ = cli(capsys, "bm25", data, "-o", disk / "bm25.trec", "--no-progress")
    assert code == 0, err


# Cases 12 and 23: DENSEKIT_PROGRESS_INTERVAL=1e308 killed the progress thread with an OverflowError
# traceback (exit status 0); 1e-6 printed 7,575 lines for a 9 s encode. It is 1 to 86,400 seconds.


@pytest.mark.parametrize("interval", ["1e308", "1e-6", "0.5", "86401"])
def test_12_23_a_progress_interval_out_of_range_is_refused_in_one_line(
    capsys, monkeypatch, served, tmp_path: Path, interval: str
):
    data, _, _ = served
    monkeypatch.setenv(INTERVAL_VARIABLE, interval)
    refused = pytest.raises(ValueError, match=f"{INTERVAL_VARIABLE}='{interval}'.* from 1 to 86,400")
    with refused, progress_bar("working", 3):
        pass
    code, err, _ = cli(capsys, "bm25", data, "-o", tmp_path / "b.trec")
    assert_refused(code, err, f"{INTERVAL_VARIABLE}='{interval}'", "from 1 to 86,400")


@pytest.mark.parametrize("interval", ["1", "86400"])
def test_12_23_the_bounds_of_the_progress_interval_are_taken(capsys, monkeypatch, interval):
    monkeypatch.setenv(INTERVAL_VARIABLE, interval)
    with progress_bar("working", 3) as advance:
        advance(3)
    assert "working: 3/3" in capsys.readouterr().err


# Case 17: no lock on an output. Two trains on one folder both exited 0 with an interleaved log; two
# encodes of one folder joined or deleted each other's work.


SLOWED_WRITER = """
import sys, time
from pathlib import Path
import {module} as target

real, marker = target.{function}, Path(sys.argv[1])

def slowed(*args, **kwargs):
    result = real(*args, **kwargs)
    marker.touch()  # the test goes on once something is written
    time.sleep(300)
    return result

target.{function} = slowed
from densekit.cli.main import main
sys.argv = ["densekit", *sys.argv[2:]]
main()
"""


def start_slowed_writer(tmp_path: Path, module: str, function: str, *args) -> subprocess.Popen:
    """`densekit ARGS` in a process of its own that stops for good after its first call of
    `module.function` (a checkpoint, a chunk's progress), once that call has written."""
    script, marker = tmp_path / "slowed.py", tmp_path / "written"
    script.write_text(SLOWED_WRITER.format(module=module, function=function))
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # rows add up as here
    command = [sys.executable, str(script), str(marker), *map(str, args)]
    with (tmp_path / "first-writer.log").open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not marker.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            kill_9(process)
            said = (tmp_path / "first-writer.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"the first writer ended or stalled before writing: {said}")
        time.sleep(0.1)
    return process


def kill_9(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)


def test_17_a_second_train_on_a_run_folder_is_refused_naming_the_writer_and_takes_over_once_it_is_killed(
    capsys, tiny_model: Path, tmp_path: Path
):
    collection = write_training_collection(tmp_path / "data")
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(make_config(collection, tiny_model, checkpoint={"every": 2})))
    out = tmp_path / "run"
    first = start_slowed_writer(tmp_path, "densekit.training.trainer", "save_checkpoint",
                                "train", config, "--out", out, "--no-progress")  # fmt: skip
    try:
        for flag in ("--resume", "--overwrite"):
            code, err, _ = cli(capsys, "train", config, "--out", out, flag, "--no-progress")
            assert_refused(code, err, f"another densekit (pid {first.pid}) is writing {out}")
    finally:
        kill_9(first)
    assert (out / "checkpoints" / "step-00000002").is_dir() and lock_file(out).exists()

    code, err, _ = cli(capsys, "train", config, "--out", out, "--resume", "--no-progress")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))  # resumed after step 2, each step logged once
    assert not lock_file(out).exists()


def test_17_a_second_encode_of_a_part_is_refused_and_a_killed_ones_part_is_resumed_as_one_run_makes_it(
    capsys, tiny_model: Path, tmp_path: Path
):
    data = corpus_of(24, tmp_path / "data")
    out = tmp_path / "emb"
    options = ["--device", "cpu", "--batch-size", "4", "--chunk-size", "4", "--no-progress"]
    encode = ["encode", tiny_model, data, "-o", out]
    first = start_slowed_writer(tmp_path, "densekit.encoding.corpus", "write_text_atomic",
                                *encode, "--shard", "0/2", *options)  # fmt: skip
    part = out / "part-00000-of-00002"
    try:
        assert json.loads((out / f"{part.name}.progress.json").read_text())["done"] == 4
        for extra in ([], ["--overwrite"]):
            code, err, _ = cli(
                capsys, "encode", tiny_model, data, "-o", out, "--shard", "0/2", *options, *extra
            )
            assert_refused(code, err, f"another densekit (pid {first.pid}) is writing {part}")
        code, err, _ = cli(capsys, *encode, "--shard", "1/2", *options)
        assert code == 0, err  # another shard of the folder is encoded meanwhile
    finally:
        kill_9(first)
    assert lock_file(part).exists()

    code, err, _ = cli(capsys, *encode, "--shard", "0/2", *options)
    assert code == 0 and "resuming part-00000-of-00002 at row 4 of 12" in " ".join(err.split()), err
    assert len(EmbeddingStore.open(out)) == 24
    straight = tmp_path / "straight"
    code, err, _ = cli(capsys, "encode", tiny_model, data, "-o", straight, "--shard", "0/2", *options)
    assert code == 0, err
    assert np.array_equal(np.load(out / f"{part.name}.npy"), np.load(straight / f"{part.name}.npy"))
    assert leftovers(out) == []


def test_17_a_lock_file_planted_as_a_link_is_never_written_through(tmp_path: Path):
    from densekit.io.lock import hold

    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    lock_file(tmp_path / "run").symlink_to(mine)
    with pytest.raises(OSError, match="Too many levels of symbolic links"), hold(tmp_path / "run"):
        pass
    assert mine.read_text() == "my notes"
