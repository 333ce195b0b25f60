"""The steps a recipe can run, each a typed set of parameters and the function that does it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from densekit.configuration import dump_config, validate_config
from densekit.data.dataset import Dataset
from densekit.data.pseudo_queries import PseudoQuerySettings, write_pseudo_queries
from densekit.data.query_split import split_judged_queries
from densekit.data.trec import RUN_KIND, read_run, write_run
from densekit.device import Precision, autocast, resolve_device
from densekit.diagnostics import Diagnostics
from densekit.encoding.corpus import encode_corpus, use_corpus_backend
from densekit.encoding.runtimes import Backend, InferencePrecision, torch_precision, use_backend
from densekit.encoding.store import EmbeddingStore
from densekit.evaluation import DEFAULT_MEASURES, SCORES_KIND, evaluate
from densekit.evaluation.fusion import check_fusion_settings, check_weights, fuse_runs
from densekit.index import SearchIndex, build_index
from densekit.index.registry import spec_for
from densekit.io.outputs import check_file_output, write_output_text
from densekit.limits import MAX_ROTATION_SAMPLE, MAX_RUN_DEPTH
from densekit.mining.filters import MiningSettings
from densekit.mining.mine import mine
from densekit.mining.teacher import score_examples
from densekit.models import DenseEncoder
from densekit.models.config import RotationFit
from densekit.models.cross_encoder import CrossEncoder
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.run import run_pretraining
from densekit.retrieval.bm25 import BM25Config, BM25Index
from densekit.retrieval.corpus_rotation import rotate_model
from densekit.retrieval.rerank import rerank_run
from densekit.retrieval.retriever import Retriever
from densekit.training.config import CrossEncoderTrainConfig, RunConfig, TrainConfig
from densekit.training.fine_tuning import run_cross_encoder_training, run_training

log = logging.getLogger("densekit")


# `--dimensions`: unset, a step's record reads as it did before steps took it (a finished step stays done)
DIMENSIONS: Any = Field(None, ge=1, exclude_if=lambda dimensions: dimensions is None)


def load_cut(model: str, dimensions: int | None) -> DenseEncoder:
    """The encoder `model` names, its vectors cut to their first `dimensions` (None: all of them)."""
    return DenseEncoder.load(model) if dimensions is None else DenseEncoder.load(model, dimensions=dimensions)


class Step(BaseModel):
    """Parameters common to every step.

    `run(device, show_progress, overwrite)` does the step's work; `overwrite` is set when the runner
    starts a step over (its parameters or inputs changed), and lets a folder output that densekit made
    for the step's earlier parameters be replaced. Nothing a step did not make is ever replaced.
    """

    model_config = ConfigDict(extra="forbid")
    # The step's name in its recipe, set by the runner: the tag of the runs it writes (and the name of a
    # benchmark's model), so a run tells which step made it. Not a parameter: no record holds it.
    _name: str = PrivateAttr(default="")

    @property
    def name_in_recipe(self) -> str:
        """The step's name in its recipe ("recipe" when it was made outside one)."""
        return self._name or "recipe"

    def inputs(self) -> list[str]:
        """The paths (or hub ids) the step reads; their content is part of its completion marker."""
        return []

    def outputs(self) -> list[str]:
        """The paths the step writes: its `output` (every step type has one), and what it writes beside."""
        return [self.output]  # type: ignore[attr-defined]

    def identity(self) -> dict[str, Any]:
        """What the step's file outputs record as what made them: the step's type and parameters."""
        return {"command": f"recipe step {self.type}",  # type: ignore[attr-defined]
                "settings": self.model_dump(mode="json", by_alias=True)}  # fmt: skip

    def check_device(self, device: torch.device) -> None:
        """Refuse settings `device` cannot run (fp16 on a CPU), before any step of the recipe runs."""


