"""Prefix tuning (Li and Liang, 2021): learned keys and values before every layer's; by peft."""

from __future__ import annotations

from typing import Literal

import peft
import torch
from pydantic import Field

from densekit.models.modules.kind import BaseSpec, register_module_kind
from densekit.models.modules.layers import dimensions
from densekit.models.modules.peft_kind import TASK, PeftKind


class PrefixSpec(BaseSpec):
    """Prefix tuning (Li and Liang, 2021): learned keys and values before every layer's; by peft."""

    type: Literal["prefix"] = "prefix"
    virtual_tokens: int = Field(20, gt=0)
    projection: bool = Field(False, description="reparameterise the prefix through a two-layer MLP")


@register_module_kind
class PrefixKind(PeftKind):
    """Prefix tuning adds inputs the base has no weights for: it neither starts as the base nor folds."""

    spec = PrefixSpec
    title = "prefix tuning"
    starts_as_base = False
    size_setting = "virtual_tokens"

    def config(self, spec: PrefixSpec, base: torch.nn.Module | None = None) -> peft.PeftConfig:
        return peft.PrefixTuningConfig(
            num_virtual_tokens=spec.virtual_tokens, prefix_projection=spec.projection, task_type=TASK
        )

    def virtual_positions(self, spec: PrefixSpec) -> int:
        return spec.virtual_tokens

    def parameters(self, base: torch.nn.Module, spec: PrefixSpec) -> int:
        hidden, layers = dimensions(base)
        if spec.projection:  # an embedding, then hidden -> hidden -> every layer's keys and values
            return spec.virtual_tokens * hidden + hidden * (hidden + 1) + (hidden + 1) * layers * 2 * hidden
        return spec.virtual_tokens * layers * 2 * hidden
