"""BitFit (Ben Zaken et al., 2022), which peft does not provide: only biases train, as a parametrisation
`base + delta` of the tower's own copy of each bias, the delta zero at the start."""

from __future__ import annotations

from typing import Literal

import torch
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from densekit.models.modules.kind import BaseSpec, Positions, register_module_kind
from densekit.models.modules.own_kind import OwnKind
from densekit.models.modules.tower import Tower, freeze, shared_copy


class BitFitSpec(BaseSpec):
    """BitFit (Ben Zaken et al., 2022): only biases train (a learned change to each, zero at the start)."""

    type: Literal["bitfit"] = "bitfit"


class AddDelta(torch.nn.Module):
    """A parametrisation: the base tensor plus a learned change of its shape."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        """The changed tensor."""
        return original + self.delta


@register_module_kind
class BitFitKind(OwnKind):
    """BitFit folds into the weights: each bias plus its change."""

    spec = BitFitSpec
    title = "BitFit"
    mergeable = True

    def build(self, base: PreTrainedModel, spec: BitFitSpec, positions: Positions | None = None) -> Tower:
        """A tower of `base` whose every bias is parametrised as `base + delta`; the base's tensors are
        frozen."""
        freeze(base)
        model = shared_copy(base)
        for _, module in model.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter):
                parametrize.register_parametrization(module, "bias", AddDelta(bias.shape, bias.dtype))
        return Tower(model, base, torch.nn.ModuleDict())

    def parameters(self, base: torch.nn.Module, spec: BitFitSpec) -> int:
        return 0  # a change to the base's own biases, no more
