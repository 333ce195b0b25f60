"""`densekit pretrain`: one of the pre-training methods on a raw corpus, through the shared trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from densekit.io.lock import holding
from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.corpus import read_texts, tokenize_corpus
from densekit.pretraining.tasks import TASKS, make_task
from densekit.training import distributed
from densekit.training.run import start_run
from densekit.training.trainer import Trainer

RUN_KIND = "pre-training run"


@holding("output")
def run_pretraining(
    config: PretrainConfig,
    output: Path,
    resume: bool | None = False,
    show_progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Pre-train as `config` says; the encoder without heads is saved to `output/model`. `resume` and
    `overwrite` are those of `run_training`."""
    output = Path(output)
    texts = read_texts(Path(config.data.path))  # bad input fails here, before the folder is touched
    device, config_yaml, resumed = start_run(config, output, RUN_KIND, resume, overwrite)
    mlm = MaskedLanguageModel.load(config.model.path, config.model.trust_remote_code)
    corpus = tokenize_corpus(
        texts,
        mlm.tokenizer,
        None if TASKS.named(config.method).whole_documents else config.model.max_length - 2,
        show_progress and distributed.is_main(),
    )
    task = make_task(mlm, corpus, config)
    task.module.to(device)
    trainer = Trainer(
        task, config.optim, config.checkpoint, output, config_yaml, config.log_every, None, show_progress,
        report_to=config.report_to,
    )  # fmt: skip
    return trainer.train(resume=resumed)
