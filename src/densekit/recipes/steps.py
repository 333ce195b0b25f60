"""The steps a recipe can run, each a typed set of parameters and the function that does it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from densekit.configuration import dump_config, validate_config
from densekit.data.dataset import Dataset
from densekit.data.diagnostics import Diagnostics
from densekit.data.trec import read_run, write_run
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.device import resolve_device
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation import DEFAULT_MEASURES, evaluate
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.io.atomic import write_text_atomic
from densekit.mining.filters import MiningSettings
from densekit.mining.mine import mine
from densekit.models import DenseEncoder
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.run import run_pretraining
from densekit.retrieval.bm25 import BM25Config, BM25Index
from densekit.retrieval.dense import dense_search
from densekit.training.config import RunConfig, TrainConfig
from densekit.training.run import run_training


class Step(BaseModel):
    """Parameters common to every step."""

    model_config = ConfigDict(extra="forbid")

    def outputs(self) -> list[Path]:
        """What the step writes (removed before it is run again with other parameters)."""
        return [Path(self.output)]  # type: ignore[attr-defined]


class MineStep(Step):
    """`densekit mine`."""

    type: Literal["mine"]
    data: str
    split: str = "train"
    output: str
    source: Literal["bm25", "dense", "none"] = "bm25"
    model: str | None = None
    index: str | None = Field(None, description="an index built with `model` (default: encode in memory)")
    settings: MiningSettings = MiningSettings()
    batch_size: int = 64

    def run(self, device: str, show_progress: bool) -> None:
        """Mine and write the training file."""
        encoder = DenseEncoder.load(self.model).to(resolve_device(device)) if self.model else None
        index = Path(self.index) if self.index else None
        mine(Dataset.open(self.data), self.split, Path(self.output), self.source, self.settings, encoder,
             index, batch_size=self.batch_size, show_progress=show_progress)  # fmt: skip

    def outputs(self) -> list[Path]:
        return [Path(self.output), Path(f"{self.output}.report.json")]


class TrainerStep(Step):
    """A run through the trainer with a config of its own, checked when the recipe is read; a killed
    step resumes from its newest checkpoint."""

    output: str
    config: dict[str, Any]
    config_type: ClassVar[type[RunConfig]]

    def validated(self, device: str = "auto", source: str = "recipe step") -> RunConfig:
        """The step's config on `device`."""
        return validate_config({"device": device, **self.config}, self.config_type, source)


class TrainStep(TrainerStep):
    """`densekit train`."""

    type: Literal["train"]
    config_type: ClassVar[type[RunConfig]] = TrainConfig

    def run(self, device: str, show_progress: bool) -> None:
        """Train to the end (resuming if the step was started before)."""
        run_training(self.validated(device), Path(self.output), resume=True, show_progress=show_progress)


class PretrainStep(TrainerStep):
    """`densekit pretrain`."""

    type: Literal["pretrain"]
    config_type: ClassVar[type[RunConfig]] = PretrainConfig

    def run(self, device: str, show_progress: bool) -> None:
        """Pre-train to the end (resuming if the step was started before)."""
        run_pretraining(self.validated(device), Path(self.output), resume=True, show_progress=show_progress)


class EncodeStep(Step):
    """`densekit encode`; resumes by itself."""

    type: Literal["encode"]
    model: str
    data: str
    output: str
    batch_size: int = 64

    def run(self, device: str, show_progress: bool) -> None:
        """Encode the corpus."""
        encoder = DenseEncoder.load(self.model).to(resolve_device(device))
        encode_corpus(encoder, Dataset.open(self.data), Path(self.output), batch_size=self.batch_size,
                      show_progress=show_progress)  # fmt: skip


class IndexStep(Step):
    """`densekit index`."""

    type: Literal["index"]
    embeddings: str
    output: str
    spec: IndexSpec = IndexSpec()

    def run(self, device: str, show_progress: bool) -> None:
        """Build and save the index."""
        build_index(
            EmbeddingStore.open(self.embeddings), self.spec, Path(self.output), show_progress=show_progress
        )


class SearchStep(Step):
    """`densekit search`."""

    type: Literal["search"]
    model: str
    index: str
    data: str
    split: str = "test"
    output: str
    k: int = 1000
    batch_size: int = 64

    def run(self, device: str, show_progress: bool) -> None:
        """Search the split's queries and write the run."""
        queries, _ = Dataset.open(self.data).split_queries(self.split)
        encoder = DenseEncoder.load(self.model).to(resolve_device(device))
        run = dense_search(
            encoder,
            SearchIndex.load(self.index),
            queries,
            self.k,
            self.batch_size,
            show_progress=show_progress,
        )
        write_run(Path(self.output), run)


class BM25Step(Step):
    """`densekit bm25`."""

    type: Literal["bm25"]
    data: str
    split: str = "test"
    output: str
    k: int = 1000
    config: BM25Config = BM25Config()

    def run(self, device: str, show_progress: bool) -> None:
        """Rank with BM25 and write the run."""
        dataset = Dataset.open(self.data)
        queries, _ = dataset.split_queries(self.split)
        write_run(
            Path(self.output),
            BM25Index(dataset.iter_corpus(), self.config, show_progress).search(queries, self.k),
            tag="bm25",
        )


class EvaluateStep(Step):
    """`densekit evaluate`: writes the aggregates as JSON keyed by ir_measures names."""

    type: Literal["evaluate"]
    data: str
    split: str = "test"
    run_file: str = Field(alias="run")
    output: str
    measures: list[str] = list(DEFAULT_MEASURES)

    def run(self, device: str, show_progress: bool) -> None:
        """Score the run and write the JSON."""
        qrels = Dataset.open(self.data).qrels(self.split)
        scores = evaluate(qrels, read_run(Path(self.run_file), Diagnostics()), self.measures)
        write_text_atomic(Path(self.output), json.dumps(scores, indent=2) + "\n")


STEP_TYPES: dict[str, type[Step]] = {
    "mine": MineStep, "pretrain": PretrainStep, "train": TrainStep, "encode": EncodeStep, "index": IndexStep,
    "search": SearchStep, "bm25": BM25Step, "evaluate": EvaluateStep,
}  # fmt: skip


def describe(step: Step) -> str:
    """The step's resolved parameters, as the text its completion marker records."""
    return dump_config(step)
