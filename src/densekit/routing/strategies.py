"""Routing among the modules on one base: which modules encode each query, and with what weight.

A route names modules held by the encoder, in a fixed order, and gives every query a weight per module
(a row of a (queries x modules) matrix). The query's vector is the weighted sum of those modules'
vectors (aggregation by output averaging), normalised again when the encoder normalises; a module whose
weight is zero for every query of a batch is not run, and one with a weight runs on its rows only.

How the weights are chosen is a strategy, a class registered under the name a route's `type` gives:

- fixed: the query's domain names its module (`domains`); an unknown domain is an error unless
  `fallback` names a module, or "base" for the base alone, stated in the route and logged;
- soft: a router (a linear layer on the base's query embedding) gives a softmax over all modules;
- top_k: the same router, the softmax over the k highest scores only, the rest weigh zero;
- fusion: attention over the modules' own outputs (AdapterFusion's idea, on the embeddings): the base's
  query vector, projected, is the attention query, each module's vector, projected, a key; the softmax
  of their scaled dot products weighs the modules' vectors. Every module runs on every query.

A new strategy is one class here, decorated with `@register_strategy` above `RouteSpec` (whose `type`
takes the registered names), with its test and its row in docs/routing.md (docs/design.md shows one).

Routes act on queries. Passages are encoded once, by the base, so every module must leave passages to
the base (`towers: query`): one passage index then serves every route (RouterRetriever's layout).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from densekit.models.encoder import DenseEncoder

log = logging.getLogger("densekit")

BASE = "base"
MAX_ROUTE_MODULES = 256  # each is loaded onto the base; a route file cannot ask for a million
Domains = Sequence[str | None]
TopK = Annotated[int | None, Field(ge=1, description="top_k: modules run per query")]


class RouteParts(Protocol):
    """What a strategy reads of a route (`densekit.routing.route.Route`): its encoder, whose modules it
    routes among, its spec and its router (None for a strategy without one)."""

    encoder: DenseEncoder
    spec: RouteSpec
    router: torch.nn.Module | None


def fixed_weights(spec: RouteSpec, domains: Sequence[str | None]) -> torch.Tensor:
    """One-hot rows choosing each query's module by its domain; a zero row means the base alone."""
    weights = torch.zeros(len(domains), len(spec.modules))
    fell_back = 0
    for row, domain in enumerate(domains):
        name = spec.domains.get(domain) if domain is not None else None
        if name is None:
            if spec.fallback is None:
                known = ", ".join(sorted(spec.domains))
                raise KeyError(f"domain {domain!r} has no module in this route (it knows: {known})")
            name, fell_back = spec.fallback, fell_back + 1
        if name != BASE:
            weights[row, spec.modules.index(name)] = 1.0
    if fell_back:
        log.info("%d of %d queries had no module for their domain: routed to %s", fell_back, len(domains),
                 spec.fallback)  # fmt: skip
    return weights


class Router(torch.nn.Module):
    """Scores every module for a query from the base's embedding of it (a linear layer)."""

    def __init__(self, dimension: int, modules: int):
        super().__init__()
        self.scores = torch.nn.Linear(dimension, modules)

    def forward(self, base_vectors: torch.Tensor) -> torch.Tensor:
        """(queries x modules) scores."""
        return self.scores(base_vectors)


class Fusion(torch.nn.Module):
    """Attention weights over module outputs: softmax_m((Q b) . (K v_m) / sqrt(d)) for the base's vector b
    and module vectors v_m."""

    def __init__(self, dimension: int):
        super().__init__()
        self.query = torch.nn.Linear(dimension, dimension)
        self.key = torch.nn.Linear(dimension, dimension)

    def forward(self, base_vectors: torch.Tensor, module_vectors: torch.Tensor) -> torch.Tensor:
        """(queries x modules) weights from (queries x d) base and (queries x modules x d) module vectors."""
        queries = self.query(base_vectors)
        keys = self.key(module_vectors)
        scores = torch.einsum("qd,qmd->qm", queries, keys) / queries.shape[-1] ** 0.5
        return F.softmax(scores, dim=-1)


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


