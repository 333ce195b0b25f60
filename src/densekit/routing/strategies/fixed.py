"""fixed: each query's domain names its module (`domains`); an unknown domain is an error unless
`fallback` names a module, or "base" for the base alone, stated in the route and logged; no router."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator

from densekit.errors import InputError
from densekit.routing.strategy import BASE, Domains, RouteParts, RouteSpec, RoutingStrategy, register_strategy

log = logging.getLogger("densekit")


class FixedSpec(RouteSpec):
    """A fixed route: each query's domain names its module."""

    type: Literal["fixed"] = "fixed"
    domains: dict[str, str] = Field(default_factory=dict, description="fixed: domain name -> module name")
    fallback: str | None = Field(
        None, description="fixed: the module for a domain not in `domains`, or 'base'; none: an error"
    )

    @model_validator(mode="after")
    def _domains_name_its_modules(self) -> FixedSpec:
        unknown = sorted({*self.domains.values(), *([self.fallback] if self.fallback else [])}
                         - {*self.modules, BASE})  # fmt: skip
        if unknown:
            raise ValueError(
                f"domains or fallback name {unknown}, which are not among modules {self.modules}"
            )
        if not self.domains:
            raise ValueError("a fixed route needs domains: domain name -> module name")
        return self


def fixed_weights(spec: FixedSpec, domains: Sequence[str | None]) -> torch.Tensor:
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


@register_strategy
class FixedStrategy(RoutingStrategy):
    """fixed: each query's domain names its module (`domains`, `fallback`); no router."""

    spec = FixedSpec
    trainable = False
    takes_domains = True

    def weights(
        self,
        route: RouteParts,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Domains | None,
    ) -> torch.Tensor:
        if domains is None:
            raise InputError("a fixed route needs each query's domain")
        return fixed_weights(route.spec, domains)
