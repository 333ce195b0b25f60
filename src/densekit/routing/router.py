"""The learned router soft and top_k routes share: a linear layer scoring every module from the base's
query vector, the softmax of its scores (over every module, or each query's k highest), and Switch
Transformer's load-balancing loss while it trains."""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field

from densekit.routing.strategy import Domains, RouteParts, RouteSpec, RoutingStrategy, base_vectors

TopK = Annotated[int | None, Field(ge=1, description="top_k: modules run per query")]


class Router(torch.nn.Module):
    """Scores every module for a query from the base's embedding of it (a linear layer)."""

    def __init__(self, dimension: int, modules: int):
        super().__init__()
        self.scores = torch.nn.Linear(dimension, modules)

    def forward(self, base_vectors: torch.Tensor) -> torch.Tensor:
        """(queries x modules) scores."""
        return self.scores(base_vectors)


def soft_weights(scores: torch.Tensor, k: int | None = None, straight_through: bool = False) -> torch.Tensor:
    """The softmax over each row's scores; with `k`, over its k highest only (the others weigh 0).

    A top-k choice passes no gradient to the scores of the modules left out, and with k = 1 none at
    all (the one weight is 1, and routed vectors are normalised again), so a router trained through it
    would never learn. With `straight_through` (training), the weights keep their top-k values but
    take the gradient of the full softmax (Bengio et al.'s straight-through estimator)."""
    if k is None or k >= scores.shape[-1]:
        return F.softmax(scores, dim=-1)
    top = scores.topk(k, dim=-1)
    kept = torch.full_like(scores, float("-inf")).scatter(-1, top.indices, top.values)
    chosen = F.softmax(kept, dim=-1)
    if not straight_through:
        return chosen
    soft = F.softmax(scores, dim=-1)
    return chosen + (soft - soft.detach())


def load_balancing_loss(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss: modules x sum over modules of (share of the queries' routing
    weight it gets, as chosen) x (its mean router probability); 1 when both are uniform, larger when a few
    modules take the queries, which it pushes back against (collapse)."""
    modules = scores.shape[-1]
    dispatched = (weights > 0).float()
    share = dispatched.sum(0) / dispatched.sum()
    probability = F.softmax(scores, dim=-1).mean(0)
    return modules * (share * probability).sum()


class RouterStrategy(RoutingStrategy):
    """A linear router's softmax over the modules, from the base's query vector; a subclass gives
    `top_k(spec)`, the modules each query keeps (None: every one)."""

    balanced = True

    def top_k(self, spec: RouteSpec) -> int | None:
        """How many of its highest-scored modules a query keeps (None: all)."""
        return None

    def new_router(self, spec: RouteSpec, dimension: int) -> torch.nn.Module:
        return Router(dimension, len(spec.modules))

    def weights(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        straight_through = route.router is not None and route.router.training and torch.is_grad_enabled()
        scores = route.router(base_vectors(route, input_ids, attention_mask))
        return soft_weights(scores, self.top_k(route.spec), straight_through)

    def training_weights(
        self, route: RouteParts, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The top-k (or full) softmax of the router's scores, and Switch Transformer's load-balancing
        loss of them."""
        scores = route.router(base_vectors(route, input_ids, attention_mask))
        weights = soft_weights(scores, self.top_k(route.spec))
        return weights, load_balancing_loss(scores, weights)
