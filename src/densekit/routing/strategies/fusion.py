"""fusion: attention over the modules' own outputs (AdapterFusion's idea, on the embeddings): the base's
query vector, projected, is the attention query, each module's vector, projected, a key; the softmax of
their scaled dot products weighs the modules' vectors. Every module runs on every query."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from densekit.routing.strategy import (
    Domains,
    RouteParts,
    RouteSpec,
    RoutingStrategy,
    base_vectors,
    register_strategy,
)


class FusionSpec(RouteSpec):
    """A fusion route: attention of the base's query vector over every module's vector."""

    type: Literal["fusion"] = "fusion"


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


@register_strategy
class FusionStrategy(RoutingStrategy):
    """fusion: attention of the base's query vector over every module's vector (`Fusion`)."""

    spec = FusionSpec

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
