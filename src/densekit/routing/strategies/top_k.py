"""top_k: the soft route's router, the softmax over each query's k highest scores only, the rest weigh
zero (a module left out of a batch's every query is not run)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from densekit.routing.router import RouterStrategy, TopK
from densekit.routing.strategy import RouteSpec, register_strategy


class TopKSpec(RouteSpec):
    """A top_k route: the router's softmax over each query's `k` highest-scored modules."""

    type: Literal["top_k"] = "top_k"
    k: TopK = None

    @model_validator(mode="after")
    def _k_of_its_modules(self) -> TopKSpec:
        if self.k is None or self.k > len(self.modules):
            raise ValueError(f"top_k needs k between 1 and the {len(self.modules)} modules")
        return self


@register_strategy
class TopKStrategy(RouterStrategy):
    """top_k: the router's softmax over each query's k highest scores; the other modules weigh 0."""

    spec = TopKSpec

    def top_k(self, spec: TopKSpec) -> int | None:
        return spec.k
