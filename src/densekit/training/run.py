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
from densekit.io.atomic import write_text_atomic
from densekit.models.encoder import DenseEncoder
from densekit.retrieval.in_memory import evaluate_encoder
from densekit.training import distributed
from densekit.training.config import ModelSection, RunConfig, TrainConfig
from densekit.training.contrastive import ContrastiveTask
from densekit.training.examples import check_example_ids, read_examples
from densekit.training.trainer import EvaluationHook, Trainer

log = logging.getLogger("densekit")


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


def start_run(config: RunConfig, output: Path) -> tuple[torch.device, str]:
    """What every run does first: pick the device, join the process group, seed, save the config.

    Returns the device and the config as YAML (checkpoints keep a copy).
    """
    device = training_device(config.device)
    distributed.init_from_environment(device)
    torch.manual_seed(config.seed)
    config_yaml = dump_config(config)
    if distributed.is_main():
        Path(output).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(output) / "config.yaml", config_yaml)
    return device, config_yaml


def run_training(
    config: TrainConfig, output: Path, resume: bool = False, show_progress: bool = True
) -> dict[str, Any]:
    """Train as `config` says, writing checkpoints, logs and the final model under `output`."""
    output = Path(output)
    device, config_yaml = start_run(config, output)

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
    return trainer.train(resume=resume)
