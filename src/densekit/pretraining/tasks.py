"""The pre-training objective a config's `method` names, as a trainer task."""

from __future__ import annotations

from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.base import PretrainTask
from densekit.pretraining.cocondenser import CoCondenserTask
from densekit.pretraining.condenser import CondenserTask
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.corpus import TokenizedCorpus
from densekit.pretraining.mlm import MLMTask
from densekit.pretraining.retromae import RetroMAETask

TASKS: dict[str, type[PretrainTask]] = {
    "mlm": MLMTask,
    "condenser": CondenserTask,
    "cocondenser": CoCondenserTask,
    "retromae": RetroMAETask,
}


def make_task(mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainConfig) -> PretrainTask:
    """The task of `config.method` over `corpus`, training `mlm`."""
    return TASKS[config.method](mlm, corpus, config)