def routed_vectors(
    encoder: DenseEncoder,
    modules: Sequence[str],
    weights: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """Query vectors as the `weights`-weighted sum of `modules`' vectors, normalised again when the
    encoder normalises; each module runs only on the rows that weigh it, and a row of zeros is the base's
    vector. The encoder's active module is not changed."""
    if weights.shape != (input_ids.shape[0], len(modules)):
        raise ValueError(f"weights of shape {tuple(weights.shape)} for {input_ids.shape[0]} queries and "
                         f"{len(modules)} modules")  # fmt: skip
    dtype = torch.float64 if next(encoder.parameters()).dtype == torch.float64 else torch.float32
    weights = weights.to(input_ids.device, dtype)
    mixed = torch.zeros(input_ids.shape[0], encoder.dimension, device=input_ids.device, dtype=dtype)
    every_row = torch.arange(input_ids.shape[0], device=input_ids.device)
    for column, name in enumerate(modules):
        # a weight of 0 that carries a gradient (straight-through top-k) needs its module's vectors too
        rows = every_row if weights.requires_grad else weights[:, column].nonzero().flatten()
        if len(rows):
            vectors = encoder.encode_with(name, input_ids[rows], attention_mask[rows], "query")
            mixed = mixed.index_add(0, rows, weights[rows, column, None] * vectors.to(dtype))
    base_rows = (weights.abs().sum(-1) == 0).nonzero().flatten()
    if len(base_rows):
        base = encoder.encode_with(None, input_ids[base_rows], attention_mask[base_rows], "query")
        mixed = mixed.index_copy(0, base_rows, base.to(dtype))
    if encoder.config.normalize:
        mixed = F.normalize(mixed, p=2, dim=-1)
    return mixed


def check_query_only(encoder: DenseEncoder, modules: Sequence[str]) -> None:
    """Refuse modules that change passages: a route shares one passage index, encoded by the base."""
    for name in modules:
        encoder.require_module(name)
        towers = encoder.attached[name].spec.towers
        if towers != "query":
            raise ValueError(
                f"module {name!r} has towers {towers!r}: a route serves every module from one passage index "
                "encoded by the base, so its modules must leave passages to the base (towers: query)"
            )


def base_vectors(route: RouteParts, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The base's query vectors of a padded batch (no gradient), in the router's precision."""
    with torch.no_grad():
        base = route.encoder.encode_with(None, input_ids, attention_mask, "query")
    return base.to(next(route.router.parameters()).dtype)


class RoutingStrategy:
    """How a route weighs its modules for each query.

    A subclass sets `name` (the `type` a route spec names it by), `trainable` (whether it has a router,
    which `densekit train` learns from a `route:` section), `balanced` (whether that training adds the
    load-balancing term) and `takes_domains` (whether queries come with their domain), and overrides:

    - `check(spec)`: refuse a spec that lacks what the strategy needs (`ValueError`, one line);
    - `refuse_settings(spec)`: refuse a spec of another type that sets what only this strategy takes;
    - `new_router(spec, dimension)`: its fresh `nn.Module` (its saved weights are that module's), or None;
    - `weights(route, input_ids, attention_mask, domains)`: each query's weight per module;
    - `vectors(...)`, when its vectors are not the weighted sum of its modules' (`routed_vectors`);
    - `training_weights(route, input_ids, attention_mask)`: the batch's weights while the router
      trains, and its balance loss (or None).

    Register it with `@register_strategy`; an instance serves every route of its type.
    """

    name: ClassVar[str]
    trainable: ClassVar[bool] = True
    balanced: ClassVar[bool] = False
    takes_domains: ClassVar[bool] = False

    def check(self, spec: RouteSpec) -> None:
        """Refuse a spec of this type that lacks a setting this strategy needs."""

    def refuse_settings(self, spec: RouteSpec) -> None:
        """Refuse a spec of another type that sets what only this strategy takes."""

    def new_router(self, spec: RouteSpec, dimension: int) -> torch.nn.Module | None:
        """A fresh router for `spec` on vectors of `dimension`, or None for a strategy without one."""
        return None

    def weights(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        """Each query's weight per module (queries x modules)."""
        raise NotImplementedError(f"routing strategy {self.name!r} gives no weights")

    def vectors(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        """Routed query vectors of a padded batch: the weighted sum of the modules' vectors."""
        weights = self.weights(route, input_ids, attention_mask, domains)
        return routed_vectors(route.encoder, route.spec.modules, weights, input_ids, attention_mask)

    def training_weights(
        self, route: RouteParts, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's weights as the router trains, and the balance loss to add (None: none)."""
        raise NotImplementedError(f"routing strategy {self.name!r} has no router to train")


STRATEGIES: dict[str, RoutingStrategy] = {}


def register_strategy(cls: type[RoutingStrategy]) -> type[RoutingStrategy]:
    """Register a routing strategy under its `name` (a class decorator); a name taken twice is an error."""
    if cls.name in STRATEGIES:
        raise TypeError(f"routing strategy {cls.name!r} is registered twice")
    STRATEGIES[cls.name] = cls()
    return cls


def strategy_named(name: str) -> RoutingStrategy:
    """The registered strategy called `name`; an unknown name is an error that lists the known ones."""
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise ValueError(f"no routing strategy {name!r}; densekit has {', '.join(STRATEGIES)}")
    return strategy


@register_strategy
class FixedStrategy(RoutingStrategy):
    """fixed: each query's domain names its module (`domains`, `fallback`); no router."""

    name = "fixed"
    trainable = False
    takes_domains = True

    def check(self, spec: RouteSpec) -> None:
        if not spec.domains:
            raise ValueError("a fixed route needs domains: domain name -> module name")

    def refuse_settings(self, spec: RouteSpec) -> None:
        if spec.domains or spec.fallback is not None:
            raise ValueError(f"domains and fallback apply to a fixed route, not to a {spec.type} one")

    def weights(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        if domains is None:
            raise ValueError("a fixed route needs each query's domain")
        return fixed_weights(route.spec, domains)


class RouterStrategy(RoutingStrategy):
    """A linear router's softmax over the modules, from the base's query vector (soft and top_k)."""

    balanced = True

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
        return soft_weights(scores, route.spec.k, straight_through)

    def training_weights(
        self, route: RouteParts, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The top-k (or full) softmax of the router's scores, and Switch Transformer's load-balancing
        loss of them."""
        scores = route.router(base_vectors(route, input_ids, attention_mask))
        weights = soft_weights(scores, route.spec.k)
        return weights, load_balancing_loss(scores, weights)


@register_strategy
class SoftStrategy(RouterStrategy):
    """soft: the router's softmax over every module."""

    name = "soft"


@register_strategy
class TopKStrategy(RouterStrategy):
    """top_k: the router's softmax over each query's k highest scores; the other modules weigh 0."""

    name = "top_k"

    def check(self, spec: RouteSpec) -> None:
        if spec.k is None or spec.k > len(spec.modules):
            raise ValueError(f"top_k needs k between 1 and the {len(spec.modules)} modules")

    def refuse_settings(self, spec: RouteSpec) -> None:
        if spec.k is not None:
            raise ValueError(f"k applies to a top_k route, not to a {spec.type} one")


@register_strategy
class FusionStrategy(RoutingStrategy):
    """fusion: attention of the base's query vector over every module's vector (`Fusion`)."""

    name = "fusion"

    def new_router(self, spec: RouteSpec, dimension: int) -> torch.nn.Module:
        return Fusion(dimension)

    def _fused(
        self, route: RouteParts, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fusion's weights and the modules' vectors (queries x modules x d)."""
        outputs = torch.stack(
            [
                route.encoder.encode_with(name, input_ids, attention_mask, "query")
                for name in route.spec.modules
            ],
            dim=1,
        )
        outputs = outputs.to(next(route.router.parameters()).dtype)
        return route.router(base_vectors(route, input_ids, attention_mask), outputs), outputs

    def weights(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        return self._fused(route, input_ids, attention_mask)[0]

    def vectors(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        """The attention-weighted sum of the modules' vectors, normalised again when the encoder
        normalises (every module runs on every query)."""
        weights, outputs = self._fused(route, input_ids, attention_mask)
        fused = torch.einsum("qm,qmd->qd", weights, outputs)
        return F.normalize(fused, dim=-1) if route.encoder.config.normalize else fused

    def training_weights(
        self, route: RouteParts, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention's weights, for the log only: a fusion has no balance term."""
        with torch.no_grad():
            return self.weights(route, input_ids, attention_mask, None), None


class RouteSpec(BaseModel):
    """A route over modules held by one encoder; its `type` names a registered strategy, which checks
    the settings it needs (`domains` and `fallback` for fixed, `k` for top_k)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal[tuple(STRATEGIES)]  # type: ignore[valid-type]
    modules: list[str] = Field(
        min_length=1, max_length=MAX_ROUTE_MODULES,
        description="the modules routed among, in the router's order",
    )  # fmt: skip
    domains: dict[str, str] = Field(default_factory=dict, description="fixed: domain name -> module name")
    fallback: str | None = Field(
        None, description="fixed: the module for a domain not in `domains`, or 'base'; none: an error"
    )
    k: TopK = None


    @model_validator(mode="after")
    def _consistent(self) -> RouteSpec:
        self.check()
        return self

    def check(self) -> None:
        """Refuse a module named twice, a domain or fallback naming no module, and settings the type's
        strategy lacks or does not take (`ValueError`, one line)."""
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"modules {self.modules}: a module is named twice")
        unknown = sorted({*self.domains.values(), *([self.fallback] if self.fallback else [])}
                         - {*self.modules, BASE})  # fmt: skip
        if unknown:
            raise ValueError(
                f"domains or fallback name {unknown}, which are not among modules {self.modules}"
            )
        strategy = self.strategy
        strategy.check(self)
        for other in STRATEGIES.values():
            if other is not strategy:
                other.refuse_settings(self)

    @property
    def strategy(self) -> RoutingStrategy:
        """The strategy its `type` names."""
        return strategy_named(self.type)


TRAINABLE_TYPES = tuple(name for name, strategy in STRATEGIES.items() if strategy.trainable)
TrainableType = Literal[TRAINABLE_TYPES]  # type: ignore[valid-type]  # what a training config's route: takes
