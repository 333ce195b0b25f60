"""Every option of a training run, in one YAML file; any of them overridable as `section.key=value`."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from densekit.encoding.passages import MaxPSettings
from densekit.mining.filters import MiningSettings
from densekit.models.config import Pooling, Widths
from densekit.models.modules.kinds.lora import LoraSpec
from densekit.models.modules.specs import ModuleSpec
from densekit.routing.router import TopK
from densekit.routing.strategies import RouteSpec, TrainableType, strategy_named
from densekit.training.groups import Shortfall
from densekit.training.trackers import TrackerName

NORMALIZED_TEMPERATURE = 0.05
INNER_PRODUCT_TEMPERATURE = 1.0


class Section(BaseModel):
    """A config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class ModelSection(Section):
    """The encoder to start from; unset settings keep what the model folder says."""

    path: str = "sentence-transformers/all-MiniLM-L6-v2"
    pooling: Pooling | None = None
    normalize: bool | None = None
    query_max_length: int | None = Field(None, gt=0)
    passage_max_length: int | None = Field(None, gt=0)
    query_prefix: str | None = None
    passage_prefix: str | None = None
    tied: bool | None = Field(None, description="one backbone for both (true) or two towers (false)")
    trust_remote_code: bool = False


class DataSection(Section):
    """Where the examples and the texts they name are."""

    path: str = Field(description="the collection folder whose corpus the examples' ids refer to")
    train: str = Field(description="training examples (JSONL), e.g. from `densekit mine`")
    group_size: int = Field(
        2, ge=1, description="passages per query: data.positives positives + the rest hard negatives"
    )
    positives: int = Field(
        1,
        ge=1,
        description="positives per group, first in it: each epoch takes the next of the example's positives "
        "(a seeded order), cycling them when it has fewer; more than 1 needs loss.multi_positive (queries "
        "with many judged documents, as NFCorpus's ~40 per training query)",
    )
    shortfall: Shortfall = Field(
        "error", description="examples with too few negatives: error, repeat, random"
    )
    length_grouping: int | None = Field(
        None,
        ge=1,
        description="batches per length bucket: each bucket of that many batches' random examples is "
        "sorted by passage length and cut into batches, which are then shuffled (less padding); none: "
        "random batches",
    )
    batches: Literal["mixed", "by_domain"] = Field(
        "mixed", description="by_domain: every batch from one domain (the examples' domain field)"
    )
    collections: dict[str, str] = Field(
        default_factory=dict,
        description="more collections by domain: an example of one of these domains names documents of that "
        "collection instead of data.path's (training on several collections at once)",
    )
    passage_embeddings: list[str] = Field(
        default_factory=list,
        description="embedding folders (`densekit encode` with the base) of data.path's corpus and of each "
        "of data.collections': passages are looked up there instead of encoded at each step; only for runs "
        "whose passages stay the base's (a route, a hypernetwork, a module with towers: query)",
    )

    @model_validator(mode="after")
    def _positives_fit(self) -> DataSection:
        if self.positives > self.group_size:
            raise ValueError(
                f"data.positives {self.positives} is more than data.group_size {self.group_size}: a group "
                "holds its positives and then its negatives"
            )
        return self

    @model_validator(mode="after")
    def _one_grouping(self) -> DataSection:
        if self.batches == "by_domain" and self.length_grouping is not None:
            raise ValueError(
                "data.batches by_domain and data.length_grouping: choose one way to group batches"
            )
        return self


