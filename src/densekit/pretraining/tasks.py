"""The pre-training objective a config's `method` names, as a trainer task.

`TASKS` is the registry of objectives: each is a `PretrainTask` subclass in a module of its own (its
section of settings in `densekit.pretraining.config`, which names it in `Method`). The tests run every
objective in `TASKS` through the shared ones (export, resume), and check that `Method` names each.
"""

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
    """The task of `config.method` over `corpus`, training `mlm`; an unknown method is an error naming
    it and the known ones."""
    task = TASKS.get(config.method)
    if task is None:
        raise ValueError(f"no pre-training method {config.method!r}; densekit has {', '.join(TASKS)}")
    return task(mlm, corpus, config)
