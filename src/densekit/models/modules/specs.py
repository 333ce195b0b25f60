"""What a module is, with its settings: the `modules:` section of a training config and the spec a
module folder holds, one of the registered kinds' specs (`densekit.models.modules.kinds`), told apart by
its `type`."""

from __future__ import annotations

import operator
from functools import reduce
from typing import Annotated

from pydantic import Field

from densekit.models.modules import kinds  # noqa: F401  (importing the package registers every kind)
from densekit.models.modules.kind import MODULE_KINDS

ModuleSpec = Annotated[
    reduce(operator.or_, [kind.spec for kind in MODULE_KINDS.values()]),  # type: ignore[valid-type]
    Field(discriminator="type"),
]
