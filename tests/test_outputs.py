"""Outputs: nothing densekit did not make is deleted or overwritten, inputs are never outputs, and a
kill -9 in the middle of an atomic write leaves the previous good state in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from densekit.data import DataError, Dataset, Diagnostics
from densekit.data.trec import read_run
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.io import atomic
from densekit.io.artefact import artefact_dir, read_manifest
from densekit.io.atomic import atomic_dir, exchange, remove_dead_temporaries
from densekit.io.fingerprint import file_digest, write_digested
from densekit.io.outputs import OutputError, check_file_output, claim_folder, clear_folder, write_output_text
from densekit.models import DenseEncoder

from .conftest import dead_pid
from .hostile.commands import cli as run_command


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run `densekit ARGS` as the installed command does: its exit code, and what it printed on stderr
    and on stdout, each as one line."""
    code, err, out = run_command(capsys, *args)
    return code, err.replace("\n", ""), out.replace("\n", "")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def embeddings(tiny_st_model: Path, beir_dir: Path, tmp_path: Path) -> Path:
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), tmp_path / "runs" / "emb",
                  show_progress=False)  # fmt: skip
    return tmp_path / "runs" / "emb"


# Item 1: `densekit index EMB -o PATH` deleted whatever was at PATH.


def test_index_refuses_a_users_folder_the_embeddings_and_their_parent(capsys, embeddings: Path, tmp_path):
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "chapter1.tex").write_text("years of work")
    before = {p: snapshot(p) for p in (thesis, embeddings.parent)}
    for output in (thesis, embeddings, embeddings.parent):
        code, err, _ = cli(capsys, "index", embeddings, "-o", output, "--no-progress")
        assert code == 2 and "Traceback" not in err, err
        assert str(output) in err
    assert {p: snapshot(p) for p in before} == before
    assert not list(tmp_path.glob(".*tmp-*")) and not list(embeddings.parent.glob(".*tmp-*"))


