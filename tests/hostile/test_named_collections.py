"""Collections by name against hostile names, folders and caches (issue 63, cases 11, 15, 16, 21, 24,
25): each refusal one line, nothing stale served, nothing hashed before it is known to be a dataset."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..test_named_data import (
    DOCS,
    _lines,
    cached,
    densekit,
    in_process,
    read_collection,
    write_mteb_layout,
)
from ..test_named_data import env as env  # the fixture: a process with its own caches and no network


def refusal(result) -> str:
    """The one line a refused command printed beside what densekit said it was doing."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


# Case 11: a local folder with a 230-character name gave a 94-line traceback (File name too long, then
# datasets' DatasetGenerationError, which was not caught); densekit's own cache names could pass 255 bytes.


def test_a_local_folder_of_a_long_name_is_refused_in_one_line(tmp_path: Path, env: dict[str, str]):
    source = write_mteb_layout(tmp_path / ("x" * 230))
    line = refusal(densekit(env, "validate", f"hf:{source}"))
    assert line.startswith("error: hf:") and "File name too long" in line and "shorter" in line
    assert "x" * 150 not in line  # the name is shortened in the message
    assert cached(env) == []


def test_cache_folder_names_stay_within_what_file_systems_allow(tmp_path: Path, monkeypatch):
    from densekit.data.named import cached_folder

    monkeypatch.setenv("DENSEKIT_CACHE", str(tmp_path / "cache"))
    local = tmp_path / ("y" * 250)
    local.mkdir()
    names = [f"hf:{'org/' + 'n' * 300}", f"irds:{'i' * 300}", f"hf:{local}", f"hf:{'a' * 300}@{'b' * 300}"]
    folders = [cached_folder(name) for name in names]
    assert all(len(folder.name.encode()) <= 255 for folder in folders), [len(f.name) for f in folders]
    assert len(set(folders)) == len(folders)
    other = cached_folder(f"hf:{'org/' + 'n' * 299}m")  # the same start, another name: another folder
    assert other != folders[0]
    assert cached_folder("irds:beir/nfcorpus/test").name == "beir_nfcorpus_test"  # short names as they were


# Case 15: a local dataset whose data_files lay outside its folder, or were hidden, was served stale
# from the cache after they changed.


def _point_corpus_at(source: Path, pattern: str) -> None:
    card = (source / "README.md").read_text()
    (source / "README.md").write_text(card.replace("path: corpus.jsonl", f"path: {pattern}"))


@pytest.mark.parametrize(
    ("place", "pattern", "says"),
    [
        ("outside/corpus.jsonl", "../outside/corpus.jsonl", "which is outside the folder"),
        ("nfmini/.hidden/corpus.jsonl", ".hidden/corpus.jsonl", "a hidden file"),
        ("nfmini/.corpus.jsonl", ".corpus.jsonl", "a hidden file"),
    ],
)
def test_data_files_the_copy_cannot_key_are_refused(tmp_path: Path, monkeypatch, place, pattern, says):
    from densekit.data.named import resolve_collection
    from densekit.errors import DensekitError

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    moved = tmp_path / place
    moved.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(source / "corpus.jsonl", moved)
    _point_corpus_at(source, pattern)
    with pytest.raises(DensekitError) as refused:
        resolve_collection(f"hf:{source}")
    assert str(refused.value) == (
        f"hf:{source}: config 'corpus' reads {pattern!r}, {says}; densekit keys its copy by the folder's "
        "own files, so it would not see that file change: move it into the folder"
    )
    assert not list((tmp_path / "densekit-cache").rglob("corpus.jsonl"))


def test_files_in_a_linked_folder_are_keyed_too(tmp_path: Path, monkeypatch):
    from densekit.data.named import resolve_collection

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    (tmp_path / "elsewhere").mkdir()
    shutil.move(source / "corpus.jsonl", tmp_path / "elsewhere" / "corpus.jsonl")
    (source / "data").symlink_to(tmp_path / "elsewhere")
    _point_corpus_at(source, "data/corpus.jsonl")
    folder = resolve_collection(f"hf:{source}")
    assert read_collection(folder)[0] == DOCS
    changed = [{"_id": "1", "title": "", "text": "a new text"}]
    (tmp_path / "elsewhere" / "corpus.jsonl").write_text(_lines(changed))
    folder = resolve_collection(f"hf:{source}")
    assert read_collection(folder)[0] == [("1", "", "a new text")]  # not the stale copy


def test_an_edited_local_folder_with_another_number_of_rows_is_read_again(tmp_path: Path, monkeypatch):
    from densekit.data.named import resolve_collection

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    folder = resolve_collection(f"hf:{source}")
    (source / "corpus.jsonl").write_text(_lines([{"_id": "1", "title": "", "text": "a new text"}]))
    folder = resolve_collection(f"hf:{source}")  # datasets kept the earlier row counts and refused
    assert read_collection(folder)[0] == [("1", "", "a new text")]


# Case 16: a file added to a cached copy (a split's judgements) was used without a check.