class MatryoshkaSection(Section):
    """Matryoshka training (Kusupati et al., 2022): the loss is also taken on the first d dimensions of
    the vectors for each d, so that they serve as smaller vectors."""

    dims: Widths = Field(
        description="the widths trained for, widest first, each at most the model's (e.g. [384, 256, 128, "
        "64]); the vectors cut to each are normalised again where the model normalises",
    )
    weights: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        None, description="each width's loss weight, in the order of dims; none: 1 each"
    )
    score_alignment: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="weight of each narrower width's score alignment: the KL divergence from the widest "
        "width's in-batch score distribution (held fixed) to its own, added to that width's loss "
        "(Starbucks' score alignment, Zhuang et al., 2024); 0: none",
    )

    @model_validator(mode="after")
    def _a_weight_per_width(self) -> MatryoshkaSection:
        if self.weights is not None and len(self.weights) != len(self.dims):
            raise ValueError(
                f"weights: {len(self.weights)} given for {len(self.dims)} dims; give one per width, in order"
            )
        if self.score_alignment > 0 and len(self.dims) < 2:
            raise ValueError("score_alignment aligns narrower widths with the widest: give at least two dims")
        return self

    def weighted(self) -> list[tuple[int, float]]:
        """Each width with its weight, widest first."""
        return list(zip(self.dims, self.weights or [1.0] * len(self.dims), strict=True))


class LossSection(Section):
    """InfoNCE over in-batch and hard negatives, and distillation from a teacher's scores."""

    temperature: float | None = Field(
        None,
        gt=0,
        description="scores are divided by it; default 0.05 for normalised embeddings (cosine similarity), "
        "1.0 for raw inner products (DPR)",
    )
    cross_device_negatives: bool = Field(True, description="gather passages from every process")
    mask_false_negatives: bool = Field(
        True,
        description="leave a query's other known positives (and copies of its positive) out of its negatives",
    )
    multi_positive: bool = Field(
        False,
        description="a query's loss is the mean of one InfoNCE term per distinct known positive in the batch "
        "(its group's data.positives and any other passage among its positives, a repeat counted once), each "
        "against the batch's passages that are not its positives; false: its group's first passage is the "
        "one target. For queries with many judged positives (NFCorpus), with data.positives > 1",
    )

    distillation: Literal["none", "margin_mse", "kl"] = Field(
        "none",
        description="learn from the examples' teacher_scores: margin_mse (Hofstaetter et al.: the "
        "student's positive-negative margins regress on the teacher's) or kl (the teacher's softmax over "
        "the group as the student's target)",
    )
    distillation_weight: float = Field(1.0, ge=0, description="the distillation term's weight")
    contrastive_weight: float = Field(
        1.0, ge=0, description="InfoNCE's weight; 0 with a distillation trains on the teacher alone"
    )
    teacher_temperature: float = Field(1.0, gt=0, description="kl: the teacher's scores are divided by it")
    matryoshka: MatryoshkaSection | None = Field(
        None,
        exclude_if=lambda section: section is None,  # unset, a run's records read as before it existed
        description="Matryoshka training: the weighted sum of the loss (InfoNCE and distillation) on the "
        "first d dimensions of the vectors for each width d of dims; none: the full vectors alone",
    )

    @model_validator(mode="after")
    def _something_to_learn(self) -> LossSection:
        if self.contrastive_weight == 0 and self.distillation == "none":
            raise ValueError("loss.contrastive_weight 0 with loss.distillation none: nothing to train on")
        return self

    def temperature_for(self, normalized: bool) -> float:
        """The temperature a run uses: the one set, or the default for (un)normalised embeddings."""
        if self.temperature is not None:
            return self.temperature
        return NORMALIZED_TEMPERATURE if normalized else INNER_PRODUCT_TEMPERATURE


class OptimSection(Section):
    """AdamW with linear warm-up and decay."""

    learning_rate: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_ratio: float = Field(0.1, ge=0, le=1)
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop after this many steps (overrides epochs)")
    batch_size: int = Field(32, ge=1, description="queries per step across all processes")
    grad_accumulation: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    precision: Literal["float32", "bf16", "fp16"] = "float32"


class GradCacheSection(Section):
    """Gradient caching: encode the batch in chunks, replaying dropout, for the memory of one chunk."""

    enabled: bool = False
    chunk_size: int = Field(32, ge=1, description="texts (queries or passages) through the model at once")