def test_index_refuses_an_existing_file_and_replaces_only_its_own_index(capsys, embeddings: Path, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    code, err, _ = cli(capsys, "index", embeddings, "-o", notes, "--no-progress")
    assert code == 2 and "is not a folder" in err and notes.read_text() == "mine"
    assert not list(tmp_path.glob(".notes.txt*"))

    index = tmp_path / "index"
    hnsw = ["index", embeddings, "-o", index, "--type", "hnsw", "--no-progress"]
    assert cli(capsys, "index", embeddings, "-o", index, "--no-progress")[0] == 0
    assert cli(capsys, *hnsw)[0] == 2 and cli(capsys, *hnsw, "--overwrite")[0] == 0
    assert SearchIndex.load(index).spec.type == "hnsw"  # an index densekit made is replaced, when asked


# Item 4: inputs are never outputs.


def test_bm25_and_evaluate_never_write_over_their_inputs(capsys, beir_dir: Path, tmp_path: Path):
    before = snapshot(beir_dir)
    code, err, _ = cli(capsys, "bm25", beir_dir, "-o", beir_dir / "corpus.jsonl", "--no-progress")
    assert code == 2 and "inside" in err and "an input" in err
    code, err, _ = cli(capsys, "bm25", beir_dir, "-o", beir_dir, "--no-progress")
    assert code == 2 and "is an input" in err
    assert snapshot(beir_dir) == before

    run = tmp_path / "run.trec"
    assert cli(capsys, "bm25", beir_dir, "-o", run, "--no-progress")[0] == 0
    written = run.read_bytes()
    qrels = beir_dir / "qrels" / "test.tsv"
    for option in ("--per-query", "--json"):
        code, err, _ = cli(capsys, "evaluate", qrels, run, option, run)
        assert code == 2 and f"{run} is an input" in err
        code, err, _ = cli(capsys, "evaluate", qrels, run, option, qrels)
        assert code == 2 and "is an input" in err
    assert run.read_bytes() == written and snapshot(beir_dir) == before


def test_a_file_output_replaces_only_what_densekit_wrote(capsys, beir_dir: Path, tmp_path: Path):
    run = tmp_path / "bm25.trec"
    assert cli(capsys, "bm25", beir_dir, "-o", run, "--k", "2", "--no-progress")[0] == 0
    assert cli(capsys, "bm25", beir_dir, "-o", run, "--k", "2", "--no-progress")[0] == 0  # its own run
    # other settings: replaced only with --overwrite (issue 50, case 8)
    assert cli(capsys, "bm25", beir_dir, "-o", run, "--k", "3", "--no-progress", "--overwrite")[0] == 0
    assert max(len(r) for r in read_run(run, Diagnostics()).values()) == 3

    run.write_text(run.read_text() + "q1 Q0 d9 9 0.1 edited-by-hand\n")  # now the user's
    code, err, _ = cli(capsys, "bm25", beir_dir, "-o", run, "--no-progress")
    assert code == 2 and "densekit did not write it" in err and "edited-by-hand" in run.read_text()

    scores = tmp_path / "scores.json"
    write_output_text(scores, "scores", "{}")
    code, err, _ = cli(capsys, "bm25", beir_dir, "-o", scores, "--no-progress")
    assert code == 2 and "holds scores, not run" in err


def test_outputs_that_cannot_be_files_or_folders_fail_before_any_work(tmp_path: Path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(OutputError, match="is a folder; give a file path"):
        check_file_output(folder, "run")
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(OutputError, match="is a file, so"):
        check_file_output(afile / "run.trec", "run")
    with pytest.raises(OutputError, match="is a file; give a folder"):
        claim_folder(afile, "embeddings", {})


def test_a_folder_of_another_run_is_refused_naming_what_differs_and_overwrite_keeps_the_users_files(
    tmp_path: Path,
):
    folder = tmp_path / "run"
    assert claim_folder(folder, "training run", {"lr": 1, "data": "a"}) == "new"
    folder.mkdir()
    (folder / "densekit-artefact.json").write_text(
        json.dumps({"kind": "training run", "identity": {"lr": 1, "data": "a"}})
    )
    (folder / "checkpoints").mkdir()
    (folder / "my-notes.txt").write_text("keep me")
    assert claim_folder(folder, "training run", {"lr": 1, "data": "a"}) == "matching"
    with pytest.raises(OutputError, match=r"differs in: data, lr\); pass --overwrite"):
        claim_folder(folder, "training run", {"lr": 2, "data": "b"})
    with pytest.raises(OutputError, match="holds training run, not embeddings"):
        claim_folder(folder, "embeddings", {}, overwrite=True)
    assert claim_folder(folder, "training run", {"lr": 2}, overwrite=True, owned=["checkpoints"]) == "new"
    assert sorted(p.name for p in folder.iterdir()) == ["my-notes.txt"]

    users = tmp_path / "users"
    users.mkdir()
    (users / "data.csv").write_text("1,2")
    with pytest.raises(OutputError, match="holds files densekit did not make"):
        claim_folder(users, "training run", {}, overwrite=True)
    assert clear_folder(users) == [] and (users / "data.csv").read_text() == "1,2"


# The atomic writer itself.

KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from densekit.io.artefact import artefact_dir

    with artefact_dir(Path(sys.argv[1]), "index", {"n": 2}) as tmp:
        (tmp / "index.faiss").write_bytes(b"new" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 halfway through the write
    """
)


def test_kill_9_during_an_index_write_leaves_the_previous_index(embeddings: Path, tmp_path: Path):
    index = tmp_path / "index"
    build_index(EmbeddingStore.open(embeddings), IndexSpec(), index, show_progress=False)
    before = snapshot(index)
    queries = np.asarray(EmbeddingStore.open(embeddings).vectors()[:2])
    expected = SearchIndex.load(index).search(queries, 3).doc_ids().tolist()

    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(index)], capture_output=True, check=False)
    assert proc.returncode == -signal.SIGKILL
    leftovers = list(tmp_path.glob(".index.tmp-*"))
    assert len(leftovers) == 1  # the killed writer's half-written folder
    assert snapshot(index) == before
    assert SearchIndex.load(index).search(queries, 3).doc_ids().tolist() == expected

    store = EmbeddingStore.open(embeddings)
    build_index(store, IndexSpec(type="hnsw"), index, show_progress=False, overwrite=True)
    assert not list(tmp_path.glob(".index.*"))  # the next writer cleared what the killed one left
    assert SearchIndex.load(index).spec.type == "hnsw"


@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_folder_is_replaced_in_one_step_where_the_system_allows(
    tmp_path: Path, monkeypatch, can_exchange: bool
):
    target = tmp_path / "index"
    with artefact_dir(target, "index", {"v": 1}) as tmp:
        (tmp / "file").write_text("old")
    if not can_exchange:
        monkeypatch.setattr(atomic, "exchange", lambda first, second: False)
    seen_absent = []
    real_replace = os.replace

    def watching_replace(source, destination):
        real_replace(source, destination)
        seen_absent.append(not target.exists())

    monkeypatch.setattr(atomic.os, "replace", watching_replace)
    with artefact_dir(target, "index", {"v": 2}) as tmp:
        (tmp / "file").write_text("new")
    assert (target / "file").read_text() == "new" and read_manifest(target).identity == {"v": 2}
    assert seen_absent == ([] if can_exchange else [True, False])
    assert not list(tmp_path.glob(".index.*"))


def test_an_old_folder_moved_aside_by_a_killed_writer_is_put_back(tmp_path: Path):
    """Where the system cannot exchange two folders, a kill between the two renames leaves the old
    folder under a temporary name; the next writer of that path puts it back."""
    moved = tmp_path / f".index.old-{dead_pid()}-0123abcd"
    moved.mkdir()
    (moved / "file").write_text("old")
    half = tmp_path / f".index.tmp-{dead_pid()}-89abcdef"
    half.mkdir()
    live = tmp_path / f".index.tmp-{os.getpid()}-deadbeef"
    live.mkdir()
    removed = remove_dead_temporaries(tmp_path, "index")
    assert removed == [half]
    assert (tmp_path / "index" / "file").read_text() == "old" and live.is_dir()


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_a_temporary_of_a_writer_that_ended_unreaped_is_removed(tmp_path: Path):
    """A killed writer stays a zombie until its parent reaps it: it writes nothing more, so what it left
    is removed, as a lock it held is taken over (the ANCE trainer reaps its inferencer only at its next
    step)."""
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{writer.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # ended, not yet reaped: os.kill(pid, 0) still finds it
    try:
        half = tmp_path / f".index.tmp-{writer.pid}-89abcdef"
        half.mkdir()
        assert remove_dead_temporaries(tmp_path, "index") == [half] and not half.exists()
    finally:
        writer.wait()


def test_exchange_swaps_two_folders(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this system cannot exchange paths")
    assert (tmp_path / "b" / "x").read_text() == "a" and not list((tmp_path / "a").iterdir())


def test_atomic_dir_refuses_what_it_may_not_replace_before_the_work(tmp_path: Path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "data").write_text("1")
    worked = []
    with pytest.raises(FileExistsError, match="densekit did not make"), atomic_dir(users):
        worked.append(1)
    with pytest.raises(FileExistsError, match="densekit did not make"), artefact_dir(users, "index", {}):
        worked.append(1)
    assert worked == [] and (users / "data").read_text() == "1"


def test_damaged_or_missing_manifests_are_errors_naming_the_file(tmp_path: Path):
    (tmp_path / "densekit-artefact.json").write_text("{not json")
    with pytest.raises(DataError, match=r"densekit-artefact\.json: error: not a readable densekit manifest"):
        read_manifest(tmp_path)


def test_an_output_of_the_wrong_shape_fails_in_one_line_before_any_work(
    capsys, tiny_st_model: Path, beir_dir: Path, tmp_path: Path, monkeypatch
):
    """A folder where a file is written, or a file where a folder is, fails at once, naming the path."""
    folder, afile = tmp_path / "a-folder", tmp_path / "a-file"
    folder.mkdir()
    afile.write_text("x")
    encode_calls = []
    monkeypatch.setattr("densekit.encoding.corpus.embed_texts", lambda *a, **k: encode_calls.append(1))
    qrels = beir_dir / "qrels" / "test.tsv"
    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 d1 1 1.0 t\n")
    config = tmp_path / "train.yaml"
    config.write_text(f"data: {{path: {beir_dir}, train: {tmp_path / 'examples.jsonl'}}}\n")
    (tmp_path / "examples.jsonl").write_text('{"query_id": "q1", "query": "a", "positives": ["d1"]}\n')
    commands = [
        (["bm25", beir_dir, "-o", folder], f"{folder} is a folder"),
        (["evaluate", qrels, run, "--json", folder], f"{folder} is a folder"),
        (["search", tiny_st_model, tmp_path / "no-index", beir_dir, "-o", folder], f"{folder} is a folder"),
        (["mine", beir_dir, "--split", "test", "-o", folder], f"{folder} is a folder"),
        (["encode", tiny_st_model, beir_dir, "-o", afile, "--device", "cpu"], f"{afile} is a file"),
        (["train", config, "--out", afile], f"{afile} is a file"),
        (["quickstart", "--data", beir_dir, "--out", afile], f"{afile} is a file"),
    ]
    for args, message in commands:
        quiet = [] if args[0] == "evaluate" else ["--no-progress"]
        code, err, _ = cli(capsys, *args, *quiet)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    assert encode_calls == [] and afile.read_text() == "x" and list(folder.iterdir()) == []


def test_a_run_refused_for_bad_input_leaves_no_folder_behind(capsys, beir_dir: Path, tmp_path: Path):
    examples = tmp_path / "examples.jsonl"
    examples.write_text('{"query_id": "q1", "query": "a", "positives": ["d1"], "negatives": ["d1"]}\n')
    config = tmp_path / "train.yaml"
    config.write_text(f"data: {{path: {beir_dir}, train: {examples}}}\n")
    code, err, _ = cli(capsys, "train", config, "--out", tmp_path / "run", "--no-progress")
    assert code == 2 and "examples.jsonl:1: error: document 'd1' is both a positive and a negative" in err
    assert not (tmp_path / "run").exists()
    pretrain = tmp_path / "pretrain.yaml"
    pretrain.write_text(f"data: {{path: {tmp_path / 'no-such-corpus.txt'}}}\n")
    code, err, _ = cli(capsys, "pretrain", pretrain, "--out", tmp_path / "pre", "--no-progress")
    assert code == 2 and "no-such-corpus.txt" in err and not (tmp_path / "pre").exists()


def test_a_digest_taken_while_writing_is_the_written_file_s_and_a_failed_writer_stops_its_hasher(
    tmp_path: Path,
):
    blocks = [bytes(range(256)) * 4096, b"", b"tail"]

    def write_all(write):
        for block in blocks:
            write(block)

    path = tmp_path / "file.bin"
    assert write_digested(path, write_all) == file_digest(path)
    assert path.read_bytes() == b"".join(blocks)

    threads = threading.active_count()

    def fail(write):
        write(b"start")
        raise OSError("no space left on device")

    with pytest.raises(OSError, match="no space"):
        write_digested(tmp_path / "failed.bin", fail)
    assert threading.active_count() == threads


def test_an_index_s_saved_checksum_is_that_of_its_file(embeddings: Path, tmp_path: Path):
    store = EmbeddingStore.open(embeddings)
    build_index(store, IndexSpec(type="flat"), tmp_path / "index", show_progress=False)
    manifest = read_manifest(tmp_path / "index")
    files = sorted(p.name for p in (tmp_path / "index").iterdir() if p.name != "densekit-artefact.json")
    assert sorted(manifest.checksums) == files
    assert all(manifest.checksums[name] == file_digest(tmp_path / "index" / name) for name in files)