class MineStep(Step):
    """`densekit mine`."""

    type: Literal["mine"]
    data: str
    split: str = "train"
    examples: str | None = Field(None, description="mine for this file's queries instead of the split's")

    @model_validator(mode="after")
    def _split_or_examples(self) -> MineStep:
        if self.examples is not None and "split" in self.model_fields_set:
            raise ValueError("examples gives the queries and positives: split does not apply")
        return self

    output: str
    source: Literal["bm25", "dense", "none"] = "bm25"
    model: str | None = None
    index: str | None = Field(None, description="an index built with `model` (default: encode in memory)")
    settings: MiningSettings = MiningSettings()
    batch_size: int = 64
    domain: str | None = None

    def inputs(self) -> list[str]:
        return [self.data, *(p for p in (self.model, self.index, self.examples) if p is not None)]

    def outputs(self) -> list[str]:
        return [self.output, f"{self.output}.report.json"]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Mine and write the training file."""
        encoder = DenseEncoder.load(self.model).to(resolve_device(device)) if self.model else None
        index = Path(self.index) if self.index else None
        examples = Path(self.examples) if self.examples else None
        report = mine(Dataset.open(self.data), self.split, Path(self.output), self.source, self.settings,
                      encoder, index, batch_size=self.batch_size, show_progress=show_progress,
                      domain=self.domain, examples_file=examples, overwrite=overwrite)  # fmt: skip
        for line in mining_left_out(report, self.settings.count, f"{self.output}.report.json"):
            log.info("step %s: %s", self.name_in_recipe, line)


class PseudoQueriesStep(Step):
    """`densekit pseudo-queries`: training examples from a collection's corpus alone."""

    type: Literal["pseudo_queries"]
    data: str
    output: str
    settings: PseudoQuerySettings = PseudoQuerySettings()

    def inputs(self) -> list[str]:
        return [self.data]

    def outputs(self) -> list[str]:
        return [self.output, f"{self.output}.report.json"]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write the pseudo-queries."""
        summary = write_pseudo_queries(Dataset.open(self.data), self.settings, Path(self.output), overwrite)
        line = pseudo_queries_left_out(summary, f"{self.output}.report.json")
        if line is not None:
            log.info("step %s: %s", self.name_in_recipe, line)


class SplitQueriesStep(Step):
    """`densekit split-queries`: a few-shot split (`fit`, `held-out`) of a collection's judged queries."""

    type: Literal["split_queries"]
    data: str
    split: str = "test"
    take: int = Field(ge=1)
    seed: int = 0
    output: str

    def inputs(self) -> list[str]:
        return [self.data]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Write the split collection."""
        split_judged_queries(self.data, self.split, self.take, self.seed, Path(self.output), overwrite)


class TrainerStep(Step):
    """A run through the trainer with a config of its own, checked when the recipe is read; a killed
    step resumes from its newest checkpoint."""

    output: str
    config: dict[str, Any]
    config_type: ClassVar[type[RunConfig]]

    def validated(self, device: str = "auto", source: str = "recipe step") -> RunConfig:
        """The step's config on `device`."""
        return validate_config({"device": device, **self.config}, self.config_type, source)

    def inputs(self) -> list[str]:
        return list(self.validated().input_paths().values())

    def check_device(self, device: torch.device) -> None:
        config = self.validated(str(device))  # a `device` of the step's own config wins, as in `run`
        autocast(resolve_device(config.device), config.optim.precision)


class TrainStep(TrainerStep):
    """`densekit train`."""

    type: Literal["train"]
    config_type: ClassVar[type[RunConfig]] = TrainConfig

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Train to the end (resuming if the step was started before)."""
        run_training(self.validated(device), Path(self.output), None, show_progress, overwrite)


class TrainCrossEncoderStep(TrainerStep):
    """`densekit train-cross-encoder`."""

    type: Literal["train_cross_encoder"]
    config_type: ClassVar[type[RunConfig]] = CrossEncoderTrainConfig

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Train the cross-encoder to the end (resuming if the step was started before)."""
        run_cross_encoder_training(self.validated(device), Path(self.output), None, show_progress, overwrite)