class EvalSection(Section):
    """Evaluation on a held-out split during training; the best checkpoint is kept."""

    split: str | None = Field(None, description="qrels split to evaluate on; none: no evaluation")
    every: int | None = Field(None, gt=0, description="steps between evaluations (default: each epoch)")
    metric: str = Field("nDCG@10", description="an ir_measures name; aliases (MRR@10) become its own (RR@10)")
    batch_size: int = Field(64, ge=1)

    @field_validator("metric")
    @classmethod
    def _known_measure(cls, name: str) -> str:
        from densekit.evaluation.measures import parse_measures

        return str(parse_measures([name])[0])


class AnceSection(Section):
    """ANCE: negatives from an index an inferencer refreshes from the trainer's newest checkpoint.

    The trainer's checkpoints (every `checkpoint.every` steps) are what the inferencer reads; the
    examples of `data.train` are version 0 (BM25 or a given model's mined negatives: the warm start).
    """

    enabled: bool = False
    inferencer: Literal["local", "external"] = Field(
        "local", description="local: the trainer starts and watches one; external: run `densekit ance-infer`"
    )
    depth: int = Field(200, gt=0, description="documents retrieved per training query")
    negatives: MiningSettings = MiningSettings(first_rank=1, last_rank=200, count=16)
    queries_per_refresh: int | None = Field(None, gt=0, description="refresh a rotating part (default: all)")
    max_restarts: int = Field(3, ge=0, description="times a dead local inferencer is started again")
    threads: int | None = Field(None, gt=0, description="torch threads of a local inferencer")
    poll_seconds: float = Field(2.0, gt=0)
    batch_size: int = Field(64, gt=0, description="texts per encoding batch in the inferencer")
    maxp: MaxPSettings | None = Field(
        None, description="index passages of long documents (MaxP); default FirstP"
    )


class RouteSection(Section):
    """Train a router among saved query-only modules on the frozen base: the modules and the base stay as
    they are; only the router learns, from the retrieval loss and a load-balancing term. Its type and k
    are a route spec's (`densekit.routing.strategies`), checked by that spec."""

    type: TrainableType = "soft"
    modules: dict[str, str] = Field(
        min_length=2, description="module name -> its saved folder (towers: query)"
    )
    k: TopK = None
    load_balancing: float = Field(
        0.01,
        ge=0,
        description="soft, top_k: weight of Switch Transformer's load-balancing loss, against collapse",
    )

    def spec(self) -> RouteSpec:
        """The route this section trains: its type and k over its modules, in their order."""
        return RouteSpec(type=self.type, modules=list(self.modules), k=self.k)

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> RouteSection:
        self.spec()
        if not strategy_named(self.type).balanced and "load_balancing" in self.model_fields_set:
            raise ValueError(f"route.load_balancing: a {self.type} has no load-balancing term")
        return self


class HypernetworkSection(Section):
    """Train a hypernetwork that generates a query-only LoRA module per domain from a learned domain
    embedding, across every domain of the examples at once (needs data.batches by_domain)."""

    lora: LoraSpec = LoraSpec(rank=8, towers="query")
    embedding: int = Field(16, gt=0, description="size of a domain's embedding")
    start: str | None = Field(
        None, description="a trained hypernetwork's folder: fit a new domain's embedding on it (new_domain)"
    )
    new_domain: str | None = Field(None, description="with start: the domain whose embedding alone is fitted")

    @model_validator(mode="after")
    def _start_and_new_domain(self) -> HypernetworkSection:
        if (self.start is None) != (self.new_domain is None):
            raise ValueError("hypernetwork.start and hypernetwork.new_domain go together")
        return self


class CheckpointSection(Section):
    """How often to save and how many checkpoints to keep."""

    every: int = Field(500, gt=0)
    keep: int = Field(2, ge=1)


