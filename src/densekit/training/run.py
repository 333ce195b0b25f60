"""`densekit train`: contrastive fine-tuning from one configuration."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from densekit.ance.hook import AnceHook
from densekit.configuration import dump_config
from densekit.data.dataset import Dataset
from densekit.data.diagnostics import Diagnostics
from densekit.encoding.device import resolve_device
from densekit.models.encoder import DenseEncoder
from densekit.retrieval.in_memory import evaluate_encoder
from densekit.training import distributed
from densekit.training.config import ModelSection, RunConfig, TrainConfig
from densekit.training.contrastive import ContrastiveTask
from densekit.training.examples import check_example_ids, read_examples
from densekit.training.run_folder import prepare_run_folder
from densekit.training.trainer import EvaluationHook, Trainer

log = logging.getLogger("densekit")

RUN_KIND = "training run"


def training_device(setting: str) -> torch.device:
    """The device of this process: its own GPU under torchrun, else as `setting` says."""
    device = resolve_device(setting)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", distributed.local_rank())
        torch.cuda.set_device(device)
    return device


def load_encoder(model: ModelSection) -> DenseEncoder:
    """The encoder a run starts from, with the config's overrides."""
    return DenseEncoder.load(
        model.path,
        trust_remote_code=model.trust_remote_code,
        **model.model_dump(exclude={"path", "trust_remote_code"}),
    )


def start_run(
    config: RunConfig, output: Path, kind: str, resume: bool | None, overwrite: bool
) -> tuple[torch.device, str, bool]:
    """What every run does first: pick the device, join the process group, seed, and check that the
    output folder may take this run (see `prepare_run_folder`), saving the config there.

    Returns the device, the config as YAML (checkpoints keep a copy) and whether the run continues.
    """
    device = training_device(config.device)
    distributed.init_from_environment(device)
    torch.manual_seed(config.seed)
    config_yaml = dump_config(config)
    resumed = distributed.on_main(
        lambda: prepare_run_folder(Path(output), kind, config, config_yaml, resume, overwrite)
    )
    return device, config_yaml, resumed


def run_training(
    config: TrainConfig,
    output: Path,
    resume: bool | None = False,
    show_progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train as `config` says, writing checkpoints, logs and the final model under `output`.

    `resume` and `overwrite` decide what happens when `output` holds a run already (see
    `prepare_run_folder`).
    """
    output = Path(output)
    device, config_yaml, resumed = start_run(config, output, RUN_KIND, resume, overwrite)

    encoder = load_encoder(config.model).to(device)
    dataset = Dataset.open(config.data.path)
    documents = list(dataset.iter_corpus())
    texts = {doc.id: doc.full_text for doc in documents}
    diagnostics = Diagnostics()
    examples = read_examples(Path(config.data.train), diagnostics)
    check_example_ids(Path(config.data.train), examples, texts, diagnostics)
    task = ContrastiveTask(encoder, examples, texts, config)

    evaluation = None
    if config.eval.split is not None:
        queries, qrels = dataset.split_queries(config.eval.split)
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