class PretrainStep(TrainerStep):
    """`densekit pretrain`."""

    type: Literal["pretrain"]
    config_type: ClassVar[type[RunConfig]] = PretrainConfig

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Pre-train to the end (resuming if the step was started before)."""
        run_pretraining(self.validated(device), Path(self.output), None, show_progress, overwrite)


class EncodeStep(Step):
    """`densekit encode`; resumes by itself."""

    type: Literal["encode"]
    model: str
    data: str
    output: str
    batch_size: int = 64
    backend: Backend = "torch"
    precision: InferencePrecision = "float32"
    dimensions: int | None = DIMENSIONS

    def inputs(self) -> list[str]:
        return [self.model, self.data]

    def check_device(self, device: torch.device) -> None:
        autocast(device, torch_precision(self.backend, self.precision))

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Encode the corpus."""
        encoder = load_cut(self.model, self.dimensions).to(resolve_device(device))
        dataset = Dataset.open(self.data)
        precision = use_corpus_backend(encoder, self.backend, self.precision, dataset)
        encode_corpus(encoder, dataset, Path(self.output), batch_size=self.batch_size,
                      precision=precision, show_progress=show_progress, overwrite=overwrite)  # fmt: skip


class RotateStep(Step):
    """`densekit rotate`: `model` rotated onto the principal directions of the corpus vectors it made,
    with `fit: ranking` turned so that its cut `widths` rank as full width does, anchored on the
    `split` queries of the collection `queries` where given."""

    type: Literal["rotate"]
    model: str
    embeddings: str
    output: str
    sample: int = Field(100_000, ge=1, le=MAX_ROTATION_SAMPLE)
    seed: int = Field(0, ge=0)  # numpy draws from non-negative seeds only
    fit: RotationFit = "variance"
    queries: str | None = None
    split: str = "train"
    widths: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1, max_length=64)

    @field_validator("queries", "widths")
    @classmethod
    def _shape_a_ranking_fit(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("fit") == "variance":
            raise ValueError(f"{info.field_name} shape a ranking fit: add fit: ranking")
        return value

    def inputs(self) -> list[str]:
        return [self.model, self.embeddings] + ([] if self.queries is None else [self.queries])

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Fit the rotation and save the rotated model."""
        queries = None if self.queries is None else Path(self.queries)
        rotate_model(self.model, Path(self.embeddings), Path(self.output), self.sample, self.seed, overwrite,
                     self.fit, queries, self.split, self.widths)  # fmt: skip


class IndexStep(Step):
    """`densekit index`: `spec` is the backend's (its `type` and settings, by field name; faiss's
    `IndexSpec` by default), `backend` by default the one building its type."""

    type: Literal["index"]
    embeddings: str
    output: str
    # unset, the step's record reads as it did before backends were named (a finished step stays done)
    backend: str | None = Field(None, exclude_if=lambda backend: backend is None)
    spec: Any = None

    @model_validator(mode="after")
    def _backend_spec(self) -> IndexStep:
        """The spec as its backend reads it (`SpecError`, a ValueError, names a setting it refuses); none
        given is the backend's default type with its defaults."""
        given = self.spec.model_dump() if isinstance(self.spec, BaseModel) else self.spec or {}
        if not isinstance(given, dict):
            raise ValueError("spec: a mapping of the backend's settings, its type among them")
        self.spec = spec_for(given.get("type"), self.backend, {k: v for k, v in given.items() if k != "type"})
        return self

    def inputs(self) -> list[str]:
        return [self.embeddings]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Build and save the index."""
        build_index(EmbeddingStore.open(self.embeddings), self.spec, Path(self.output),
                    show_progress=show_progress, overwrite=overwrite)  # fmt: skip


class SearchStep(Step):
    """`densekit search`."""

    type: Literal["search"]
    model: str
    index: str
    data: str
    split: str = "test"
    output: str
    k: int = Field(1000, ge=1, le=MAX_RUN_DEPTH)
    batch_size: int = 64
    backend: Backend = "torch"
    precision: InferencePrecision = "float32"
    dimensions: int | None = DIMENSIONS

    def inputs(self) -> list[str]:
        return [self.model, self.index, self.data]

    def check_device(self, device: torch.device) -> None:
        autocast(device, torch_precision(self.backend, self.precision))

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Search the split's queries and write the run."""
        check_file_output(self.output, RUN_KIND, self.inputs(), self.identity(), overwrite)
        dataset = Dataset.open(self.data)
        queries, _ = dataset.split_queries(self.split)
        encoder = load_cut(self.model, self.dimensions).to(resolve_device(device))
        precision = use_backend(encoder, self.backend, self.precision, ["query"])
        retriever = Retriever(encoder, SearchIndex.load(self.index), dataset=dataset)
        run = retriever.search_run(queries, self.k, self.batch_size, precision, show_progress=show_progress)
        write_run(Path(self.output), run, tag=self.name_in_recipe, inputs=self.inputs(),
                  identity=self.identity(), overwrite=overwrite)  # fmt: skip


