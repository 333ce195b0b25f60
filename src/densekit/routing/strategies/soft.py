"""soft: a router (a linear layer on the base's query embedding) gives a softmax over all modules."""

from __future__ import annotations

from typing import Literal

from densekit.routing.router import RouterStrategy
from densekit.routing.strategy import RouteSpec, register_strategy


class SoftSpec(RouteSpec):
    """A soft route: the router's softmax over every module."""

    type: Literal["soft"] = "soft"


@register_strategy
class SoftStrategy(RouterStrategy):
    """soft: the router's softmax over every module."""

    spec = SoftSpec
