"""The quickstart: BM25 and zero-shot all-MiniLM-L6-v2 on a collection's test split (SciFact by
default), beside the published figures where the collection is one they were measured on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from densekit.data.dataset import Dataset
from densekit.device import resolve_device
from densekit.evaluation import DEFAULT_MEASURES, SCORES_KIND
from densekit.evaluation.benchmark import BenchmarkOptions, benchmark_collection
from densekit.io.artefact import write_folder_manifest
from densekit.io.outputs import claim_folder, write_output_text
from densekit.models import DenseEncoder
from densekit.models.hub import resolve_model_path

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SPLIT = "test"
KIND = "quickstart run"
DEFAULT_OUTPUT = Path("quickstart-output")
_ENTRIES = ("*.trec", "embeddings", "index", "metrics.json")


@dataclass(frozen=True)
class Published:
    """A figure from the literature to set beside ours."""

    ndcg_at_10: float
    source: str


@dataclass(frozen=True)
class Collection:
    """A collection published figures were measured on."""

    name: str
    figures: dict[str, Published]


# Recognised by the digest of their corpus, queries and test judgements (`collection_digest`), so a figure is
# shown only beside the very collection it was measured on, whatever its folder is called.
KNOWN_COLLECTIONS = {
    "sha256:a6a8a20f3effc907a27f19803ec56fcda3dc63e74140462dd1097f1a0b6f5239": Collection(
        "SciFact",
        {"BM25": Published(0.679, "pyserini reproduction matrix, Lucene flat"),
         "all-MiniLM-L6-v2": Published(0.645, "MTEB")},
    ),
    "sha256:cbad17da3889d7789a7fcfc523195b2e864fd15cf6ffd4be3bcc5fcd47356f86": Collection(
        "NFCorpus",
        {"BM25": Published(0.322, "pyserini reproduction matrix, Lucene flat"),
         "all-MiniLM-L6-v2": Published(0.316, "MTEB")},
    ),
}  # fmt: skip


@dataclass
class QuickstartResult:
    """The scores of both systems, and what they are set beside."""

    metrics: dict[str, dict[str, float]]
    collection: str
    queries: int
    published: dict[str, Published]


def default_data_dir() -> Path:
    """`../shared/data/scifact` beside the working folder or beside the project checkout."""
    checkout = Path(__file__).resolve().parents[2]
    candidates = [Path.cwd().parent / "shared/data/scifact", checkout.parent / "shared/data/scifact"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "SciFact not found at " + " or ".join(str(c) for c in candidates) + "; pass --data DIR"
    )


def collection_digest(dataset: Dataset) -> str:
    """One digest of the corpus, the queries and the test judgements."""
    files = [dataset.corpus_path, dataset.queries_path(SPLIT), dataset.qrels_path(SPLIT)]
    return dataset.digest_files(files)


def run_quickstart(
    data_dir: Path,
    output: Path,
    batch_size: int = 64,
    device: str = "auto",
    show_progress: bool = True,
    overwrite: bool = False,
    model: str = MODEL,
) -> QuickstartResult:
    """Run both systems on the test split (`benchmark_collection`); write runs and `metrics.json` under
    `output`.

    The runs, embeddings and index are kept, so a second run on the same collection (or one that was
    killed) does not encode again; an `output` holding the quickstart of another collection or model
    is refused unless `overwrite`.
    """
    output = Path(output)
    dataset = Dataset.open(data_dir)
    identity = {"data": collection_digest(dataset), "model": model}
    if claim_folder(output, KIND, identity, [data_dir], overwrite, _ENTRIES) == "new":
        output.mkdir(parents=True, exist_ok=True)
        write_folder_manifest(output, KIND, identity, {"data": str(data_dir)})
    encoder = DenseEncoder.load(model).to(resolve_device(device))
    name = Path(resolve_model_path(model)).name if model != MODEL else "all-MiniLM-L6-v2"
    options = BenchmarkOptions(SPLIT, list(DEFAULT_MEASURES), 1000, batch_size, show_progress, overwrite)
    result = benchmark_collection(encoder, name, dataset, output, options)
    metrics = result.scores
    write_output_text(output / "metrics.json", SCORES_KIND, json.dumps(metrics, indent=2) + "\n")
    known = KNOWN_COLLECTIONS.get(identity["data"])
    collection = known.name if known else dataset.root.name
    return QuickstartResult(metrics, collection, result.queries, known.figures if known else {})