class BM25Step(Step):
    """`densekit bm25`."""

    type: Literal["bm25"]
    data: str
    split: str = "test"
    output: str
    k: int = Field(1000, ge=1, le=MAX_RUN_DEPTH)
    config: BM25Config = BM25Config()

    def inputs(self) -> list[str]:
        return [self.data]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Rank with BM25 and write the run."""
        check_file_output(self.output, RUN_KIND, self.inputs(), self.identity(), overwrite)
        dataset = Dataset.open(self.data)
        queries, _ = dataset.split_queries(self.split)
        write_run(
            Path(self.output),
            BM25Index.of_dataset(dataset, self.config, show_progress).search(queries, self.k),
            tag=self.name_in_recipe,
            inputs=self.inputs(),
            identity=self.identity(),
            overwrite=overwrite,
        )


class RerankStep(Step):
    """`densekit rerank`."""

    type: Literal["rerank"]
    model: str
    run_file: str = Field(alias="run")
    data: str
    split: str = "test"
    output: str
    depth: int = Field(100, ge=1)
    batch_size: int = 32
    precision: Precision = "float32"

    def inputs(self) -> list[str]:
        return [self.model, self.run_file, self.data]

    def check_device(self, device: torch.device) -> None:
        autocast(device, self.precision)

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Rerank the run's top documents and write the new run."""
        check_file_output(self.output, RUN_KIND, self.inputs(), self.identity(), overwrite)
        dataset = Dataset.open(self.data)
        queries, _ = dataset.split_queries(self.split)
        cross_encoder = CrossEncoder.load(self.model, require_head=True).to(resolve_device(device))
        first = read_run(Path(self.run_file), Diagnostics())
        reranked = rerank_run(
            cross_encoder, first, queries, dataset.iter_corpus(), self.depth, self.batch_size, show_progress,
            self.precision,
        )  # fmt: skip
        write_run(Path(self.output), reranked, tag=self.name_in_recipe, inputs=self.inputs(),
                  identity=self.identity(), overwrite=overwrite)  # fmt: skip


class FuseStep(Step):
    """`densekit fuse`."""

    type: Literal["fuse"]
    runs: list[str] = Field(min_length=2)
    output: str
    method: Literal["rrf", "linear"] = "rrf"
    weights: list[float] | None = None
    k: int | None = Field(None, ge=0)
    normalisation: Literal["minmax", "zscore"] | None = None
    depth: int = Field(1000, ge=1)

    @model_validator(mode="after")
    def _settings_of_its_method(self) -> FuseStep:
        check_fusion_settings(self.method, self.k, self.normalisation)
        check_weights(self.weights, len(self.runs))
        return self

    def inputs(self) -> list[str]:
        return list(self.runs)

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Fuse the runs and write the fused run."""
        check_file_output(self.output, RUN_KIND, self.inputs(), self.identity(), overwrite)
        diagnostics = Diagnostics()
        runs = [read_run(Path(path), diagnostics) for path in self.runs]
        fused = fuse_runs(runs, self.method, self.weights, self.k, self.normalisation, self.depth)
        write_run(Path(self.output), fused, tag=self.name_in_recipe, inputs=self.inputs(),
                  identity=self.identity(), overwrite=overwrite)  # fmt: skip


class ScoreStep(Step):
    """`densekit score`; resumes by itself."""

    type: Literal["score"]
    model: str
    examples: str
    data: str
    output: str
    batch_size: int = 32
    precision: Precision = "float32"

    def inputs(self) -> list[str]:
        return [self.model, self.examples, self.data]

    def check_device(self, device: torch.device) -> None:
        autocast(device, self.precision)

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Add the teacher's scores to the examples."""
        teacher = CrossEncoder.load(self.model, require_head=True).to(resolve_device(device))
        score_examples(teacher, Path(self.examples), Dataset.open(self.data), Path(self.output),
                       self.batch_size, show_progress=show_progress, precision=self.precision,
                       overwrite=overwrite)  # fmt: skip


