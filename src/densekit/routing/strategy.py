"""What a routing strategy is: its settings (a spec) and a class that weighs a route's modules for each
query, registered under the spec's `type` in a `densekit.registry.Registry`, as module kinds are.

A route names modules held by the encoder, in a fixed order, and gives every query a weight per module
(a row of a (queries x modules) matrix). The query's vector is the weighted sum of those modules'
vectors (aggregation by output averaging), normalised again when the encoder normalises; a module whose
weight is zero for every query of a batch is not run, and one with a weight runs on its rows only.

A strategy is one file in `densekit.routing.strategies`: a spec class (a `RouteSpec` whose `type` is a
one-value `Literal`, the strategy's name) and a `RoutingStrategy` subclass decorated with
`@register_strategy`. Importing that package registers every strategy in it; route folders, the
training config's `route:` section and every command then take the new `type`, and the shared tests run
it (`tests/test_routing.py`'s matrix is the registry's).

Routes act on queries. Passages are encoded once, by the base, so every module must leave passages to
the base (`towers: query`): one passage index then serves every route (RouterRetriever's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from densekit.errors import InputError
from densekit.models.encoder import DenseEncoder
from densekit.registry import Registry, spec_type

BASE = "base"
MAX_ROUTE_MODULES = 256  # each is loaded onto the base; a route file cannot ask for a million
Domains = Sequence[str | None]


def flat_settings() -> dict[str, Any]:
    """The settings every route spec is saved with, at their empty values where its strategy lacks them:
    one flat spec held every strategy's settings before each strategy had its own, and saving in that
    shape keeps route files and fingerprints as they were."""
    return {"domains": {}, "fallback": None, "k": None}


class RouteSpec(BaseModel):
    """What every route has: the name of its strategy (`type`) and the modules it routes among. A
    strategy's spec adds `type: Literal["<name>"] = "<name>"` and its own settings, and checks them.

    `RouteSpec(type=..., **settings)` makes the spec of the strategy `type` names (`RoutingStrategy.spec`);
    import it from `densekit.routing.strategies`, which registers them all. A field that holds any route
    spec is typed `densekit.routing.strategies.AnyRouteSpec`, their union told apart by `type`.
    """

    model_config = ConfigDict(extra="forbid")

    type: str
    modules: list[str] = Field(
        min_length=1, max_length=MAX_ROUTE_MODULES,
        description="the modules routed among, in the router's order",
    )  # fmt: skip

    def __new__(cls, **settings: Any) -> RouteSpec:
        if cls is RouteSpec:
            cls = strategy_named(str(settings.get("type"))).spec
        return super().__new__(cls)

    @model_validator(mode="before")
    @classmethod
    def _no_settings_of_other_strategies(cls, settings: Any) -> Any:
        """Drop the settings of other strategies left at their defaults (a spec saved flat says nothing
        with them) and refuse one set: it would be ignored."""
        if not isinstance(settings, dict) or cls is RouteSpec:
            return settings
        kept = dict(settings)
        for key, value in settings.items():
            owners = [s for s in STRATEGIES.values() if key in _own_settings(s.spec)]
            if key in cls.model_fields or not owners:
                continue
            if all(value == s.spec.model_fields[key].get_default(call_default_factory=True) for s in owners):
                del kept[key]
                continue
            named = _own_settings(owners[0].spec)
            raise ValueError(
                f"{' and '.join(named)} {'apply' if len(named) > 1 else 'applies'} to a "
                f"{' or '.join(s.name for s in owners)} route, not to a {spec_type(cls)} one"
            )
        return kept

    @model_validator(mode="after")
    def _each_module_once(self) -> RouteSpec:
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"modules {self.modules}: a module is named twice")
        return self

    @model_serializer(mode="wrap")
    def _saved_flat(self, handler: Any) -> dict[str, Any]:
        own = handler(self)
        flat = {"type": own.pop("type"), "modules": own.pop("modules")}
        flat.update({key: own.pop(key, empty) for key, empty in flat_settings().items()})
        return {**flat, **own}

    @property
    def strategy(self) -> RoutingStrategy:
        """The strategy its `type` names."""
        return strategy_named(self.type)


def _own_settings(spec: type[RouteSpec]) -> list[str]:
    """The settings a strategy's spec adds to every route's."""
    return [name for name in spec.model_fields if name not in RouteSpec.model_fields]


class RouteParts(Protocol):
    """What a strategy reads of a route (`densekit.routing.route.Route`): its encoder, whose modules it
    routes among, its spec and its router (None for a strategy without one)."""

    encoder: DenseEncoder
    spec: RouteSpec
    router: torch.nn.Module | None


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
        raise InputError(f"weights of shape {tuple(weights.shape)} for {input_ids.shape[0]} queries and "
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
            raise InputError(
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

    A subclass sets `spec` (its settings' class, whose `type` names the strategy), `trainable` (whether
    it has a router, which `densekit train` learns from a `route:` section), `balanced` (whether that
    training adds the load-balancing term) and `takes_domains` (whether queries come with their domain,
    which its spec then routes by `domains` and `fallback`), and overrides:

    - `new_router(spec, dimension)`: its fresh `nn.Module` (its saved weights are that module's), or None;
    - `weights(route, input_ids, attention_mask, domains)`: each query's weight per module;
    - `vectors(...)`, when its vectors are not the weighted sum of its modules' (`routed_vectors`);
    - `training_weights(route, input_ids, attention_mask)`: the batch's weights while the router
      trains, and its balance loss (or None).

    Register it with `@register_strategy`; an instance serves every route of its type.
    """

    spec: ClassVar[type[RouteSpec]]
    trainable: ClassVar[bool] = True
    balanced: ClassVar[bool] = False
    takes_domains: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """The strategy's name: the `type` its spec takes."""
        return spec_type(self.spec)

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


STRATEGIES: Registry[RoutingStrategy] = Registry(
    "routing strategy", lambda cls: spec_type(cls.spec), lambda cls: cls()
)
# `@register_strategy` registers a strategy under its spec's `type`; `strategy_named` finds it, an unknown
# name an error that lists the known ones
register_strategy = STRATEGIES.register
strategy_named = STRATEGIES.named
