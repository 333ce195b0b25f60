"""`densekit train`: a contrastive fine-tuning run, with evaluation and ANCE's refreshed negatives,
assembled from the trainer, the contrastive task and the ANCE hook; and `densekit train-cross-encoder`,
the same trainer on the listwise cross-encoder task."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from densekit.data.dataset import Dataset
from densekit.data.examples import TrainingExample, check_example_ids, read_examples
from densekit.data.records import Document
from densekit.diagnostics import Diagnostics
from densekit.errors import InputError
from densekit.evaluation.encoder_evaluation import evaluate_encoder
from densekit.io.lock import holding
from densekit.models.cross_encoder import CrossEncoder
from densekit.models.encoder import DenseEncoder
from densekit.models.modules.module import is_module_folder
from densekit.training.ance.hook import AnceHook
from densekit.training.config import CrossEncoderTrainConfig, DataSection, TrainConfig
from densekit.training.contrastive import ContrastiveTask
from densekit.training.listwise import CrossEncoderTask
from densekit.training.modules import prepare_hypernetwork, prepare_module, prepare_route
from densekit.training.passage_vectors import load_passage_vectors
from densekit.training.run import start_run
from densekit.training.trainer import EvaluationHook, Trainer

log = logging.getLogger("densekit")

RUN_KIND = "training run"
CROSS_ENCODER_RUN_KIND = "cross-encoder training run"


def read_training_inputs(
    data: DataSection,
) -> tuple[Dataset, list[Document], dict[str, str], list[TrainingExample]]:
    """The collection, its documents, the texts of every document the examples may name, and the
    examples, checked (every id in its collection). An example whose domain is one of
    `data.collections` names documents of that collection; its ids are made distinct from the others'
    as `DOMAIN<US>ID` (US, the unit separator, which no id holds), in memory only."""
    dataset = Dataset.open(data.path)
    documents = list(dataset.iter_corpus())
    texts = {doc.id: doc.full_text for doc in documents}
    others = {
        domain: {doc.id: doc.full_text for doc in Dataset.open(path).iter_corpus()}
        for domain, path in data.collections.items()
    }
    diagnostics = Diagnostics()
    examples = read_examples(Path(data.train), diagnostics)
    check_example_ids(Path(data.train), examples, lambda e: others.get(e.domain, texts), diagnostics)
    if others:
        examples = [_namespaced(e) if e.domain in others else e for e in examples]
        for domain, theirs in others.items():
            texts.update({f"{domain}{SEPARATOR}{doc_id}": text for doc_id, text in theirs.items()})
    return dataset, documents, texts, examples


SEPARATOR = "\x1f"


def _namespaced(example: TrainingExample) -> TrainingExample:
    """`example` with its document ids prefixed by its domain."""
    prefix = f"{example.domain}{SEPARATOR}"
    scores = example.teacher_scores
    return example.model_copy(update={
        "positives": [prefix + d for d in example.positives],
        "negatives": [prefix + d for d in example.negatives],
        "teacher_scores": None if scores is None else {prefix + d: v for d, v in scores.items()},
    })  # fmt: skip


@holding("output")
def run_training(
    config: TrainConfig,
    output: Path,
    resume: bool | None = False,
    show_progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train as `config` says, writing checkpoints, logs and the final model under `output`.

    The collection, the examples and the evaluation split are read and checked before `output` is
    touched. `resume` and `overwrite` decide what happens when `output` holds a run already (see
    `densekit.training.run_folder.prepare_run_folder`).
    """
    output = Path(output)
    dataset, documents, texts, examples = read_training_inputs(config.data)
    evaluation_split = dataset.split_queries(config.eval.split) if config.eval.split is not None else None

    if config.modules is None and is_module_folder(config.model.path):
        raise InputError(
            f"model.path {config.model.path} is a module folder: set the modules section to train that "
            "module, or start from its base to fine-tune the whole model"
        )
    device, config_yaml, resumed = start_run(config, output, RUN_KIND, resume, overwrite)
    overrides = config.model.model_dump(exclude={"path", "trust_remote_code"})
    encoder = DenseEncoder.load(config.model.path, config.model.trust_remote_code, **overrides).to(device)
    route = prepare_route(encoder, config.route) if config.route is not None else None
    folders = config.route.modules if config.route is not None else None
    hypernetwork = None
    if config.hypernetwork is not None:
        hypernetwork = prepare_hypernetwork(encoder, config.hypernetwork, examples)
    passage_vectors = None
    if config.data.passage_embeddings:
        collections = {"": config.data.path, **config.data.collections}
        saved = config.data.passage_embeddings
        passage_vectors = load_passage_vectors(saved, encoder, collections, SEPARATOR)
    task = ContrastiveTask(encoder, examples, texts, config, route, folders, hypernetwork, passage_vectors)
    if config.modules is not None:
        prepare_module(encoder, config.modules, task)

    evaluation = None
    if evaluation_split is not None:
        queries, qrels = evaluation_split
        evaluation = EvaluationHook(
            lambda: evaluate_encoder(
                encoder,
                documents,
                queries,
                qrels,
                [config.eval.metric],
                config.eval.batch_size,
                config.optim.precision,
            ),
            config.eval.metric,
            config.eval.every,
        )
    hooks = [AnceHook(task, output, config.ance)] if config.ance.enabled else []
    trainer = Trainer(
        task, config.optim, config.checkpoint, output, config_yaml, config.log_every, evaluation,
        show_progress, hooks, config.report_to,
    )  # fmt: skip
    return trainer.train(resume=resumed)


@holding("output")
def run_cross_encoder_training(
    config: CrossEncoderTrainConfig,
    output: Path,
    resume: bool | None = False,
    show_progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train a cross-encoder as `config` says; it is saved to `output/model`. `resume` and `overwrite`
    are those of `run_training`."""
    output = Path(output)
    _, _, texts, examples = read_training_inputs(config.data)
    device, config_yaml, resumed = start_run(config, output, CROSS_ENCODER_RUN_KIND, resume, overwrite)
    cross_encoder = CrossEncoder.load(
        config.model.path, config.model.max_length, config.model.trust_remote_code
    ).to(device)
    task = CrossEncoderTask(cross_encoder, examples, texts, config)
    trainer = Trainer(
        task, config.optim, config.checkpoint, output, config_yaml, config.log_every, None, show_progress,
        report_to=config.report_to,
    )  # fmt: skip
    return trainer.train(resume=resumed)
