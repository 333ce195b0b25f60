"""Shared fixtures: tiny random models built once per session, and collections written on demand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from densekit.models.hub import resolve_model_path

if TYPE_CHECKING:
    from densekit.retrieval.retriever import Retriever

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest -n: the cores shared among the workers, and the same number for the processes a test starts
    # (a run resumed in the test's process must add up in the order the killed one did)
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)
_BROWSER_OUTCOMES: list[tuple[str, str]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    """--device: run the tests marked `cuda` on that device (`cuda` on a GPU machine; `cpu` to check the
    tests themselves); without it they are skipped, so CI never needs a GPU."""
    parser.addoption("--device", default=None, help="run the tests marked cuda on this device (cuda, cpu)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the `cuda` marker."""
    config.addinivalue_line("markers", "cuda: depends on the device; runs only with --device (e.g. cuda)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked `cuda` without --device, or with a GPU asked for that torch does not see."""
    device = config.getoption("--device")
    if device is None:
        reason = "marked cuda: run with --device cuda on a GPU machine"
    elif torch.device(device).type == "cuda" and not torch.cuda.is_available():
        reason = f"--device {device}, but torch sees no GPU"
    else:
        return
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def run_device(request: pytest.FixtureRequest) -> torch.device:
    """The device --device names, for the tests marked `cuda`."""
    return torch.device(request.config.getoption("--device") or "cpu")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep the outcome of each browser test, for the summary."""
    if "browser" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _BROWSER_OUTCOMES.append((report.nodeid, report.outcome))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name each browser test's outcome, so a log shows the search page was tested, not skipped."""
    for nodeid, outcome in _BROWSER_OUTCOMES:
        terminalreporter.write_line(f"browser test {outcome}: {nodeid}")


MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def tiny_bert(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """Save a randomly initialised small BERT with the bundled MiniLM tokenizer at `path`."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MINILM))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain Hugging Face BERT folder (no sentence-transformers files)."""
    return tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "model")


@pytest.fixture(scope="module")
def collection(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small training collection (`training_fixtures`) and its training examples."""
    from .training_fixtures import write_training_collection

    return write_training_collection(tmp_path_factory.mktemp("train") / "data")


@pytest.fixture(scope="module")
def still_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT without dropout, for comparisons that must not depend on random masks."""
    path = tiny_bert(tmp_path_factory.mktemp("still") / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_st_model(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny BERT as a sentence-transformers folder: mean pooling, normalised, 48 tokens, prompts."""
    path = tmp_path_factory.mktemp("tiny-st") / "model"
    shutil.copytree(tiny_model, path)
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    (path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "document": "passage: "}})
    )
    return path


CORPUS = [
    {"_id": "d1", "title": "Cats", "text": "Cats are small domesticated carnivorous mammals."},
    {"_id": "d2", "title": "Dogs", "text": "Dogs were domesticated from wolves thousands of years ago."},
    {"_id": "d3", "title": "", "text": "The stock market fell sharply on Monday amid inflation fears."},
    {"_id": "d4", "title": "Python", "text": "Python is a programming language that emphasises readability."},
    {"_id": "d5", "title": "Photosynthesis", "text": "Plants convert light energy into chemical energy."},
    {"_id": "d6", "title": "Volcanoes", "text": "A volcano is a rupture in the crust of a planet."},
    {"_id": "q3", "title": "Whales", "text": "Whales are large marine mammals that breathe air."},
    {"_id": "d8", "title": "Rust", "text": "Rust is a programming language focused on memory safety."},
]
QUERIES = [
    {"_id": "q1", "text": "which mammals were domesticated"},
    {"_id": "q2", "text": "programming language readability"},
    {"_id": "q3", "text": "marine mammals that breathe air"},
    {"_id": "q4", "text": "how do plants make energy from light"},
]
QRELS = {"test": [("q1", "d1", 1), ("q1", "d2", 2), ("q2", "d4", 1), ("q3", "q3", 1), ("q4", "d5", 1)],
         "train": [("q2", "d8", 1)]}  # fmt: skip


def write_beir(
    root: Path,
    corpus: list[dict] = CORPUS,
    queries: list[dict] = QUERIES,
    qrels: dict[str, list[tuple]] = QRELS,
) -> Path:
    """Write a BEIR folder at `root` and return it."""
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    for split, rows in qrels.items():
        lines = ["query-id\tcorpus-id\tscore"] + ["\t".join(str(c) for c in row) for row in rows]
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def beir_dir(tmp_path: Path) -> Path:
    """A small valid BEIR collection; query q3 is also a document, as in some BEIR sets."""
    return write_beir(tmp_path / "beir")


@pytest.fixture
def make_beir(tmp_path: Path) -> Callable[..., Path]:
    """Write a BEIR folder with some parts replaced."""
    return lambda **parts: write_beir(tmp_path / "custom", **parts)


def dead_pid() -> int:
    """The id of a process that has ended, as a killed writer's temporaries carry."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def shared_collection(name: str) -> Path:
    """A collection from ../shared/data; the test is skipped, saying why, where it is absent."""
    path = SHARED_DATA / name
    if not (path / "corpus.jsonl").is_file():
        pytest.skip(f"{path} not found: the shared test collections sit beside the repository")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_st_model: Path) -> tuple[Path, Path, Path]:
    """A collection, its index by the tiny model, and the model: (data, index, model)."""
    from densekit.data.dataset import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.encoding.store import EmbeddingStore
    from densekit.index import IndexSpec, build_index
    from densekit.models import DenseEncoder

    root = tmp_path_factory.mktemp("served")
    data = write_beir(root / "data")
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(data), root / "emb", show_progress=False)
    build_index(
        EmbeddingStore.open(root / "emb"), IndexSpec(type="flat"), root / "index", show_progress=False
    )
    return data, root / "index", tiny_st_model


@pytest.fixture(scope="module")
def retriever(served: tuple[Path, Path, Path]) -> Retriever:
    """A retriever over the `served` collection, on the CPU."""
    from densekit.retrieval.retriever import Retriever

    data, index, model = served
    return Retriever.open(str(model), index, corpus=data, device="cpu")
