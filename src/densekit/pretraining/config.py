"""Every option of a pre-training run, in one YAML file; any of them overridable as `section.key=value`.

The `method` names a registered objective (`densekit.pretraining.objectives`), and each objective with
settings has a section of them, named after it: both are read from the registry, so a new objective's
file brings its name and its section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import create_model, model_validator

from densekit.pretraining import objectives  # noqa: F401  (importing the package registers every objective)
from densekit.pretraining.base import TASKS
from densekit.pretraining.settings import PretrainSettings

Method = Literal[tuple(TASKS)]  # type: ignore[valid-type]

ObjectiveSections = create_model(
    "ObjectiveSections",
    __base__=PretrainSettings,
    __module__=__name__,
    **{name: (task.settings, task.settings()) for name, task in TASKS.items() if task.settings is not None},
)  # type: ignore[call-overload]


class PretrainConfig(ObjectiveSections):  # type: ignore[valid-type,misc]
    """A pre-training run: the settings every run has and a section for each objective with settings."""

    method: Method = "condenser"

    @model_validator(mode="after")
    def _fits_its_objective(self) -> PretrainConfig:
        objective = TASKS.named(self.method)
        if self.grad_cache.enabled and not objective.takes_grad_cache:
            takers = [name for name, task in TASKS.items() if task.takes_grad_cache]
            raise ValueError(f"grad_cache applies to {' and '.join(takers)}'s contrastive loss only")
        objective.check(self)
        return self
