"""Bad input and bad options on the command line: one line naming the file and line, or the option,
exit status 2, never a traceback or a library's own message; and nothing accepted that cannot be used."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from densekit.configuration import load_config
from densekit.data import DataError
from densekit.encoding.store import EmbeddingStore
from densekit.io.fingerprint import file_digest
from densekit.training.config import TrainConfig

from .test_encoder import closed_address, point_hub_at
from .test_index import fake_store, rewrite_checksum
from .test_outputs import cli


@pytest.fixture
def unit_vectors() -> np.ndarray:
    data = np.random.default_rng(3).standard_normal((120, 16)).astype(np.float32)
    return data / np.linalg.norm(data, axis=1, keepdims=True)


def assert_one_line_error(code: int, err: str, expected: str) -> None:
    """The command stopped with status 2 and printed `expected` as its error, and nothing from Python."""
    assert code == 2, err
    assert "Traceback" not in err and "faiss::" not in err
    assert err.strip() == f"error: {expected}", err


# The command line's bounds are IndexSpec's: typer refuses these before anything is read.
@pytest.mark.parametrize(
    ("option", "value"),
    [("--nprobe", "0"), ("--nprobe", "-1"), ("--ef-search", "0"), ("--hnsw-m", "0"), ("--nlist", "0"),
     ("--ef-construction", "-5"), ("--pq-m", "0"), ("--pq-bits", "0"), ("--pq-bits", "17")],
)  # fmt: skip
def test_index_options_out_of_their_bounds_are_refused_naming_the_option(
    capsys, unit_vectors, tmp_path: Path, option: str, value: str
):
    emb = fake_store(tmp_path / "emb", unit_vectors).folder
    code, err, _ = cli(capsys, "index", emb, "-o", tmp_path / "index", "--type", "ivfpq", option, value)
    assert code == 2 and f"Invalid value for '{option}'" in err, err
    assert not (tmp_path / "index").exists()


def test_an_index_type_no_backend_builds_is_refused_naming_the_types(capsys, unit_vectors, tmp_path: Path):
    emb = fake_store(tmp_path / "emb", unit_vectors).folder
    code, err, _ = cli(capsys, "index", emb, "-o", tmp_path / "index", "--type", "ivf")
    assert_one_line_error(code, err, "--type ivf: densekit builds flat, hnsw, ivfpq, binary or int8")
    assert not (tmp_path / "index").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nlist", "121"], "--nlist 121: more inverted lists than the 120 vectors to train them on"),
        (
            ["--pq-bits", "7"],
            "--pq-bits 7: 128 centroids per sub-quantiser, more than the 120 vectors to train them on",
        ),
        (["--pq-m", "5"], "--pq-m 5: sub-quantisers must divide the dimension 16"),
    ],
)
def test_ivfpq_options_faiss_cannot_train_with_are_refused_naming_the_option(
    capsys, unit_vectors, tmp_path: Path, options: list[str], message: str
):
    emb = fake_store(tmp_path / "emb", unit_vectors).folder
    code, err, _ = cli(capsys, "index", emb, "-o", tmp_path / "index", "--type", "ivfpq", *options)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "index").exists()


def test_ivfpq_over_too_few_vectors_is_refused(capsys, unit_vectors, tmp_path: Path):
    emb = fake_store(tmp_path / "emb", unit_vectors[:77]).folder
    code, err, _ = cli(capsys, "index", emb, "-o", tmp_path / "index", "--type", "ivfpq")
    expected = "IVF-PQ needs at least 78 vectors to train its quantisers (39 per centroid), not 77"
    assert_one_line_error(code, err, f"--type ivfpq: {expected}; use flat for so few")


@pytest.fixture
def flat_index(tiny_st_model: Path, beir_dir: Path, tmp_path: Path, capsys) -> Path:
    assert cli(capsys, "encode", tiny_st_model, beir_dir, "-o", tmp_path / "emb", "--no-progress")[0] == 0
    assert cli(capsys, "index", tmp_path / "emb", "-o", tmp_path / "index", "--no-progress")[0] == 0
    return tmp_path / "index"


def test_search_options_out_of_bounds_or_unused_by_the_index_are_refused(
    capsys, tiny_st_model: Path, beir_dir: Path, flat_index: Path, tmp_path: Path
):
    search = ("search", tiny_st_model, flat_index, beir_dir, "-o", tmp_path / "run.trec", "--no-progress")
    for option in ("--nprobe", "--ef-search"):
        for value in ("0", "-3"):
            code, err, _ = cli(capsys, *search, option, value)
            assert code == 2 and f"Invalid value for '{option}'" in err, err
    code, err, _ = cli(capsys, *search, "--nprobe", "4")
    assert_one_line_error(code, err, f"--nprobe 4: only ivfpq indexes use it; {flat_index} is flat")
    code, err, _ = cli(capsys, *search, "--ef-search", "40")
    assert_one_line_error(code, err, f"--ef-search 40: only hnsw indexes use it; {flat_index} is flat")
    assert not (tmp_path / "run.trec").exists()


def test_search_with_an_unknown_model_says_so_in_one_line_at_once(
    capsys, beir_dir: Path, flat_index: Path, tmp_path: Path, monkeypatch
):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    point_hub_at(closed_address(), monkeypatch)
    started = time.monotonic()
    code, err, _ = cli(capsys, "search", "no-such/model", flat_index, beir_dir, "-o", tmp_path / "run.trec")
    assert time.monotonic() - started < 10
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: model 'no-such/model' not found: no such folder, not in the Hugging Face "
                          "cache, and the hub could not be reached (")  # fmt: skip
    assert "bundled: sentence-transformers/all-MiniLM-L6-v2 (or all-MiniLM-L6-v2)" in err


def test_search_reports_a_truncated_index_in_one_line(
    capsys, tiny_st_model: Path, beir_dir: Path, flat_index: Path, tmp_path: Path
):
    index_file = flat_index / "index.faiss"
    index_file.write_bytes(index_file.read_bytes()[:100])
    rewrite_checksum(flat_index, "index.faiss")
    code, err, _ = cli(capsys, "search", tiny_st_model, flat_index, beir_dir, "-o", tmp_path / "run.trec")
    assert code == 2 and "Traceback" not in err and "faiss::" not in err, err
    reason = r"faiss cannot read it: it is truncated or damaged \(a read got \d+ of \d+ items\)"
    assert re.fullmatch(rf"{re.escape(str(index_file))}: error: {reason}", err.strip()), err


def test_index_refuses_nan_vectors_naming_the_part_and_row(capsys, unit_vectors, tmp_path: Path):
    unit_vectors[97, 5] = np.nan
    emb = fake_store(tmp_path / "emb", unit_vectors, parts=2).folder
    code, err, _ = cli(capsys, "index", emb, "-o", tmp_path / "index", "--no-progress")
    assert code == 2 and "Traceback" not in err, err
    part = emb / "part-00001-of-00002.npy"
    assert err.strip() == f"{part}: error: row 37 (document 'doc97') holds NaN; encode the corpus again"
    assert not (tmp_path / "index").exists()


def test_an_ids_file_one_line_short_is_refused(capsys, unit_vectors, tmp_path: Path):
    emb = fake_store(tmp_path / "emb", unit_vectors).folder
    ids = emb / "part-00000-of-00001.ids"
    ids.write_text("".join(f"{line}\n" for line in ids.read_text().splitlines()[:-1]))
    meta_file = emb / "part-00000-of-00001.json"
    meta = json.loads(meta_file.read_text())
    meta["checksums"]["ids"] = file_digest(ids)  # as if written so: the checksum passes, the count does not
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DataError) as err:
        EmbeddingStore.open(emb)
    assert str(err.value) == f"{ids}: error: 119 ids for 120 rows"
    code, stderr, _ = cli(capsys, "index", emb, "-o", tmp_path / "index", "--no-progress")
    assert code == 2 and stderr.strip() == f"{ids}: error: 119 ids for 120 rows"


@pytest.mark.parametrize("keep", [0, 5, 50, 200, 4000, -1])
def test_a_truncated_npy_part_is_named_by_its_reader(unit_vectors, tmp_path: Path, keep: int):
    store = fake_store(tmp_path / "emb", unit_vectors)
    npy = store.parts[0].stem.with_suffix(".npy")
    data = npy.read_bytes()
    npy.write_bytes(data[:keep])
    for mmap in (True, False):
        with pytest.raises(DataError) as err:
            store.parts[0].vectors(mmap=mmap)
        assert str(err.value) == (
            f"{npy}: error: truncated: {len(data[:keep])} bytes, fewer than the 7808 of 120 x 16 float32 "
            "vectors; encode it again"
        )
    with pytest.raises(DataError) as err:  # found from the header, before any checksum is computed
        EmbeddingStore.open(tmp_path / "emb")
    assert str(err.value).startswith(f"{npy}: error: truncated: {len(data[:keep])} bytes, fewer than")


@pytest.mark.parametrize("score", ["nan", "inf", "-inf", "NaN"])
def test_evaluate_refuses_a_score_that_cannot_be_ranked(capsys, beir_dir: Path, tmp_path: Path, score: str):
    run = tmp_path / "run.trec"
    run.write_text(f"q1 Q0 d1 1 2.0 t\nq1 Q0 d2 2 {score} t\nq2 Q0 d4 1 1.0 t\n")
    code, err, out = cli(capsys, "evaluate", beir_dir / "qrels" / "test.tsv", run)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip() == f"{run}:2: error: score '{score}' is not a finite number: it cannot be ranked"
    assert "nDCG@10" not in out


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("data:\n  path: /d\n  train: /t.jsonl\noptim:\n  batch_size: 8\n")
    return path


def test_config_overrides_are_blamed_on_the_command_line_and_file_keys_on_their_line(config_file: Path):
    with pytest.raises(DataError) as err:
        load_config(config_file, TrainConfig, ["optim.batchsize=3"])
    assert str(err.value) == "command-line override optim.batchsize=3: Extra inputs are not permitted"
    with pytest.raises(DataError) as err:
        load_config(config_file, TrainConfig, ["optim={batch_size: 4, epoch: 2}", "data.train=/u.jsonl"])
    assert str(err.value) == (
        "command-line override optim={batch_size: 4, epoch: 2}: epoch: Extra inputs are not permitted"
    )
    config_file.write_text(config_file.read_text() + "  warmup: 0.1\n  epochs: 2\n")
    with pytest.raises(DataError) as err:
        load_config(config_file, TrainConfig, ["optim.batch_size=zero"])
    assert str(err.value).splitlines() == [
        "command-line override optim.batch_size=zero: Input should be a valid integer, unable to parse "
        "string as an integer",
        f"{config_file}:6: error: optim.warmup: Extra inputs are not permitted",
    ]
    with pytest.raises(ValueError, match=r"^command-line override optim\.lr=\[1,: malformed YAML value "):
        load_config(config_file, TrainConfig, ["optim.lr=[1,"])


def test_a_key_given_twice_in_a_config_file_is_an_error(config_file: Path):
    config_file.write_text(config_file.read_text() + "  learning_rate: 1e-5\n  batch_size: 16\n")
    with pytest.raises(DataError) as err:
        load_config(config_file, TrainConfig)
    assert str(err.value) == f"{config_file}:7: error: optim.batch_size given twice (first on line 5)"


def test_train_names_a_bad_override_as_given_on_the_command_line(capsys, config_file: Path, tmp_path: Path):
    code, err, _ = cli(capsys, "train", config_file, "--out", tmp_path / "run", "optim.batchsize=3")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip() == "command-line override optim.batchsize=3: Extra inputs are not permitted"
    assert str(config_file) not in err
    assert not (tmp_path / "run").exists()
