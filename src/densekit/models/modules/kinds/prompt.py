"""Prompt tuning (Lester et al., 2021): learned input embeddings before the text's; by peft."""

from __future__ import annotations

from typing import Literal

import peft
import torch
from pydantic import Field

from densekit.models.modules.kind import BaseSpec, register_module_kind
from densekit.models.modules.layers import dimensions
from densekit.models.modules.peft_kind import TASK, PeftKind


class PromptSpec(BaseSpec):
    """Prompt tuning (Lester et al., 2021): learned input embeddings before the text's; by peft."""

    type: Literal["prompt"] = "prompt"
    virtual_tokens: int = Field(20, gt=0)


@register_module_kind
class PromptKind(PeftKind):
    """Prompt tuning's learned inputs come out as states before the text's, which the tower drops; it
    neither starts as the base nor folds."""

    spec = PromptSpec
    title = "prompt tuning"
    starts_as_base = False
    size_setting = "virtual_tokens"

    def config(self, spec: PromptSpec, base: torch.nn.Module | None = None) -> peft.PeftConfig:
        return peft.PromptTuningConfig(num_virtual_tokens=spec.virtual_tokens, task_type=TASK)

    def virtual_positions(self, spec: PromptSpec) -> int:
        return spec.virtual_tokens

    def output_virtual_tokens(self, spec: PromptSpec) -> int:
        return spec.virtual_tokens

    def parameters(self, base: torch.nn.Module, spec: PromptSpec) -> int:
        return spec.virtual_tokens * dimensions(base)[0]
