"""Every routing strategy, one file each (a spec class and its `RoutingStrategy`, registered); importing
the package imports them all, in the order of their file names, so each registers itself. A new
strategy is one new file here.

Import route specs from here: `RouteSpec(type=..., ...)` makes the spec of any registered strategy, and
`AnyRouteSpec` types a field holding one (their union, told apart by `type`, as module specs are).
"""

import operator
from functools import reduce
from typing import Annotated, Literal

from pydantic import Field

from densekit.registry import import_every_module
from densekit.routing.strategy import STRATEGIES, RouteSpec, strategy_named

import_every_module(__name__, __path__)

AnyRouteSpec = Annotated[
    reduce(operator.or_, [strategy.spec for strategy in STRATEGIES.values()]),  # type: ignore[valid-type]
    Field(discriminator="type"),
]
TRAINABLE_TYPES = tuple(name for name, strategy in STRATEGIES.items() if strategy.trainable)
TrainableType = Literal[TRAINABLE_TYPES]  # type: ignore[valid-type]  # what a training config's route: takes

__all__ = ["STRATEGIES", "TRAINABLE_TYPES", "AnyRouteSpec", "RouteSpec", "TrainableType", "strategy_named"]
