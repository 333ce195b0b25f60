"""`densekit train`: a contrastive fine-tuning run, with evaluation and ANCE's refreshed negatives,
assembled from the trainer, the contrastive task and the ANCE hook."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from densekit.ance.hook import AnceHook
from densekit.data.dataset import Dataset
from densekit.data.examples import check_example_ids, read_examples
from densekit.diagnostics import Diagnostics
from densekit.models.encoder import DenseEncoder
from densekit.models.modules.module import is_module_folder
from densekit.retrieval.in_memory import evaluate_encoder
from densekit.training.config import TrainConfig
from densekit.training.contrastive import ContrastiveTask
from densekit.training.modules import prepare_module
from densekit.training.run import start_run
from densekit.training.trainer import EvaluationHook, Trainer

log = logging.getLogger("densekit")

RUN_KIND = "training run"


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
    dataset = Dataset.open(config.data.path)
    documents = list(dataset.iter_corpus())
    texts = {doc.id: doc.full_text for doc in documents}
    diagnostics = Diagnostics()
    examples = read_examples(Path(config.data.train), diagnostics)
    check_example_ids(Path(config.data.train), examples, texts, diagnostics)
    evaluation_split = dataset.split_queries(config.eval.split) if config.eval.split is not None else None

    if config.modules is None and is_module_folder(config.model.path):
        raise ValueError(
            f"model.path {config.model.path} is a module folder: set the modules section to train that "
            "module, or start from its base to fine-tune the whole model"
        )
    device, config_yaml, resumed = start_run(config, output, RUN_KIND, resume, overwrite)
    overrides = config.model.model_dump(exclude={"path", "trust_remote_code"})
    encoder = DenseEncoder.load(config.model.path, config.model.trust_remote_code, **overrides).to(device)
    task = ContrastiveTask(encoder, examples, texts, config)
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
        show_progress, hooks,
    )  # fmt: skip
    return trainer.train(resume=resumed)