def test_a_file_added_to_a_cached_copy_makes_it_read_again(tmp_path: Path, monkeypatch, caplog):
    from densekit.data import Dataset
    from densekit.data.named import resolve_collection
    from densekit.diagnostics import DataError

    in_process(tmp_path, monkeypatch)
    source = write_mteb_layout(tmp_path / "nfmini")
    folder = resolve_collection(f"hf:{source}")
    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n01\t12\t1\n")
    dataset = Dataset.open(f"hf:{source}")
    assert "holds qrels/dev.tsv, which densekit did not write there" in caplog.text
    assert dataset.root == folder and not (folder / "qrels" / "dev.tsv").exists()
    with pytest.raises(DataError, match="split 'dev' not found; splits here: test, train"):
        dataset.qrels("dev")


# Case 21: failures writing densekit's cache read "ir_datasets could not read it".


def test_a_cache_that_cannot_be_written_is_named_with_its_variable(tmp_path: Path, env: dict[str, str]):
    source = write_mteb_layout(tmp_path / "nfmini")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    line = refusal(densekit(env | {"DENSEKIT_CACHE": str(blocker)}, "validate", f"hf:{source}"))
    assert line == (
        f"error: hf:{source}: densekit's cache cannot be written at {blocker}/collections/hf-local (Not a "
        f"directory; DENSEKIT_CACHE={blocker}): set DENSEKIT_CACHE to a folder densekit can write"
    )
    line = refusal(densekit(env | {"DENSEKIT_CACHE": str(blocker)}, "validate", "irds:vaswani"))
    assert line.startswith(
        f"error: irds:vaswani: densekit's cache cannot be written at {blocker}/collections/irds"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder: the refusal cannot be made")
def test_a_read_only_cache_is_named_with_its_variable(tmp_path: Path, env: dict[str, str]):
    source = write_mteb_layout(tmp_path / "nfmini")
    cache = tmp_path / "cache"
    (cache / "collections" / "hf-local").mkdir(parents=True)
    (cache / "collections" / "hf-local").chmod(0o555)
    line = refusal(densekit(env | {"DENSEKIT_CACHE": str(cache)}, "validate", f"hf:{source}"))
    assert "densekit's cache cannot be written at" in line and "Permission denied" in line


# Case 24: offline refusals were uneven.


def test_irds_offline_is_one_line_without_a_progress_bar(env: dict[str, str]):
    result = densekit(env, "validate", "irds:beir/scifact/test")
    line = refusal(result)
    assert line.startswith(
        "error: irds:beir/scifact/test: ir_datasets could not download its files (no network?)"
    )
    assert "IR_DATASETS_HOME" in line
    assert "docs_iter" not in result.stderr and "%|" not in result.stderr  # no leaked bar


def test_a_hub_dataset_without_offline_mode_fails_at_once_with_the_hint(env: dict[str, str]):
    online = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    result = densekit(online, "validate", "hf:BeIR/nfcorpus")  # the proxy refuses every connection
    line = refusal(result)
    assert line.startswith("error: hf:BeIR/nfcorpus: the Hugging Face hub cannot be reached (127.0.0.1:9: ")
    assert line.endswith("set HF_HUB_OFFLINE=1")
    assert "Retry" not in result.stderr


def test_nothing_before_the_at_is_refused_not_read_from_the_working_folder(tmp_path: Path, env):
    write_mteb_layout(tmp_path / "here")  # the working folder is a dataset densekit could read
    command = [sys.executable, "-c", "from densekit.cli import main; main()", "validate", "hf:@main"]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path / "here", timeout=120
    )
    assert refusal(result) == "error: hf:@main: no dataset is named before the '@'"
    assert cached(env) == []


@pytest.mark.parametrize("name", [f"hf:org/{'n' * 300}", f"irds:{'i' * 300}"])
def test_long_names_are_shortened_in_messages(env: dict[str, str], name: str):
    line = refusal(densekit(env, "validate", name))
    assert name[:100] in line and name not in line and f"({len(name)} characters)" in line


def test_a_local_folder_error_does_not_blame_offline_mode(tmp_path: Path, env: dict[str, str]):
    source = write_mteb_layout(tmp_path / "nfmini")
    (source / "corpus.jsonl").unlink()  # its card names a file that is not there
    line = refusal(densekit(env, "validate", f"hf:{source}"))
    assert line.startswith(f"error: hf:{source}: datasets could not load it")
    assert "HF_HUB_OFFLINE" not in line


# Case 25: `hf:<any folder>` hashed everything under it before checking that it is a dataset.


@pytest.mark.parametrize(
    "card", [None, "# notes\n", "---\nconfigs:\n- config_name: default\n  data_files: x.csv\n---\n"]
)
def test_a_folder_that_is_no_dataset_is_refused_before_its_files_are_read(tmp_path, monkeypatch, card):
    import densekit.io.fingerprint as fingerprint
    from densekit.data.named import resolve_collection
    from densekit.errors import DensekitError

    in_process(tmp_path, monkeypatch)
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "big.bin").write_bytes(os.urandom(1 << 16))
    if card is not None:
        (folder / "README.md").write_text(card)
    digested: list[Path] = []
    original = fingerprint.file_digest

    def spy(path):
        digested.append(Path(path))
        return original(path)

    monkeypatch.setattr(fingerprint, "file_digest", spy)
    if importlib.util.find_spec("densekit.data.hf_local") is not None:  # where densekit digests it now
        monkeypatch.setattr("densekit.data.hf_local.file_digest", spy)
    with pytest.raises(
        DensekitError, match=r"not in the BEIR or MTEB layout: it has no corpus or queries config"
    ):
        resolve_collection(f"hf:{folder}")
    assert [p for p in digested if p.is_relative_to(folder)] == []