class RunConfig(Section):
    """What every run through the trainer has: optimisation, caching, checkpoints, seed, device, log."""

    # Keys a resumed run may change: where and how it runs, never what it computes (gradient caching
    # gives the gradients of the whole batch whatever its chunks).
    RESUMABLE_CHANGES: ClassVar[tuple[str, ...]] = (
        "device", "log_every", "checkpoint.keep", "grad_cache", "eval.batch_size", "report_to",
        "ance.threads", "ance.poll_seconds", "ance.max_restarts", "ance.batch_size",
    )  # fmt: skip

    optim: OptimSection = OptimSection()
    grad_cache: GradCacheSection = GradCacheSection()
    checkpoint: CheckpointSection = CheckpointSection()
    seed: int = 42
    device: str = "auto"
    log_every: int = Field(10, gt=0)
    report_to: list[TrackerName] = Field(
        default_factory=list,
        description="experiment trackers that get the training log's scalars and the config: tensorboard, "
        "mlflow, wandb (each an optional extra, e.g. pip install 'densekit[tensorboard]'); none by default",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_or_none(cls, value: object) -> object:
        """One name stands for a list of it, and `none` (as Hugging Face's trainer takes it) for none."""
        if isinstance(value, str):
            return [] if value == "none" else [value]
        return value

    def input_paths(self) -> dict[str, str]:
        """The run's inputs by their config keys (the model is a folder or a hub id)."""
        return {}


class TrainConfig(RunConfig):
    """A contrastive fine-tuning run."""

    model: ModelSection = ModelSection()
    data: DataSection
    loss: LossSection = LossSection()
    eval: EvalSection = EvalSection()
    ance: AnceSection = AnceSection()
    modules: ModuleSpec | None = Field(
        None, description="train this module on the frozen model instead of the whole model (docs/modules.md)"
    )
    route: RouteSection | None = Field(
        None, description="train a router among saved modules on the frozen model (docs/routing.md)"
    )
    hypernetwork: HypernetworkSection | None = Field(
        None, description="train a hypernetwork generating a module per domain (docs/routing.md)"
    )

    def input_paths(self) -> dict[str, str]:
        """The starting model, the collection, the training examples and the modules routed among."""
        paths = {"model.path": self.model.path, "data.path": self.data.path, "data.train": self.data.train}
        paths.update({f"data.collections.{domain}": path for domain, path in self.data.collections.items()})
        paths.update({f"data.passage_embeddings[{i}]": p for i, p in enumerate(self.data.passage_embeddings)})
        if self.hypernetwork is not None and self.hypernetwork.start is not None:
            paths["hypernetwork.start"] = self.hypernetwork.start
        if self.route is not None:
            paths.update({f"route.modules.{name}": folder for name, folder in self.route.modules.items()})
        return paths

    @model_validator(mode="after")
    def _one_thing_to_train(self) -> TrainConfig:
        chosen = [name for name in ("modules", "route", "hypernetwork") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ValueError(f"set one of modules, route and hypernetwork, not {' and '.join(chosen)}")
        if self.hypernetwork is not None and self.data.batches != "by_domain":
            raise ValueError(
                "hypernetwork: set data.batches to by_domain (each batch trains one domain's module)"
            )
        if self.data.positives > 1 and not self.loss.multi_positive:
            raise ValueError(
                "data.positives > 1 needs loss.multi_positive: with one target per query, the group's other "
                "positives would only be masked out of its negatives"
            )
        if self.data.positives > 1 and self.loss.distillation != "none":
            raise ValueError(
                "data.positives > 1 with loss.distillation: the teacher's scores are compared group by group "
                "with one positive first; use data.positives 1"
            )
        if self.loss.multi_positive and not self.loss.mask_false_negatives:
            raise ValueError(
                "loss.multi_positive leaves every known positive of a query out of the negatives of each of "
                "its terms; it does not combine with loss.mask_false_negatives false"
            )
        if self.ance.enabled and self.data.collections:
            raise ValueError("ance with data.collections: the inferencer indexes data.path's corpus only")
        routed = self.route is not None or self.hypernetwork is not None
        if self.loss.matryoshka is not None and routed:
            raise ValueError(
                f"loss.matryoshka with {chosen[-1]}: Matryoshka training trains a model's (or a module's) "
                "vectors for the widths it saves; a route or hypernetwork saves none"
            )
        if self.ance.enabled and (routed or self.data.batches == "by_domain"):
            raise ValueError(
                "ance refreshes the negatives of a whole model or module run; it does not combine with "
                "route, hypernetwork or data.batches by_domain"
            )
        frozen = routed or (self.modules is not None and self.modules.towers == "query")
        if self.data.passage_embeddings and not frozen:
            raise ValueError(
                "data.passage_embeddings: this run changes how passages are encoded, so they must be "
                "encoded at each step; saved vectors serve only runs whose passages stay the base's "
                "(a route, a hypernetwork, or a module with towers: query)"
            )
        if self.data.passage_embeddings and self.data.length_grouping is not None:
            raise ValueError(
                "data.passage_embeddings with data.length_grouping: grouping sorts batches by passage length "
                "to cut padding, and saved passage vectors are not padded"
            )
        if self.data.passage_embeddings and self.ance.enabled:
            raise ValueError("data.passage_embeddings with ance: ANCE re-encodes the corpus as it trains")
        if routed and self.eval.split is not None:
            raise ValueError(
                f"eval.split with {chosen[-1]}: evaluation during training encodes without it; evaluate "
                "what the run saves instead (`densekit search` or `benchmark`)"
            )
        return self

    @model_validator(mode="after")
    def _chunks_fit(self) -> TrainConfig:
        if self.grad_cache.enabled and self.grad_cache.chunk_size > self.optim.batch_size:
            raise ValueError("grad_cache.chunk_size is larger than optim.batch_size")
        return self


class CrossEncoderModelSection(Section):
    """The model a cross-encoder starts from: an encoder (a new one-score head) or a cross-encoder."""

    path: str = "sentence-transformers/all-MiniLM-L6-v2"
    max_length: int | None = Field(
        None, gt=0, description="tokens per (query, passage) pair, the passage cut first; default the "
        "model's limit, at most 512"
    )  # fmt: skip
    trust_remote_code: bool = False


class CrossEncoderTrainConfig(RunConfig):
    """A cross-encoder run: a listwise softmax over each query's group (its positive first, then hard
    negatives), the cross-entropy of the positive."""

    RESUMABLE_CHANGES: ClassVar[tuple[str, ...]] = (*RunConfig.RESUMABLE_CHANGES, "chunk_size")

    model: CrossEncoderModelSection = CrossEncoderModelSection()
    data: DataSection
    optim: OptimSection = OptimSection(batch_size=16)
    chunk_size: int | None = Field(
        None,
        ge=1,
        description="queries (with their groups) scored per forward pass; each chunk's loss is "
        "back-propagated on its own, which gives the batch's gradient exactly because a query's loss needs "
        "only its own group; none: the whole batch at once",
    )

    def input_paths(self) -> dict[str, str]:
        """The starting model, the collections and the training examples."""
        paths = {"model.path": self.model.path, "data.path": self.data.path, "data.train": self.data.train}
        return paths | {f"data.collections.{domain}": path for domain, path in self.data.collections.items()}

    @model_validator(mode="after")
    def _no_grad_cache(self) -> CrossEncoderTrainConfig:
        if self.grad_cache.enabled:
            raise ValueError("grad_cache does not apply to a cross-encoder: set chunk_size to bound memory")
        if self.data.group_size < 2:
            raise ValueError("data.group_size must be at least 2: the listwise loss needs a negative")
        if self.data.positives > 1:
            raise ValueError(
                "data.positives > 1 does not apply to a cross-encoder: its listwise loss has one positive "
                "per group"
            )
        if self.data.passage_embeddings:
            raise ValueError("data.passage_embeddings does not apply to a cross-encoder: it reads each query "
                             "and passage together")  # fmt: skip
        return self