class EvaluateStep(Step):
    """`densekit evaluate`: writes the aggregates as JSON keyed by ir_measures names."""

    type: Literal["evaluate"]
    data: str
    split: str = "test"
    run_file: str = Field(alias="run")
    output: str
    measures: list[str] = list(DEFAULT_MEASURES)

    def inputs(self) -> list[str]:
        return [self.data, self.run_file]

    def run(self, device: str, show_progress: bool, overwrite: bool) -> None:
        """Score the run and write the JSON."""
        check_file_output(self.output, SCORES_KIND, self.inputs(), self.identity(), overwrite)
        qrels = Dataset.open(self.data).qrels(self.split)
        scores = evaluate(qrels, read_run(Path(self.run_file), Diagnostics()), self.measures)
        write_output_text(self.output, SCORES_KIND, json.dumps(scores, indent=2) + "\n", self.identity(),
                          self.inputs(), overwrite)  # fmt: skip


STEP_TYPES: dict[str, type[Step]] = {
    "mine": MineStep, "pretrain": PretrainStep, "train": TrainStep, "encode": EncodeStep, "index": IndexStep,
    "search": SearchStep, "bm25": BM25Step, "evaluate": EvaluateStep, "rerank": RerankStep,
    "train_cross_encoder": TrainCrossEncoderStep, "score": ScoreStep, "fuse": FuseStep,
    "split_queries": SplitQueriesStep, "pseudo_queries": PseudoQueriesStep, "rotate": RotateStep,
}  # fmt: skip


def pseudo_queries_left_out(summary: dict, report_file: str) -> str | None:
    """The console's line on the documents that gave no pseudo-query, and why (None when every one gave
    one): "1,184 of 3,204 documents gave no pseudo-query (1,184 too short; see FILE)"."""
    skipped = summary["documents_without_query"]
    left = sum(skipped.values())
    if not left:
        return None
    why = ", ".join(f"{n:,} {reason}" for reason, n in skipped.items())
    return f"{left:,} of {summary['documents']:,} documents gave no pseudo-query ({why}; see {report_file})"


def mining_left_out(report: dict, count: int, report_file: str) -> list[str]:
    """The console's lines on what mining left out, and why: queries with no term of the corpus,
    candidates the filters removed, queries given fewer negatives than `count` (none when nothing was)."""
    lines = []
    queries = f"{report['queries']:,} queries"
    if report.get("queries_without_terms"):
        lines.append(f"{len(report['queries_without_terms']):,} of {queries} share no term with the corpus, "
                     f"so BM25 gave them no candidate (see {report_file})")  # fmt: skip
    removed = {"positives": report.get("removed_positive", 0),
               "with a positive's text": report.get("removed_identical_text", 0),
               "within the margin of a positive's score": report.get("removed_margin", 0)}  # fmt: skip
    if any(removed.values()):
        why = ", ".join(f"{n:,} {reason}" for reason, n in removed.items() if n)
        candidates = f"{report['candidates_in_rank_range']:,} candidates"
        lines.append(f"the filters left out {sum(removed.values()):,} of {candidates} ({why}; see "
                     f"{report_file})")  # fmt: skip
    short = report.get("queries_with_fewer_negatives_than_count", 0)
    if short:
        lines.append(f"{short:,} of {queries} got fewer than {count} negatives: too few candidates passed "
                     f"(see {report_file})")  # fmt: skip
    return lines


def describe(step: Step) -> str:
    """The step's resolved parameters, as the text its completion marker records."""
    return dump_config(step)
