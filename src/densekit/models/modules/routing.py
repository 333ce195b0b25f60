"""Routing among the modules on one base: which modules encode each query, and with what weight.

A route names modules held by the encoder, in a fixed order, and gives every query a weight per module
(a row of a (queries x modules) matrix). The query's vector is the weighted sum of those modules'
vectors (aggregation by output averaging), normalised again when the encoder normalises; a module whose
weight is zero for every query of a batch is not run, and one with a weight runs on its rows only.

- fixed: the query's domain names its module (`domains`); an unknown domain is an error unless
  `fallback` names a module, or "base" for the base alone, stated in the route and logged;
- soft: a router (a linear layer on the base's query embedding) gives a softmax over all modules;
- top_k: the same router, the softmax over the k highest scores only, the rest weigh zero;
- fusion: attention over the modules' own outputs (AdapterFusion's idea, on the embeddings): the base's
  query vector, projected, is the attention query, each module's vector, projected, a key; the softmax
  of their scaled dot products weighs the modules' vectors. Every module runs on every query.

Routes act on queries. Passages are encoded once, by the base, so every module must leave passages to
the base (`towers: query`): one passage index then serves every route (RouterRetriever's layout).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from densekit.models.encoder import DenseEncoder

log = logging.getLogger("densekit")

BASE = "base"
MAX_ROUTE_MODULES = 256  # each is loaded onto the base; a route file cannot ask for a million


class RouteSpec(BaseModel):
    """A route over modules held by one encoder."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["fixed", "soft", "top_k", "fusion"]
    modules: list[str] = Field(
        min_length=1, max_length=MAX_ROUTE_MODULES,
        description="the modules routed among, in the router's order",
    )  # fmt: skip
    domains: dict[str, str] = Field(default_factory=dict, description="fixed: domain name -> module name")
    fallback: str | None = Field(
        None, description="fixed: the module for a domain not in `domains`, or 'base'; none: an error"
    )
    k: int | None = Field(None, ge=1, description="top_k: modules run per query")

    @model_validator(mode="after")
    def _consistent(self) -> RouteSpec:
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"modules {self.modules}: a module is named twice")
        unknown = sorted({*self.domains.values(), *([self.fallback] if self.fallback else [])}
                         - {*self.modules, BASE})  # fmt: skip
        if unknown:
            raise ValueError(
                f"domains or fallback name {unknown}, which are not among modules {self.modules}"
            )
        if self.type == "fixed" and not self.domains:
            raise ValueError("a fixed route needs domains: domain name -> module name")
        if self.type == "top_k" and (self.k is None or self.k > len(self.modules)):
            raise ValueError(f"top_k needs k between 1 and the {len(self.modules)} modules")
        if self.type != "top_k" and self.k is not None:
            raise ValueError(f"k applies to a top_k route, not to a {self.type} one")
        if self.type != "fixed" and (self.domains or self.fallback is not None):
            raise ValueError(f"domains and fallback apply to a fixed route, not to a {self.type} one")
        return self


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
