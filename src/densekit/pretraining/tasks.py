"""The pre-training objective a config's `method` names, as a trainer task.

`TASKS` is the registry of objectives (`densekit.pretraining.base`), filled by the files of
`densekit.pretraining.objectives`. The tests run every objective in it through the shared ones
(export, resume).
"""

from __future__ import annotations

from densekit.pretraining.backbone import MaskedLanguageModel
from densekit.pretraining.base import TASKS, PretrainTask
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.corpus import TokenizedCorpus

__all__ = ["TASKS", "make_task"]


def make_task(mlm: MaskedLanguageModel, corpus: TokenizedCorpus, config: PretrainConfig) -> PretrainTask:
    """The task of `config.method` over `corpus`, training `mlm`; an unknown method is an error naming
    it and the known ones."""
    return TASKS.named(config.method)(mlm, corpus, config)
